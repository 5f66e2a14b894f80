"""Shrink mode's rank mask (Buffer(..., enable_shrink=True)): DeepEP's three
``low_latency_*_mask_buffer`` methods. Each runs on the current stream, as
DeepEP's do, after the buffer's last op (streams.follow)."""
import torch

from ..checks import check_int, check_tensor
from .context import OpContext
from .streams import follow


def _require_shrink(context: OpContext, op: str) -> None:
    if not context.native.shrink_enabled:
        raise RuntimeError(f"{op}: this buffer was created without enable_shrink=True")


def _stream(context: OpContext) -> int:
    """The current stream, once it follows the buffer's last op."""
    stream = torch.cuda.current_stream().cuda_stream
    if context.tail != stream:
        follow(context, stream)
    return stream


def update(context: OpContext, rank_to_mask: int, mask: bool) -> None:
    op = "low_latency_update_mask_buffer"
    _require_shrink(context, op)
    check_int(op, "rank_to_mask", rank_to_mask, 0, context.num_ranks - 1)
    if not isinstance(mask, bool):
        raise TypeError(f"{op}: mask must be a bool, got {type(mask).__name__}")
    context.native.update_mask(rank=rank_to_mask, masked=mask, stream=_stream(context))


def query(context: OpContext, mask_status: torch.Tensor) -> None:
    op = "low_latency_query_mask_buffer"
    _require_shrink(context, op)
    check_tensor(op, "mask_status", mask_status, dtype=torch.int32, shape=(context.num_ranks,), device=context.device)
    context.native.query_mask(out=mask_status.data_ptr(), stream=_stream(context))


def clean(context: OpContext) -> None:
    op = "low_latency_clean_mask_buffer"
    _require_shrink(context, op)
    context.native.clean_mask(stream=_stream(context))
