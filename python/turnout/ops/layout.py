"""get_dispatch_layout: from each token's top-k experts, how many tokens go to
each rank and expert, and which ranks each token must reach."""
from typing import Optional

import torch

from ..checks import TOPK_IDX_DTYPE, check_int, check_tensor, fail, is_plain_nd
from ..event import EventOverlap
from .context import OpContext
from .streams import OpStreams


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
    with OpStreams(context, op, previous_event, async_finish, allocate_on_comm_stream) as streams:
        # Every count in one allocation, split in one call (cheaper than a slice each).
        counts = torch.empty(num_ranks + (num_rdma_ranks if has_rdma else 0) + num_experts, dtype=torch.int32,
                             device=device)
        if has_rdma:
            num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert = counts.split_with_sizes(
                [num_ranks, num_rdma_ranks, num_experts])
        else:
            num_tokens_per_rank, num_tokens_per_expert = counts.split_with_sizes([num_ranks, num_experts])
            num_tokens_per_rdma_rank = None
        is_token_in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=device)
        context.native.get_dispatch_layout(
            topk_idx=topk_idx.data_ptr(), num_tokens=num_tokens, num_topk=num_topk, num_experts=num_experts,
            num_tokens_per_rank=num_tokens_per_rank.data_ptr(),
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank.data_ptr() if has_rdma else 0,
            num_tokens_per_expert=num_tokens_per_expert.data_ptr(), is_token_in_rank=is_token_in_rank.data_ptr(),
            stream=context.comm_raw, wait_for=streams.wait_for, join_to=streams.join_to)
    event = streams.finish((topk_idx, counts, is_token_in_rank))
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event
