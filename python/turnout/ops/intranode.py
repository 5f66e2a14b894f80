"""Intranode normal mode: dispatch (fresh, or cached from a handle) and combine
inside one NVL domain.

Each op checks its common case (plain contiguous tensors on this GPU, BF16
rows, a handle of this buffer) in one expression and runs the full checks,
which name what is wrong, only when that fails. A plain op (no
previous_event, async_finish or allocate_on_comm_stream) makes no OpStreams:
it runs on the caller's stream, after the buffer's last op
(streams.follow). The native calls take their arguments positionally (each
keyword costs time to match)."""
from typing import Optional

import torch

from ..checks import TOPK_IDX_DTYPE, check_aligned, check_int, check_tensor, check_x, fail, is_plain, is_plain_nd
from ..event import EventOverlap
from ..torch_ext import MODULE as _torch_ext
from . import outputs as op_outputs
from . import streams as op_streams
from .context import OpContext
from .handle import DispatchHandle, check_handle, new_handle

# Read once: module attribute lookups on the hot path cost.
_Tensor = torch.Tensor
_Handle = DispatchHandle
_BF16 = torch.bfloat16
_BOOL = torch.bool
_I32 = torch.int32
_F32 = torch.float32
_FP8 = torch.float8_e4m3fn
_empty = op_outputs.empty
_empty_packed = op_outputs.empty_packed
_dispatch_worst = None if _torch_ext is None else _torch_ext.dispatch_worst
_dispatch_waited = None if _torch_ext is None else _torch_ext.dispatch_waited
_combine_plain = None if _torch_ext is None else _torch_ext.combine_plain
_CODES = op_outputs.CODES
_BF16_CODE, _I32_CODE, _I64_CODE, _F32_CODE = op_outputs.BF16, op_outputs.I32, op_outputs.I64, op_outputs.F32


def _checked_dispatch(context: OpContext, op: str, x, handle, num_tokens_per_rank, is_token_in_rank,
                      num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens):
    """Every check of a dispatch's arguments, each naming what is wrong.
    Returns ``(data, scales, num_experts, num_topk, is_token_in_rank)`` and,
    for a cached dispatch, the handle's ``(rank_prefix_matrix, rows)``, else
    ``(None, 0)``."""
    device, num_ranks, index = context.device, context.num_ranks, context.device_index
    if is_plain_nd(x, _BF16, 2, index) and not x.shape[1] % 8 and not x.data_ptr() % 16:
        data, scales = x, None
    else:
        data, scales = check_x(op, x, device)
    num_tokens = data.shape[0]
    if not (type(expert_alignment) is int and expert_alignment >= 1):
        check_int(op, "expert_alignment", expert_alignment, 1)
    if not (type(num_worst_tokens) is int and num_worst_tokens >= 0):
        check_int(op, "num_worst_tokens", num_worst_tokens, 0)
    if handle is not None:
        rank_prefix_matrix, _, cached_src_idx, is_token_in_rank = check_handle(context, op, handle)
        if topk_idx is not None or topk_weights is not None:
            fail(op, "topk_idx", "None with a handle (cached dispatch)", "a tensor")
        if is_token_in_rank.shape[0] != num_tokens:
            fail(op, "x", f"of {is_token_in_rank.shape[0]} rows, the tokens of the handle's dispatch",
                 f"{num_tokens} rows")
        return data, scales, 0, 0, is_token_in_rank, rank_prefix_matrix, cached_src_idx.shape[0]
    if not is_plain(is_token_in_rank, _BOOL, (num_tokens, num_ranks), index):
        check_tensor(op, "is_token_in_rank", is_token_in_rank, dtype=_BOOL, shape=(num_tokens, num_ranks),
                     device=device)
    if not is_plain(num_tokens_per_rank, _I32, (num_ranks,), index):
        check_tensor(op, "num_tokens_per_rank", num_tokens_per_rank, dtype=_I32, shape=(num_ranks,), device=device)
    if not is_plain_nd(num_tokens_per_expert, _I32, 1, index):
        check_tensor(op, "num_tokens_per_expert", num_tokens_per_expert, dtype=_I32, ndim=1, device=device)
    num_experts = num_tokens_per_expert.shape[0]
    if num_experts == 0 or num_experts % num_ranks:
        fail(op, "num_tokens_per_expert", f"of a length that is a positive multiple of the group size {num_ranks}",
             f"shape {tuple(num_tokens_per_expert.shape)}")
    if (topk_idx is None) != (topk_weights is None):
        fail(op, "topk_weights" if topk_weights is None else "topk_idx", "given with the other top-k tensor", None)
    num_topk = 0
    if topk_idx is not None:
        if not is_plain_nd(topk_idx, TOPK_IDX_DTYPE, 2, index):
            check_tensor(op, "topk_idx", topk_idx, dtype=TOPK_IDX_DTYPE, ndim=2, device=device)
        num_topk = topk_idx.shape[1]
        if topk_idx.shape[0] != num_tokens:
            fail(op, "topk_idx", f"of {num_tokens} rows like x", f"shape {tuple(topk_idx.shape)}")
        if not is_plain(topk_weights, _F32, (num_tokens, num_topk), index):
            check_tensor(op, "topk_weights", topk_weights, dtype=_F32, shape=(num_tokens, num_topk), device=device)
    return data, scales, num_experts, num_topk, is_token_in_rank, None, 0


