"""Internode normal mode: dispatch (fresh, or cached from a handle) and combine
over several NVL domains (docs/INTERNODE.md). The same calls and outputs as
intranode; the handle has DeepEP's ten entries."""
from typing import Optional

import torch

from ..checks import TOPK_IDX_DTYPE, check_aligned, check_int, check_tensor, check_x, fail
from ..event import EventOverlap
from .context import OpContext
from .internode_handle import check_handle, new_handle, shrink_mode
from .streams import OpStreams


def num_channels(context: OpContext, config) -> int:
    """The channels a call runs: a block pair per two of its SMs (within the
    buffer's SM budget), each running the native's channels per block."""
    native = context.native
    return min(config.num_sms, native.sm_budget) // 2 * native.internode_channels_per_block


def require_domains(context: OpContext, op: str) -> None:
    if context.num_rdma_ranks == 1:
        raise ValueError(f"{op}: this buffer's group is one NVL domain; internode mode needs a group that spans "
                         "several (declare smaller domains with nvl_domain_size= or TURNOUT_NVL_DOMAIN_SIZE)")


def _addresses(entries) -> list:
    """The handle's eleven addresses (0 for [10] without shrink mode)."""
    addresses = [0 if t is None else t.data_ptr() for t in entries]
    return addresses + [0] * (11 - len(addresses))


