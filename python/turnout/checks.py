"""Argument checks of the Python layer. Every message names the op, the
argument, what was expected and what came."""
from typing import Optional, Sequence

import torch


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