def _receive_outputs(device: torch.device, data, scales, num_recv: int, hidden: int, num_scales: int, num_topk: int,
                     num_ranks: int, prefix: bool) -> tuple:
    """A fresh dispatch's outputs in one call: ``(recv_x, recv_scales,
    recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx,
    rank_prefix_matrix)``, None where the call has no such output (and for
    rank_prefix_matrix where ``prefix`` is false). The rows and scales are
    each an allocation of their own, the rest share one."""
    spec = (_CODES[data.dtype], num_recv, hidden)
    if scales is not None:
        spec += (_CODES[scales.dtype], num_recv, num_scales)
    if num_topk:
        spec += (_I64_CODE, num_recv, num_topk, _F32_CODE, num_recv, num_topk)
    spec += (_I32_CODE, num_ranks, -1, _I32_CODE, num_recv, -1)
    if prefix:
        spec += (_I32_CODE, num_ranks, num_ranks)
    # The rows (and scales) alone, the small outputs in one allocation.
    out = _empty_packed(device, 1 if scales is None else 2, *spec)
    i = 1
    recv_scales = recv_topk_idx = recv_topk_weights = None
    if scales is not None:
        recv_scales, i = out[1], 2
    if num_topk:
        recv_topk_idx, recv_topk_weights, i = out[i], out[i + 1], i + 2
    return out[0], recv_scales, recv_topk_idx, recv_topk_weights, out[i], out[i + 1], out[i + 2] if prefix else None


