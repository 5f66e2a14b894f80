"""get_dispatch_layout: from each token's top-k experts, how many tokens go to
each rank and expert, and which ranks each token must reach."""
from typing import Optional

import torch

from ..checks import TOPK_IDX_DTYPE, check_int, check_tensor, fail, is_plain_nd
from ..event import EventOverlap
from . import streams as op_streams
from .context import OpContext

_I32 = torch.int32
_BOOL = torch.bool


def get_dispatch_layout(context: OpContext, topk_idx: torch.Tensor, num_experts: int,
                        previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool):
    op = "get_dispatch_layout"
    device, num_ranks = context.device, context.num_ranks
    # Each check's common case in one expression first; the full check, which
    # names what is wrong, when it fails.
    if not is_plain_nd(topk_idx, TOPK_IDX_DTYPE, 2, context.device_index):
        check_tensor(op, "topk_idx", topk_idx, dtype=TOPK_IDX_DTYPE, ndim=2, device=device)
    if not (type(num_experts) is int and num_experts >= 1):
        check_int(op, "num_experts", num_experts, 1)
    if num_experts % num_ranks:
        fail(op, "num_experts", f"a multiple of the group size {num_ranks}", num_experts)
    num_tokens, num_topk = topk_idx.shape
    num_rdma_ranks = context.num_rdma_ranks
    has_rdma = num_rdma_ranks > 1
    native = context.native
    # A plain call makes no OpStreams: it runs on the caller's stream, after the buffer's last op.
    streams, wait_for, join_to, stream = op_streams.normal_op_streams(context, op, previous_event, async_finish,
                                                                      allocate_on_comm_stream)
    try:
        # An allocation per output, each new_empty of the checked topk_idx: cheaper
        # than torch.empty's arguments, or one allocation split in several.
        num_tokens_per_rank = topk_idx.new_empty(num_ranks, dtype=_I32)
        num_tokens_per_rdma_rank = topk_idx.new_empty(num_rdma_ranks, dtype=_I32) if has_rdma else None
        num_tokens_per_expert = topk_idx.new_empty(num_experts, dtype=_I32)
        is_token_in_rank = topk_idx.new_empty(num_tokens, num_ranks, dtype=_BOOL)
        native.get_dispatch_layout(
            topk_idx.data_ptr(), num_tokens, num_topk, num_experts, num_tokens_per_rank.data_ptr(),
            num_tokens_per_rdma_rank.data_ptr() if has_rdma else 0, num_tokens_per_expert.data_ptr(),
            is_token_in_rank.data_ptr(), stream, wait_for, join_to)
    except BaseException:
        op_streams.unwind(context, streams)
        raise
    if streams is None:
        event = EventOverlap()
    else:
        event = streams.finish((topk_idx, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                                is_token_in_rank))
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event
