"""Intranode normal mode: dispatch (fresh, or cached from a handle) and combine
inside one NVL domain."""
from typing import Optional

import torch

from ..checks import TOPK_IDX_DTYPE, check_aligned, check_int, check_tensor, check_x, fail, is_plain, is_plain_nd
from ..event import EventOverlap
from .context import OpContext
from .handle import allocate_source_info, check_handle, new_handle
from .streams import OpStreams


def dispatch(context: OpContext, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
             topk_weights, expert_alignment: int, num_worst_tokens: int, config,
             previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool):
    """Buffer.dispatch with its config resolved. A cached dispatch (``handle``
    given) takes the receive layout from the handle; a fresh one exchanges
    the counts first and, without num_worst_tokens, waits for them."""
    op = "dispatch"
    device, num_ranks, index = context.device, context.num_ranks, context.device_index
    # Each check's common case in one expression first; the full check, which
    # names what is wrong, when it fails.
    if is_plain_nd(x, torch.bfloat16, 2, index) and not x.shape[1] % 8 and not x.data_ptr() % 16:
        data, scales = x, None
    else:
        data, scales = check_x(op, x, device)
    num_tokens, hidden = data.shape
    if not (type(expert_alignment) is int and expert_alignment >= 1):
        check_int(op, "expert_alignment", expert_alignment, 1)
    if not (type(num_worst_tokens) is int and num_worst_tokens >= 0):
        check_int(op, "num_worst_tokens", num_worst_tokens, 0)
    cached = handle is not None
    num_experts = num_topk = 0
    if cached:
        rank_prefix_matrix, _, cached_src_idx, is_token_in_rank = check_handle(context, op, handle)
        if topk_idx is not None or topk_weights is not None:
            fail(op, "topk_idx", "None with a handle (cached dispatch)", "a tensor")
        if is_token_in_rank.shape[0] != num_tokens:
            fail(op, "x", f"of {is_token_in_rank.shape[0]} rows, the tokens of the handle's dispatch",
                 f"{num_tokens} rows")
        num_recv = cached_src_idx.shape[0]
    else:
        if not is_plain(is_token_in_rank, torch.bool, (num_tokens, num_ranks), index):
            check_tensor(op, "is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, num_ranks),
                         device=device)
        if not is_plain(num_tokens_per_rank, torch.int32, (num_ranks,), index):
            check_tensor(op, "num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(num_ranks,),
                         device=device)
        if not is_plain_nd(num_tokens_per_expert, torch.int32, 1, index):
            check_tensor(op, "num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, ndim=1,
                         device=device)
        num_experts = num_tokens_per_expert.shape[0]
        if num_experts == 0 or num_experts % num_ranks:
            fail(op, "num_tokens_per_expert", f"of a length that is a positive multiple of the group size {num_ranks}",
                 f"shape {tuple(num_tokens_per_expert.shape)}")
        if (topk_idx is None) != (topk_weights is None):
            fail(op, "topk_weights" if topk_weights is None else "topk_idx", "given with the other top-k tensor",
                 None)
        if topk_idx is not None:
            if not is_plain_nd(topk_idx, TOPK_IDX_DTYPE, 2, index):
                check_tensor(op, "topk_idx", topk_idx, dtype=TOPK_IDX_DTYPE, ndim=2, device=device)
            num_topk = topk_idx.shape[1]
            if topk_idx.shape[0] != num_tokens:
                fail(op, "topk_idx", f"of {num_tokens} rows like x", f"shape {tuple(topk_idx.shape)}")
            if not is_plain(topk_weights, torch.float32, (num_tokens, num_topk), index):
                check_tensor(op, "topk_weights", topk_weights, dtype=torch.float32, shape=(num_tokens, num_topk),
                             device=device)
    if scales is not None:
        num_scales = scales.shape[1]
        stride_token, stride_group = scales.stride()
    else:
        num_scales = stride_token = stride_group = 0

    native, stream = context.native, context.comm_raw
    with OpStreams(context, op, previous_event, async_finish, allocate_on_comm_stream) as streams:
        in_rank_ptr = is_token_in_rank.data_ptr()
        topk_idx_ptr = topk_idx.data_ptr() if num_topk else 0
        if cached:
            prefix_ptr = rank_prefix_matrix.data_ptr()
            # The counts are known: the notify step only refreshes the channel starts.
            native.dispatch_counts(
                is_token_in_rank=in_rank_ptr, num_tokens=num_tokens, num_tokens_per_expert=0, num_experts=0,
                topk_idx=0, num_topk=0, expert_alignment=1, num_worst_tokens=num_recv, config=config,
                rank_prefix_matrix=prefix_ptr, stream=stream, wait_for=streams.wait_for)
            per_expert = None
        else:
            # new_empty of a checked tensor of the dtype wanted: fewer arguments to parse than torch.empty.
            rank_prefix_matrix = num_tokens_per_rank.new_empty(num_ranks, num_ranks)
            prefix_ptr = rank_prefix_matrix.data_ptr()
            # Without num_worst_tokens this waits on the host for the receive sizes.
            num_recv, per_expert = native.dispatch_counts(
                is_token_in_rank=in_rank_ptr, num_tokens=num_tokens,
                num_tokens_per_expert=num_tokens_per_expert.data_ptr(), num_experts=num_experts,
                topk_idx=topk_idx_ptr, num_topk=num_topk, expert_alignment=expert_alignment,
                num_worst_tokens=num_worst_tokens, config=config, rank_prefix_matrix=prefix_ptr, stream=stream,
                wait_for=streams.wait_for)
            if num_worst_tokens:
                num_recv, per_expert = num_worst_tokens, []
        # Sizes as separate ints (torch parses them ~1 us faster than a tuple), each
        # from new_empty of a checked input of its dtype (fewer arguments than torch.empty).
        recv_x = data.new_empty(num_recv, hidden)
        recv_scales = scales.new_empty(num_recv, num_scales) if scales is not None else None
        recv_topk_idx = topk_idx.new_empty(num_recv, num_topk) if num_topk else None
        recv_topk_weights = topk_weights.new_empty(num_recv, num_topk) if num_topk else None
        # A cached dispatch keeps the handle it was given: no source info to write.
        if cached:
            source_info = source_num_tokens = recv_src_idx = None
        else:
            source_info, source_num_tokens, recv_src_idx = allocate_source_info(num_ranks, num_recv, device)
        native.dispatch(
            x=data.data_ptr(), num_tokens=num_tokens, row_bytes=hidden * data.element_size(),
            x_scales=scales.data_ptr() if scales is not None else 0, num_scales=num_scales,
            scale_stride_token=stride_token, scale_stride_group=stride_group, topk_idx=topk_idx_ptr,
            topk_weights=topk_weights.data_ptr() if num_topk else 0, num_topk=num_topk, num_experts=num_experts,
            is_token_in_rank=in_rank_ptr, rank_prefix_matrix=prefix_ptr, num_recv_rows=num_recv,
            num_worst_tokens=0 if cached else num_worst_tokens, config=config, recv_x=recv_x.data_ptr(),
            recv_x_scales=recv_scales.data_ptr() if recv_scales is not None else 0,
            recv_topk_idx=recv_topk_idx.data_ptr() if num_topk else 0,
            recv_topk_weights=recv_topk_weights.data_ptr() if num_topk else 0,
            recv_src_idx=recv_src_idx.data_ptr() if recv_src_idx is not None else 0,
            source_num_tokens=source_num_tokens.data_ptr() if source_num_tokens is not None else 0, stream=stream,
            join_to=streams.join_to)
    event = streams.finish((data, scales, topk_idx, topk_weights, is_token_in_rank, rank_prefix_matrix, recv_x,
                            recv_scales, recv_topk_idx, recv_topk_weights, source_info))
    out_x = (recv_x, recv_scales) if scales is not None else recv_x
    if cached:
        return out_x, None, None, None, None, event
    return (out_x, recv_topk_idx, recv_topk_weights, per_expert,
            new_handle(context, rank_prefix_matrix, source_num_tokens, recv_src_idx, is_token_in_rank), event)