def dispatch(context: OpContext, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
             topk_weights, expert_alignment: int, num_worst_tokens: int, config,
             previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool):
    """Buffer.dispatch with its config resolved. A cached dispatch (``handle``
    given) takes the receive layout from the handle; a fresh one exchanges
    the counts first and, without num_worst_tokens, waits for them. When the
    receive rows are known before (cached, or num_worst_tokens) both steps
    are one native call; the common fresh call that waits runs both from one
    call into turnout._torch_ext."""
    index, num_ranks = context.device_index, context.num_ranks
    if (_dispatch_worst is not None and handle is None and type(num_worst_tokens) is int and num_worst_tokens >= 0
            and previous_event is None and not async_finish and not allocate_on_comm_stream):
        # The common cases in one call (with num_worst_tokens, or waiting for
        # the counts), where the caller's stream is the buffer's last already
        # (no join to make first); each returns None for any call it does not
        # take, before doing anything.
        stream = op_streams.current_raw_stream(index)
        native = context.native
        if context.tail == stream and not native.destroyed:
            per_expert, own_rows = [], (-1, 0)
            if num_worst_tokens:
                out = _dispatch_worst(native, config, x, num_tokens_per_rank, is_token_in_rank,
                                      num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                      num_worst_tokens, num_ranks, index, stream)
            else:
                out = _dispatch_waited(native, config, x, num_tokens_per_rank, is_token_in_rank,
                                       num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_ranks,
                                       index, stream)
                if out is not None:
                    out, per_expert, own_begin, num_own = out
                    own_rows = (own_begin, num_own)
            if out is not None:
                recv_x, recv_scales, recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx, prefix = out
                return (recv_x if recv_scales is None else (recv_x, recv_scales), recv_topk_idx, recv_topk_weights,
                        per_expert, new_handle(context, prefix, source_num_tokens, recv_src_idx, is_token_in_rank,
                                               own_rows), EventOverlap())
    op = "dispatch"
    # The common cases: BF16 x or FP8 x with its scales, and a fresh dispatch
    # with top-k from this buffer's layout, or a cached one from this buffer's handle.
    checked = type(expert_alignment) is int and type(num_worst_tokens) is int and expert_alignment >= 1 \
        and num_worst_tokens >= 0
    if type(x) is _Tensor:
        data, scales = x, None
        checked = checked and x.dtype == _BF16 and x.dim() == 2 and x.get_device() == index and x.is_contiguous()
        if checked:
            num_tokens, hidden = x.shape
            checked = not hidden % 8 and not x.data_ptr() % 16
            row_bytes = hidden * 2
    elif type(x) is tuple and len(x) == 2:
        data, scales = x
        checked = (checked and type(data) is _Tensor and type(scales) is _Tensor and data.dtype == _FP8
                   and (scales.dtype == _F32 or scales.dtype == _I32) and data.dim() == 2 and scales.dim() == 2
                   and data.get_device() == index and scales.get_device() == index and data.is_contiguous())
        if checked:
            num_tokens, hidden = data.shape
            checked = scales.shape[0] == num_tokens and not hidden % 16 and not data.data_ptr() % 16
            row_bytes = hidden
    else:
        checked = False
    if checked and handle is None:
        checked = (type(is_token_in_rank) is _Tensor and type(num_tokens_per_rank) is _Tensor
                   and type(num_tokens_per_expert) is _Tensor and type(topk_idx) is _Tensor
                   and type(topk_weights) is _Tensor and is_token_in_rank.dtype == _BOOL
                   and num_tokens_per_rank.dtype == _I32 and num_tokens_per_expert.dtype == _I32
                   and topk_idx.dtype == TOPK_IDX_DTYPE and topk_weights.dtype == _F32
                   and num_tokens_per_expert.dim() == 1 and topk_idx.dim() == 2
                   and is_token_in_rank.get_device() == index and num_tokens_per_rank.get_device() == index
                   and num_tokens_per_expert.get_device() == index and topk_idx.get_device() == index
                   and topk_weights.get_device() == index and is_token_in_rank.is_contiguous()
                   and num_tokens_per_rank.is_contiguous() and num_tokens_per_expert.is_contiguous()
                   and topk_idx.is_contiguous() and topk_weights.is_contiguous()
                   and is_token_in_rank.shape == (num_tokens, num_ranks) and num_tokens_per_rank.shape == (num_ranks,)
                   and topk_idx.shape[0] == num_tokens and topk_weights.shape == topk_idx.shape)
        if checked:
            num_experts, num_topk = num_tokens_per_expert.shape[0], topk_idx.shape[1]
            checked = num_experts and not num_experts % num_ranks
            rank_prefix_matrix, num_recv = None, 0
    elif checked:
        checked = (type(handle) is _Handle and getattr(handle, "_owner", None) is context.handle_owner
                   and topk_idx is None and topk_weights is None)
        if checked:
            rank_prefix_matrix, _, _, cached_src_idx, is_token_in_rank, _ = handle
            checked = is_token_in_rank.shape[0] == num_tokens
            num_experts, num_topk, num_recv = 0, 0, cached_src_idx.shape[0]
    if not checked:
        data, scales, num_experts, num_topk, is_token_in_rank, rank_prefix_matrix, num_recv = _checked_dispatch(
            context, op, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
            topk_weights, expert_alignment, num_worst_tokens)
        num_tokens, hidden = data.shape
        row_bytes = hidden * data.element_size()
    if scales is not None:
        num_scales = scales.shape[1]
        stride_token, stride_group = scales.stride()
        scales_ptr = scales.data_ptr()
    else:
        num_scales = stride_token = stride_group = scales_ptr = 0

    native = context.native
    streams, wait_for, join_to, stream = op_streams.normal_op_streams(context, op, previous_event, async_finish,
                                                                      allocate_on_comm_stream)
    own_begin, num_own = -1, 0
    try:
        x_ptr, in_rank_ptr = data.data_ptr(), is_token_in_rank.data_ptr()
        recv_topk_idx = recv_topk_weights = source_num_tokens = recv_src_idx = recv_scales = None
        topk_idx_ptr = topk_weights_ptr = recv_topk_idx_ptr = recv_topk_weights_ptr = recv_scales_ptr = 0
        if rank_prefix_matrix is not None:
            # Cached: the handle's receive layout; its source info is not written again.
            per_expert = None
            if scales is None:
                (recv_x,) = _empty(context.device, _CODES[data.dtype], num_recv, hidden)
            else:
                recv_x, recv_scales = _empty(context.device, _CODES[data.dtype], num_recv, hidden,
                                             _CODES[scales.dtype], num_recv, num_scales)
                recv_scales_ptr = recv_scales.data_ptr()
            native.dispatch_known_rows(
                x_ptr, num_tokens, row_bytes, scales_ptr, num_scales, stride_token, stride_group, 0, 0, 0, 0, 0, 1,
                in_rank_ptr, rank_prefix_matrix.data_ptr(), num_recv, 0, config, recv_x.data_ptr(), recv_scales_ptr,
                0, 0, 0, 0, stream, wait_for, join_to)
        else:
            per_expert_ptr = num_tokens_per_expert.data_ptr()
            if num_topk:
                topk_idx_ptr, topk_weights_ptr = topk_idx.data_ptr(), topk_weights.data_ptr()
            device = context.device
            if num_worst_tokens:
                # Every output in one call: the receive rows are known.
                num_recv, per_expert = num_worst_tokens, []
                recv_x, recv_scales, recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx, \
                    rank_prefix_matrix = _receive_outputs(device, data, scales, num_recv, hidden, num_scales,
                                                          num_topk, num_ranks, True)
                prefix_ptr = rank_prefix_matrix.data_ptr()
            else:
                (rank_prefix_matrix,) = _empty(device, _I32_CODE, num_ranks, num_ranks)
                prefix_ptr = rank_prefix_matrix.data_ptr()
                # Waits on the host for the receive sizes.
                num_recv, per_expert, own_begin, num_own = native.dispatch_counts(
                    in_rank_ptr, num_tokens, per_expert_ptr, num_experts, topk_idx_ptr, num_topk, expert_alignment,
                    0, config, prefix_ptr, stream, wait_for)
                recv_x, recv_scales, recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx, _ = \
                    _receive_outputs(device, data, scales, num_recv, hidden, num_scales, num_topk, num_ranks, False)
            if scales is not None:
                recv_scales_ptr = recv_scales.data_ptr()
            if num_topk:
                recv_topk_idx_ptr, recv_topk_weights_ptr = recv_topk_idx.data_ptr(), recv_topk_weights.data_ptr()
            if num_worst_tokens:
                native.dispatch_known_rows(
                    x_ptr, num_tokens, row_bytes, scales_ptr, num_scales, stride_token, stride_group, topk_idx_ptr,
                    topk_weights_ptr, num_topk, num_experts, per_expert_ptr, expert_alignment, in_rank_ptr,
                    prefix_ptr, num_recv, num_worst_tokens, config, recv_x.data_ptr(), recv_scales_ptr,
                    recv_topk_idx_ptr, recv_topk_weights_ptr, recv_src_idx.data_ptr(), source_num_tokens.data_ptr(),
                    stream, wait_for, join_to)
            else:
                native.dispatch(
                    x_ptr, num_tokens, row_bytes, scales_ptr, num_scales, stride_token, stride_group, topk_idx_ptr,
                    topk_weights_ptr, num_topk, num_experts, in_rank_ptr, prefix_ptr, num_recv, 0, config,
                    recv_x.data_ptr(), recv_scales_ptr, recv_topk_idx_ptr, recv_topk_weights_ptr,
                    recv_src_idx.data_ptr(), source_num_tokens.data_ptr(), stream, join_to)
    except BaseException:
        op_streams.unwind(context, streams)
        raise
    if streams is None:
        event = EventOverlap()
    else:
        event = streams.finish((data, scales, topk_idx, topk_weights, is_token_in_rank, rank_prefix_matrix, recv_x,
                                recv_scales, recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx))
    out_x = recv_x if scales is None else (recv_x, recv_scales)
    if per_expert is None:
        return out_x, None, None, None, None, event
    return (out_x, recv_topk_idx, recv_topk_weights, per_expert,
            new_handle(context, rank_prefix_matrix, source_num_tokens, recv_src_idx, is_token_in_rank,
                       (own_begin, num_own)), event)


