"""Argument checks of the Python layer. Every message names the op, the
argument, what was expected and what came."""
from typing import Optional, Sequence, Tuple

import torch

from . import _C

# The dtype of expert indices (``topk_idx``) every op takes.
TOPK_IDX_DTYPE = torch.int64


def fail(op: str, arg: str, expected: str, got: object, kind=ValueError):
    raise kind(f"{op}: {arg} must be {expected}, got {got}")


def check_int(op: str, arg: str, value, low: Optional[int] = None, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(op, arg, "an int", type(value).__name__, TypeError)
    if low is not None and value < low:
        fail(op, arg, f">= {low}", value)
    if high is not None and value > high:
        fail(op, arg, f"<= {high}", value)
    return value


def check_tensor(op: str, arg: str, t, dtype: Optional[torch.dtype] = None, ndim: Optional[int] = None,
                 shape: Optional[Sequence[Optional[int]]] = None, device: Optional[torch.device] = None,
                 contiguous: bool = True) -> torch.Tensor:
    """``shape`` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        fail(op, arg, "a torch.Tensor", type(t).__name__, TypeError)
    if dtype is not None and t.dtype != dtype:
        fail(op, arg, f"of dtype {dtype}", t.dtype, TypeError)
    # get_device() is an int (-1 off the GPU): cheaper than building t.device.
    if device is not None and t.get_device() != device.index and t.device != device:
        fail(op, arg, f"on {device}", t.device)
    if ndim is not None and t.dim() != ndim:
        fail(op, arg, f"{ndim}-D", f"shape {tuple(t.shape)}")
    # torch.Size equals a tuple of ints: one comparison where no size is free.
    if shape is not None and t.shape != shape:
        if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            fail(op, arg, f"of shape {want}", f"shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        fail(op, arg, "contiguous", f"strides {t.stride()}")
    return t


def is_plain(t, dtype: torch.dtype, shape: tuple, device_index: int) -> bool:
    """check_tensor's passing case as one expression, for hot paths: a
    contiguous torch.Tensor of this dtype and shape on GPU ``device_index``.
    False sends the caller to check_tensor, which names what is wrong (or
    accepts what this is too strict for, a Tensor subclass say)."""
    return (type(t) is torch.Tensor and t.dtype == dtype and t.shape == shape and t.get_device() == device_index
            and t.is_contiguous())


def is_plain_nd(t, dtype: torch.dtype, ndim: int, device_index: int) -> bool:
    """is_plain for a tensor whose sizes the caller checks itself: a
    contiguous ``ndim``-D torch.Tensor of this dtype on GPU ``device_index``."""
    return (type(t) is torch.Tensor and t.dtype == dtype and t.dim() == ndim and t.get_device() == device_index
            and t.is_contiguous())


def check_aligned(op: str, arg: str, t: torch.Tensor) -> None:
    """Rows move as 16-byte words: a view that starts mid-word cannot."""
    if t.numel() and t.data_ptr() % 16:
        fail(op, arg, "starting at a 16-byte aligned address", f"address {t.data_ptr():#x}")


def check_config(op: str, config) -> "_C.Config":
    if not isinstance(config, _C.Config):
        fail(op, "config", "a turnout.Config or None", type(config).__name__, TypeError)
    return config


def check_x(op: str, x, device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns (data, scales or None) of a dispatch's x: bf16 [T, H], or (fp8 [T, H], scales [T, S])."""
    if isinstance(x, tuple):
        if len(x) != 2:
            fail(op, "x", "a bf16 tensor or a tuple (x_fp8, scales)", f"a tuple of {len(x)}", TypeError)
        data, scales = x
        check_tensor(op, "x[0]", data, dtype=torch.float8_e4m3fn, ndim=2, device=device)
        check_tensor(op, "x[1] (scales)", scales, ndim=2, device=device, contiguous=False)
        if scales.dtype not in (torch.float32, torch.int32):
            fail(op, "x[1] (scales)", "of dtype torch.float32 (or torch.int32 for packed UE8M0)", scales.dtype,
                 TypeError)
        if scales.shape[0] != data.shape[0]:
            fail(op, "x[1] (scales)", f"of {data.shape[0]} rows like x[0]", f"shape {tuple(scales.shape)}")
        if data.shape[1] % 16:
            fail(op, "x[0]", "of a hidden size that is a multiple of 16", f"shape {tuple(data.shape)}")
        check_aligned(op, "x[0]", data)
        return data, scales
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=2, device=device)
    if x.shape[1] % 8:
        fail(op, "x", "of a hidden size that is a multiple of 8", f"shape {tuple(x.shape)}")
    check_aligned(op, "x", x)
    return x, None