def _checked_biases(context: OpContext, op: str, bias, num_tokens: int, hidden: int) -> list:
    """combine's bias (a tensor or a tuple of two, each may be None) as the list of its tensors, checked."""
    biases = bias if isinstance(bias, tuple) else (bias,)
    if len(biases) > 2:
        fail(op, "bias", "None, a tensor or a tuple of two tensors", f"a tuple of {len(biases)}", TypeError)
    for i, b in enumerate(biases):
        if b is not None and not (is_plain(b, torch.bfloat16, (num_tokens, hidden), context.device_index)
                                  and not b.data_ptr() % 16):
            name = f"bias[{i}]" if isinstance(bias, tuple) else "bias"
            check_tensor(op, name, b, dtype=torch.bfloat16, shape=(num_tokens, hidden), device=context.device)
            check_aligned(op, name, b)
    return [b for b in biases if b is not None]


def combine(context: OpContext, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor], bias, config,
            previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool):
    """Buffer.combine with its config resolved."""
    op = "combine"
    device, index = context.device, context.device_index
    rank_prefix_matrix, source_num_tokens, recv_src_idx, is_token_in_rank = check_handle(context, op, handle)
    num_rows = recv_src_idx.shape[0]
    num_tokens = is_token_in_rank.shape[0]
    if not is_plain_nd(x, torch.bfloat16, 2, index):
        check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=2, device=device)
    if x.shape[0] != num_rows:
        fail(op, "x", f"of {num_rows} rows (the handle's receive count)", f"shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden % 8:
        fail(op, "x", "of a hidden size that is a multiple of 8", f"shape {tuple(x.shape)}")
    if x.data_ptr() % 16:
        check_aligned(op, "x", x)
    num_topk = 0
    if topk_weights is not None:
        if not is_plain_nd(topk_weights, torch.float32, 2, index):
            check_tensor(op, "topk_weights", topk_weights, dtype=torch.float32, ndim=2, device=device)
        num_topk = topk_weights.shape[1]
        if topk_weights.shape[0] != num_rows:
            fail(op, "topk_weights", f"of {num_rows} rows like x", f"shape {tuple(topk_weights.shape)}")
    biases = [] if bias is None else _checked_biases(context, op, bias, num_tokens, hidden)

    with OpStreams(context, op, previous_event, async_finish, allocate_on_comm_stream) as streams:
        # new_empty of the checked inputs of their dtypes: fewer arguments to parse than torch.empty.
        combined_x = x.new_empty(num_tokens, hidden)
        combined_topk_weights = topk_weights.new_empty(num_tokens, num_topk) if num_topk else None
        context.native.combine(
            x=x.data_ptr(), num_rows=num_rows, hidden=hidden, topk_weights=topk_weights.data_ptr() if num_topk else 0,
            num_topk=num_topk, bias0=biases[0].data_ptr() if biases else 0,
            bias1=biases[1].data_ptr() if len(biases) > 1 else 0, rank_prefix_matrix=rank_prefix_matrix.data_ptr(),
            source_num_tokens=source_num_tokens.data_ptr(), recv_src_idx=recv_src_idx.data_ptr(),
            is_token_in_rank=is_token_in_rank.data_ptr(), num_tokens=num_tokens, config=config,
            combined_x=combined_x.data_ptr(),
            combined_topk_weights=combined_topk_weights.data_ptr() if num_topk else 0, stream=context.comm_raw,
            wait_for=streams.wait_for, join_to=streams.join_to)
    event = streams.finish((x, topk_weights, *biases, rank_prefix_matrix, source_num_tokens, recv_src_idx,
                            is_token_in_rank, combined_x, combined_topk_weights))
    return combined_x, combined_topk_weights, event