def _checked_biases(context: OpContext, op: str, bias, num_tokens: int, hidden: int) -> list:
    """combine's bias (a tensor or a tuple of two, each may be None) as the list of its tensors, checked."""
    biases = bias if isinstance(bias, tuple) else (bias,)
    if len(biases) > 2:
        fail(op, "bias", "None, a tensor or a tuple of two tensors", f"a tuple of {len(biases)}", TypeError)
    for i, b in enumerate(biases):
        if b is not None and not (is_plain(b, _BF16, (num_tokens, hidden), context.device_index)
                                  and not b.data_ptr() % 16):
            name = f"bias[{i}]" if isinstance(bias, tuple) else "bias"
            check_tensor(op, name, b, dtype=_BF16, shape=(num_tokens, hidden), device=context.device)
            check_aligned(op, name, b)
    return [b for b in biases if b is not None]


def combine(context: OpContext, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor], bias, config,
            previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool):
    """Buffer.combine with its config resolved."""
    index = context.device_index
    # This buffer's own handle needs no check.
    own = type(handle) is _Handle and getattr(handle, "_owner", None) is context.handle_owner
    own_begin, num_own = handle._own_rows if own else (-1, 0)
    if own:
        rank_prefix_matrix, source_num_tokens, _, recv_src_idx, is_token_in_rank, _ = handle
        if (_combine_plain is not None and bias is None and previous_event is None and not async_finish
                and not allocate_on_comm_stream):
            # The common case in one native call, as dispatch's above.
            stream = op_streams.current_raw_stream(index)
            native = context.native
            if context.tail == stream and not native.destroyed:
                out = _combine_plain(native, config, x, topk_weights, rank_prefix_matrix, source_num_tokens,
                                     recv_src_idx, is_token_in_rank, index, stream, own_begin, num_own)
                if out is not None:
                    return out[0], out[1], EventOverlap()
    op = "combine"
    device = context.device
    if not own:
        rank_prefix_matrix, source_num_tokens, recv_src_idx, is_token_in_rank = check_handle(context, op, handle)
    num_rows = recv_src_idx.shape[0]
    num_tokens = is_token_in_rank.shape[0]
    if not (type(x) is _Tensor and x.dtype == _BF16 and x.dim() == 2 and x.get_device() == index
            and x.is_contiguous()):
        check_tensor(op, "x", x, dtype=_BF16, ndim=2, device=device)
    if x.shape[0] != num_rows:
        fail(op, "x", f"of {num_rows} rows (the handle's receive count)", f"shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden % 8:
        fail(op, "x", "of a hidden size that is a multiple of 8", f"shape {tuple(x.shape)}")
    x_ptr = x.data_ptr()
    if x_ptr % 16:
        check_aligned(op, "x", x)
    num_topk = weights_ptr = 0
    if topk_weights is not None:
        if not (type(topk_weights) is _Tensor and topk_weights.dtype == _F32 and topk_weights.dim() == 2
                and topk_weights.get_device() == index and topk_weights.is_contiguous()):
            check_tensor(op, "topk_weights", topk_weights, dtype=_F32, ndim=2, device=device)
        num_topk = topk_weights.shape[1]
        if topk_weights.shape[0] != num_rows:
            fail(op, "topk_weights", f"of {num_rows} rows like x", f"shape {tuple(topk_weights.shape)}")
        weights_ptr = topk_weights.data_ptr()
    biases = [] if bias is None else _checked_biases(context, op, bias, num_tokens, hidden)

    native = context.native
    streams, wait_for, join_to, stream = op_streams.normal_op_streams(context, op, previous_event, async_finish,
                                                                      allocate_on_comm_stream)
    try:
        if num_topk:
            combined_x, combined_topk_weights = _empty(context.device, _BF16_CODE, num_tokens, hidden, _F32_CODE,
                                                       num_tokens, num_topk)
        else:
            (combined_x,), combined_topk_weights = _empty(context.device, _BF16_CODE, num_tokens, hidden), None
        native.combine(
            x_ptr, num_rows, hidden, weights_ptr, num_topk, biases[0].data_ptr() if biases else 0,
            biases[1].data_ptr() if len(biases) > 1 else 0, rank_prefix_matrix.data_ptr(),
            source_num_tokens.data_ptr(), recv_src_idx.data_ptr(), is_token_in_rank.data_ptr(), num_tokens, config,
            combined_x.data_ptr(), combined_topk_weights.data_ptr() if num_topk else 0, own_begin, num_own, stream,
            wait_for, join_to)
    except BaseException:
        op_streams.unwind(context, streams)
        raise
    if streams is None:
        return combined_x, combined_topk_weights, EventOverlap()
    event = streams.finish((x, topk_weights, *biases, rank_prefix_matrix, source_num_tokens, recv_src_idx,
                            is_token_in_rank, combined_x, combined_topk_weights))
    return combined_x, combined_topk_weights, event