def dispatch(context: OpContext, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment: int, num_worst_tokens: int, config,
             previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool):
    """Buffer.dispatch (and internode_dispatch) across NVL domains, its config
    resolved. A cached dispatch (``handle`` given) takes its sizes from the
    handle; a fresh one exchanges the counts first and, without
    num_worst_tokens, waits for them."""
    op = "dispatch"
    require_domains(context, op)
    device, num_ranks, num_domains = context.device, context.num_ranks, context.num_rdma_ranks
    num_nvl_ranks = num_ranks // num_domains
    data, scales = check_x(op, x, device)
    num_tokens, hidden = data.shape
    check_int(op, "expert_alignment", expert_alignment, 1)
    check_int(op, "num_worst_tokens", num_worst_tokens, 0)
    channels = num_channels(context, config)
    cached = handle is not None
    shrink = shrink_mode(context)
    num_experts = num_topk = 0
    if cached:
        parts = check_handle(context, op, handle, channels)
        if topk_idx is not None or topk_weights is not None:
            fail(op, "topk_idx", "None with a handle (cached dispatch)", "a tensor")
        if parts.num_tokens != num_tokens:
            fail(op, "x", f"of {parts.num_tokens} rows, the tokens of the handle's dispatch", f"{num_tokens} rows")
        entries = list(parts.entries)
        is_token_in_rank = entries[0]
    else:
        check_tensor(op, "is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, num_ranks),
                     device=device)
        check_tensor(op, "num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(num_ranks,),
                     device=device)
        check_tensor(op, "num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=torch.int32,
                     shape=(num_domains,), device=device)
        check_tensor(op, "num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, ndim=1, device=device)
        num_experts = num_tokens_per_expert.shape[0]
        if num_experts == 0 or num_experts % num_ranks:
            fail(op, "num_tokens_per_expert", f"of a length that is a positive multiple of the group size {num_ranks}",
                 f"shape {tuple(num_tokens_per_expert.shape)}")
        if (topk_idx is None) != (topk_weights is None):
            fail(op, "topk_weights" if topk_weights is None else "topk_idx", "given with the other top-k tensor",
                 None)
        if topk_idx is not None:
            check_tensor(op, "topk_idx", topk_idx, dtype=TOPK_IDX_DTYPE, ndim=2, device=device)
            num_topk = topk_idx.shape[1]
            if topk_idx.shape[0] != num_tokens:
                fail(op, "topk_idx", f"of {num_tokens} rows like x", f"shape {tuple(topk_idx.shape)}")
            check_tensor(op, "topk_weights", topk_weights, dtype=torch.float32, shape=(num_tokens, num_topk),
                         device=device)
    if scales is not None:
        num_scales = scales.shape[1]
        stride_token, stride_group = scales.stride()
    else:
        num_scales = stride_token = stride_group = 0

    native, stream = context.native, context.comm_raw
    with OpStreams(context, op, previous_event, async_finish, allocate_on_comm_stream) as streams:
        topk_idx_ptr = topk_idx.data_ptr() if num_topk else 0
        if cached:
            num_recv, num_forward = parts.num_recv, parts.num_forward
            native.internode_dispatch_counts(
                handle=_addresses(entries), num_tokens=num_tokens, num_channels=channels, num_tokens_per_expert=0,
                num_experts=0, topk_idx=0, num_topk=0, expert_alignment=1, num_worst_tokens=0, cached=True,
                config=config, stream=stream, wait_for=streams.wait_for)
            per_expert = None
        else:
            # [1]-[6] in one allocation: the counts step writes them all. In
            # shrink mode [3] and [4] get a row per (source domain, part), as
            # many as a rank can have; the host learns its parts P with the
            # receive sizes and keeps the first N x P rows. With
            # num_worst_tokens it learns nothing: it keeps every row, and the
            # counts step makes those past N x P parts with no tokens.
            rows = num_domains * (num_nvl_ranks if shrink else 1)
            sizes = (num_domains * channels, num_ranks * channels, rows * channels, rows, num_ranks * channels,
                     num_ranks)
            counts = torch.empty(sum(sizes), dtype=torch.int32, device=device)
            shapes = ((num_domains, channels), (num_ranks, channels), (rows, channels), (rows,),
                      (num_ranks, channels), (num_ranks,))
            entries = [is_token_in_rank]
            for part, shape in zip(counts.split(sizes), shapes):
                entries.append(part.view(shape))
            entries += [None, None, None]
            if shrink:
                # [10]: the live set, which the counts step writes from the mask buffer.
                entries.append(torch.empty((num_ranks + 31) // 32, dtype=torch.int32, device=device))
            # Without num_worst_tokens this waits on the host for the receive sizes.
            num_recv, num_forward, per_expert, num_parts = native.internode_dispatch_counts(
                handle=_addresses(entries), num_tokens=num_tokens, num_channels=channels,
                num_tokens_per_expert=num_tokens_per_expert.data_ptr(), num_experts=num_experts,
                topk_idx=topk_idx_ptr, num_topk=num_topk, expert_alignment=expert_alignment,
                num_worst_tokens=num_worst_tokens, cached=False, config=config, stream=stream,
                wait_for=streams.wait_for)
            if num_worst_tokens:
                num_recv, num_forward, per_expert = num_worst_tokens, num_nvl_ranks * num_worst_tokens, []
            if shrink and not num_worst_tokens:
                entries[3] = entries[3][:num_domains * num_parts]
                entries[4] = entries[4][:num_domains * num_parts]
            entries[7] = torch.empty(num_recv, 2, dtype=torch.int32, device=device)
            entries[8] = torch.empty(num_tokens, num_domains, dtype=torch.int32, device=device)
            entries[9] = torch.empty(num_forward, num_nvl_ranks, dtype=torch.int32, device=device)
        recv_x = torch.empty(num_recv, hidden, dtype=data.dtype, device=device)
        recv_scales = torch.empty(num_recv, num_scales, dtype=scales.dtype, device=device) \
            if scales is not None else None
        recv_topk_idx = torch.empty(num_recv, num_topk, dtype=TOPK_IDX_DTYPE, device=device) if num_topk else None
        recv_topk_weights = torch.empty(num_recv, num_topk, dtype=torch.float32, device=device) if num_topk else None
        native.internode_dispatch(
            handle=_addresses(entries), num_tokens=num_tokens, num_channels=channels, num_recv=num_recv,
            num_forward=num_forward, x=data.data_ptr(), row_bytes=hidden * data.element_size(),
            x_scales=scales.data_ptr() if scales is not None else 0, num_scales=num_scales,
            scale_stride_token=stride_token, scale_stride_group=stride_group, topk_idx=topk_idx_ptr,
            topk_weights=topk_weights.data_ptr() if num_topk else 0, num_topk=num_topk, num_experts=num_experts,
            num_worst_tokens=0 if cached else num_worst_tokens, cached=cached, config=config,
            recv_x=recv_x.data_ptr(), recv_x_scales=recv_scales.data_ptr() if recv_scales is not None else 0,
            recv_topk_idx=recv_topk_idx.data_ptr() if num_topk else 0,
            recv_topk_weights=recv_topk_weights.data_ptr() if num_topk else 0, stream=stream,
            join_to=streams.join_to)
    event = streams.finish((data, scales, topk_idx, topk_weights, *entries, recv_x, recv_scales, recv_topk_idx,
                            recv_topk_weights))
    out_x = (recv_x, recv_scales) if scales is not None else recv_x
    if cached:
        return out_x, None, None, None, None, event
    return out_x, recv_topk_idx, recv_topk_weights, per_expert, new_handle(context, entries), event


def combine(context: OpContext, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor], bias, config,
            previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool):
    """Buffer.combine (and internode_combine) across NVL domains, its config resolved."""
    op = "combine"
    require_domains(context, op)
    device = context.device
    parts = check_handle(context, op, handle, num_channels(context, config))
    num_rows, num_tokens = parts.num_recv, parts.num_tokens
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=2, device=device)
    if x.shape[0] != num_rows:
        fail(op, "x", f"of {num_rows} rows (the handle's receive count)", f"shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden % 8:
        fail(op, "x", "of a hidden size that is a multiple of 8", f"shape {tuple(x.shape)}")
    check_aligned(op, "x", x)
    num_topk = 0
    if topk_weights is not None:
        check_tensor(op, "topk_weights", topk_weights, dtype=torch.float32, ndim=2, device=device)
        num_topk = topk_weights.shape[1]
        if topk_weights.shape[0] != num_rows:
            fail(op, "topk_weights", f"of {num_rows} rows like x", f"shape {tuple(topk_weights.shape)}")
    biases = bias if isinstance(bias, tuple) else (bias,)
    if len(biases) > 2:
        fail(op, "bias", "None, a tensor or a tuple of two tensors", f"a tuple of {len(biases)}", TypeError)
    biases = [b for b in biases if b is not None]
    for i, b in enumerate(biases):
        name = f"bias[{i}]" if isinstance(bias, tuple) else "bias"
        check_tensor(op, name, b, dtype=torch.bfloat16, shape=(num_tokens, hidden), device=device)
        check_aligned(op, name, b)

    with OpStreams(context, op, previous_event, async_finish, allocate_on_comm_stream) as streams:
        combined_x = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)
        combined_topk_weights = torch.empty(num_tokens, num_topk, dtype=torch.float32, device=device) \
            if num_topk else None
        context.native.internode_combine(
            handle=_addresses(parts.entries), num_tokens=num_tokens, num_channels=parts.num_channels,
            num_recv=num_rows, num_forward=parts.num_forward, x=x.data_ptr(), hidden=hidden,
            topk_weights=topk_weights.data_ptr() if num_topk else 0, num_topk=num_topk,
            bias0=biases[0].data_ptr() if biases else 0, bias1=biases[1].data_ptr() if len(biases) > 1 else 0,
            config=config, combined_x=combined_x.data_ptr(),
            combined_topk_weights=combined_topk_weights.data_ptr() if num_topk else 0, stream=context.comm_raw,
            wait_for=streams.wait_for, join_to=streams.join_to)
    event = streams.finish((x, topk_weights, *biases, *parts.entries, combined_x, combined_topk_weights))
    return combined_x, combined_topk_weights, event
