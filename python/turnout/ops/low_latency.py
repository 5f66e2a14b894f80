"""Low-latency mode (decoding): dispatch and combine of a few tokens per rank,
no host sync and, once a call shape has been seen, no allocation, so the
calls can be captured in CUDA graphs and cost little host time.

Dispatch outputs come from two output sets per shape (M, hidden, E, format),
used in turn: the results of the two latest dispatches of a shape stay valid.
A handle names its set and the call that filled it, so a combine given a
handle whose set a later dispatch reused is refused instead of reading
another call's rows.

Without async_finish an op runs on the caller's stream (no stream joins: the
caller's stream is the one that must wait for it anyway). With async_finish
it runs on the communication stream; the next op launched on the caller's
stream first waits for that stream, so low-latency calls never overlap each
other (their device counters step once per call). Such an op's event is one
of the buffer's ring of native events (turnout._C.CommEvent), recorded by
the launch itself, and its tensors wait in the buffer's queue of pending calls
until that event has completed (no record_stream, no new event per call);
every RELEASE_EVERY-th async call lets go of those that have.
"""
from collections import deque
from typing import Optional

import torch

from .. import _C
from ..checks import TOPK_IDX_DTYPE, check_int, check_tensor, fail, is_plain
from ..event import EventOverlap
from ..torch_ext import MODULE as _torch_ext
from . import outputs as op_outputs
from .context import OpContext
from .streams import OpStreams, current_raw_stream, follow

MAX_TOPK: int = _C.low_latency_max_topk
MAX_TOKENS: int = _C.low_latency_max_tokens
MAX_EXPERTS: int = _C.low_latency_max_experts
MAX_HIDDEN: int = _C.low_latency_max_hidden
SCALE_GROUP: int = _C.low_latency_scale_group

_SEND_AND_RECEIVE: int = _C.LOW_LATENCY_SEND_AND_RECEIVE
_SEND: int = _C.LOW_LATENCY_SEND
_RECEIVE: int = _C.LOW_LATENCY_RECEIVE

# Read once: module attribute lookups on the hot path cost.
_Tensor = torch.Tensor
_BF16_DTYPE = torch.bfloat16
_F32_DTYPE = torch.float32
_empty = op_outputs.empty
_BF16_CODE = op_outputs.BF16
# The ops in one call (turnout._torch_ext), where it is in use.
_dispatch_in_one_call = None if _torch_ext is None else _torch_ext.low_latency_dispatch
_combine_in_one_call = None if _torch_ext is None else _torch_ext.low_latency_combine

# The event of every call that is neither async_finish nor hooked: one shared
# object holding nothing (making one is a measurable part of such a call's
# few microseconds of host time).
_NO_EVENT = EventOverlap()

# Formats of dispatch's recv_x: bf16, e4m3 with float scales, e4m3 with packed UE8M0 scales.
_BF16, _FP8, _UE8M0 = 0, 1, 2

# Events of a buffer's ring: an event comes round again after this many
# async_finish calls; a wait on it made later waits for the later call too.
EVENT_RING_SIZE = 16

# An async call asks whether the oldest pending calls completed only when the
# queue holds a multiple of this many: each query is a CUDA call, and a
# completed call's tensors wait at most this many async calls longer.
RELEASE_EVERY = 4


class _OutputSet:
    """One dispatch's outputs, the native args that point at them, and the
    generation (call number of its shape) whose results they hold."""

    __slots__ = ("args", "result", "recv_count", "src_info", "layout_range", "plan", "plan_ptr", "generation",
                 "combine_buffer", "owner", "num_local_experts", "num_rows", "expert_rows_shape", "dispatch_sizes",
                 "combine_sizes", "handle_entries")

    def __init__(self, owner: object, num_max_tokens: int, hidden: int, num_experts: int, fmt: int, num_ranks: int,
                 device: torch.device) -> None:
        local, rows = num_experts // num_ranks, num_max_tokens * num_ranks
        groups = hidden // SCALE_GROUP
        recv_x = torch.empty(local, rows, hidden, dtype=torch.bfloat16 if fmt == _BF16 else torch.float8_e4m3fn,
                             device=device)
        # Scales column-major in their last two dims, as grouped GEMMs read them with TMA.
        scales = None
        if fmt == _FP8:
            scales = torch.empty(local, groups, rows, dtype=torch.float32, device=device).transpose(1, 2)
        elif fmt == _UE8M0:
            scales = torch.empty(local, (groups + 3) // 4, rows, dtype=torch.int32, device=device).transpose(1, 2)
        # Zeroed once: a dispatch that fails leaves recv_count unwritten.
        self.recv_count = torch.zeros(local, dtype=torch.int32, device=device)
        self.src_info = torch.empty(local, rows, dtype=torch.int32, device=device)
        self.layout_range = torch.empty(local, num_ranks, dtype=torch.int64, device=device)
        self.plan = torch.empty(_C.low_latency_plan_bytes(num_max_tokens, num_ranks, num_experts), dtype=torch.uint8,
                                device=device)
        self.result = recv_x if scales is None else (recv_x, scales)
        self.args = _C.LowLatencyDispatchArgs(
            hidden, num_max_tokens, num_experts, fmt != _BF16, fmt == _UE8M0, recv_x.data_ptr(),
            scales.data_ptr() if fmt == _FP8 else 0, scales.data_ptr() if fmt == _UE8M0 else 0,
            self.recv_count.data_ptr(), self.src_info.data_ptr(), self.layout_range.data_ptr(), self.plan.data_ptr())
        self.generation = -1
        # get_next_low_latency_combine_buffer's tensor, made on first request.
        self.combine_buffer = None
        self.owner = owner
        self.num_local_experts = local
        self.num_rows = rows
        # What combine checks and passes on every call, made once.
        self.expert_rows_shape = (local, rows, hidden)
        self.plan_ptr = self.plan.data_ptr()
        # The same for the ops in one call (low_latency_ops.cpp's DispatchSizes, CombineSizes).
        self.dispatch_sizes = (hidden, num_max_tokens, local, num_ranks, self.plan_ptr)
        self.combine_sizes = (local, rows, hidden, num_max_tokens, num_experts, self.plan_ptr)
        # DeepEP's five handle entries of every dispatch into this set.
        self.handle_entries = (self.src_info, self.layout_range, num_max_tokens, hidden, num_experts)


class _Shape:
    """The two output sets of one call shape and how many dispatches it had."""

    __slots__ = ("sets", "calls")

    def __init__(self) -> None:
        self.sets = [None, None]
        self.calls = 0


class LowLatencyState:
    """A low-latency Buffer's Python-side state: its output sets by shape,
    the last shape a dispatch used by everything but its hidden size (where
    the dispatch in one call looks first), the ring of events async_finish
    ops record (turnout._C.EventRing) and, oldest first, the ``(event,
    tensors)`` of those that may still run. Which stream the buffer's last op
    ran on is the context's (``tail``), shared with normal mode: both modes
    meet at the barrier and the rank mask."""

    __slots__ = ("shapes", "recent", "ring", "pending")

    def __init__(self, ring) -> None:
        self.shapes = {}
        self.recent = {}
        self.ring = ring
        self.pending = deque()

    def release_finished(self) -> None:
        """Lets go of the tensors of the async_finish calls whose event has
        completed, oldest first, up to the first that has not."""
        pending = self.pending
        while pending and pending[0][0].query():
            pending.popleft()

    def release(self) -> None:
        """Drops the output sets and pending calls once the Buffer is destroyed
        (its destroy has waited for the GPU; tensors the caller still holds
        stay valid); later calls raise."""
        self.shapes = None
        self.recent = {}
        self.pending.clear()

    def __del__(self) -> None:
        # Collected with a Buffer that was not destroyed: its context lets go of
        # this state before the native buffer (slots go in name order), so the
        # GPU must be done with the pending calls' tensors first. The newest
        # event follows every older call on the communication stream.
        if self.pending:
            self.pending[-1][0].synchronize()


class LowLatencyHandle(tuple):
    """What low_latency_dispatch returns for its combine: DeepEP's five entries
    ``(src_info [L, M*R] int32, layout_range [L, R] int64, M, hidden, num_experts)``
    (``src_info``: the source token of each received row; ``layout_range``:
    ``(begin << 32) | count`` of each source rank's rows per local expert).

    It also carries what the combine needs and DeepEP keeps inside: the plan
    (``plan``, uint8), this rank's token count and top-k (``num_tokens``,
    ``num_topk``), whether this rank gave dispatch weights (``has_weights``;
    combine sums with those only if every rank with tokens did), and which
    buffer and call made it (``generation``). It is valid while its output set
    holds its call's results: until the second later dispatch of its shape.
    """

    # One attribute, set once per dispatch: (output set, generation, T, K,
    # has_weights, (T, K): the shape combine's topk_idx and weights must have).
    _info: tuple

    @property
    def plan(self) -> torch.Tensor:
        return self._info[0].plan

    @property
    def generation(self) -> int:
        return self._info[1]

    @property
    def num_tokens(self) -> int:
        return self._info[2]

    @property
    def num_topk(self) -> int:
        return self._info[3]

    @property
    def has_weights(self) -> bool:
        return self._info[4]

    @property
    def owner(self) -> object:
        """The marker of the buffer whose dispatch made it."""
        return self._info[0].owner


class _ReceiveHook:
    """The receive half of a return_recv_hook call: launched on the stream
    current when it is called. Holds the call's tensors until then (and after:
    the receive may still run). Launching a receive twice would put this rank
    a call ahead of its peers, so a second call raises."""

    __slots__ = ("_context", "_launch", "_args", "_device_index", "_op", "_tensors", "_called")

    def __init__(self, context: OpContext, op: str, launch, args: tuple, tensors: tuple) -> None:
        self._context = context
        self._launch = launch
        self._args = args
        self._device_index = context.device_index
        self._op = op
        self._tensors = tensors
        self._called = False

    def __call__(self) -> None:
        if self._called:
            raise RuntimeError(f"{self._op}: this receive hook was already called; each hook launches its receive once")
        self._called = True
        # As the Buffer's ops: nothing of a TorchFunctionMode or subclass runs here.
        with torch._C.DisableTorchFunction():
            self._launch(*self._args, _RECEIVE, _caller_after_tail(self._context), None, None)


def _state(context: OpContext, op: str) -> LowLatencyState:
    state = context.low_latency
    if state is None:
        fail(op, "the Buffer", "created with low_latency_mode=True (and num_rdma_bytes from "
             "get_low_latency_rdma_size_hint)", "a buffer created with low_latency_mode=False")
    if state.shapes is None:
        raise RuntimeError(f"{op}: the buffer was destroyed")
    return state


def _caller_after_tail(context: OpContext) -> int:
    """The caller's stream, which an op about to launch there first makes
    wait for the buffer's last op if that was issued on another stream (an
    async_finish op on the communication stream, say)."""
    caller = current_raw_stream(context.device_index)
    if context.tail != caller:
        follow(context, caller)
    return caller


def _check_hidden(op: str, hidden: int, x: torch.Tensor, use_fp8: bool) -> None:
    step = SCALE_GROUP if use_fp8 else 8
    if hidden % step or not 0 < hidden <= MAX_HIDDEN:
        fail(op, "x", f"of a hidden size that is a multiple of {step} in [{step}, {MAX_HIDDEN}]"
             f"{' with use_fp8=True' if use_fp8 else ''}", f"shape {tuple(x.shape)}")


def _check_experts(op: str, num_experts: int, num_ranks: int) -> None:
    check_int(op, "num_experts", num_experts, num_ranks, MAX_EXPERTS)
    if num_experts % num_ranks:
        fail(op, "num_experts", f"a multiple of the group size {num_ranks}", num_experts)


def _aligned_ptr(op: str, arg: str, t: torch.Tensor) -> int:
    """The tensor's address: rows move as 16-byte words."""
    address = t.data_ptr()
    if address % 16:
        fail(op, arg, "starting at a 16-byte aligned address", f"address {address:#x}")
    return address


def _stats_ptr(context: OpContext, op: str, arg: str, t, dtype: torch.dtype, length: int) -> int:
    if not is_plain(t, dtype, (length,), context.device_index):
        check_tensor(op, arg, t, dtype=dtype, shape=(length,), device=context.device)
    return t.data_ptr()


def _check_dispatch_shape(op: str, context: OpContext, x, topk_idx, max_tokens, num_experts: int,
                          use_fp8: bool) -> None:
    """Every check of dispatch's x, topk_idx, num_max_dispatch_tokens_per_rank
    and num_experts, each naming what is wrong."""
    device, num_ranks = context.device, context.num_ranks
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=2, device=device)
    num_tokens, hidden = x.shape
    check_int(op, "num_max_dispatch_tokens_per_rank", max_tokens, 1, MAX_TOKENS)
    if num_tokens > max_tokens:
        fail(op, "x", f"of at most num_max_dispatch_tokens_per_rank={max_tokens} rows", f"shape {tuple(x.shape)}")
    _check_hidden(op, hidden, x, use_fp8)
    _aligned_ptr(op, "x", x)
    check_tensor(op, "topk_idx", topk_idx, dtype=TOPK_IDX_DTYPE, ndim=2, device=device)
    num_topk = topk_idx.shape[1]
    if topk_idx.shape[0] != num_tokens or not 0 < num_topk <= MAX_TOPK:
        fail(op, "topk_idx", f"of shape ({num_tokens}, k) with k in [1, {MAX_TOPK}] (x has {num_tokens} rows)",
             f"shape {tuple(topk_idx.shape)}")
    _check_experts(op, num_experts, num_ranks)


def dispatch(context: OpContext, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor],
             dispatch_wait_recv_cost_stats: Optional[torch.Tensor], use_fp8: bool, round_scale: bool,
             use_ue8m0: bool, async_finish: bool, return_recv_hook: bool, topk_weights: Optional[torch.Tensor]):
    """Buffer.low_latency_dispatch. Returns ``(recv_x, recv_count, handle, event, hook)``."""
    op = "low_latency_dispatch"
    state = context.low_latency
    if state is None or state.shapes is None:
        _state(context, op)
    index = context.device_index
    max_tokens = num_max_dispatch_tokens_per_rank
    fmt = (_UE8M0 if use_ue8m0 else _FP8) if use_fp8 else _BF16
    # The common case in one call, where it is in use: the shape of this
    # buffer's last dispatch of these sizes, the fast-path checks below made
    # there, and declined (None) where they fail.
    if (_dispatch_in_one_call is not None and type(max_tokens) is int and type(num_experts) is int
            and not (async_finish and return_recv_hook) and not (use_ue8m0 and not round_scale)):
        shape = state.recent.get((max_tokens, num_experts, fmt))
        if shape is not None:
            made = _dispatch_in_one_call_of(context, state, op, shape, x, topk_idx, topk_weights, round_scale,
                                            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                            async_finish, return_recv_hook)
            if made is not None:
                return made
    # The common case in one expression: plain contiguous tensors on this GPU
    # and a call shape this buffer has run (its sizes passed every check when
    # its outputs were made). Anything else takes the full checks, which name
    # what is wrong.
    shape = None
    if (type(x) is _Tensor and type(topk_idx) is _Tensor and type(max_tokens) is int and type(num_experts) is int
            and x.dtype == _BF16_DTYPE and topk_idx.dtype == TOPK_IDX_DTYPE and x.dim() == 2 and topk_idx.dim() == 2
            and x.get_device() == index and topk_idx.get_device() == index and x.is_contiguous()
            and topk_idx.is_contiguous()):
        num_tokens, hidden = x.shape
        idx_rows, num_topk = topk_idx.shape
        if num_tokens <= max_tokens and idx_rows == num_tokens and 0 < num_topk <= MAX_TOPK:
            shape = state.shapes.get((max_tokens, hidden, num_experts, fmt))
    if shape is None:
        _check_dispatch_shape(op, context, x, topk_idx, max_tokens, num_experts, use_fp8)
        num_tokens, hidden = x.shape
        num_topk = topk_idx.shape[1]
        key = (max_tokens, hidden, num_experts, fmt)
        shape = state.shapes.get(key)
        if shape is None:
            shape = state.shapes[key] = _Shape()
    state.recent[(max_tokens, num_experts, fmt)] = shape
    x_ptr = x.data_ptr()
    if x_ptr % 16:
        _aligned_ptr(op, "x", x)
    if use_ue8m0 and not round_scale:
        fail(op, "use_ue8m0", "used with round_scale=True (UE8M0 scales are powers of two)",
             "use_ue8m0=True with round_scale=False")
    if async_finish and return_recv_hook:
        fail(op, "return_recv_hook", "False with async_finish=True (a hook's receive runs on the stream current "
             "when it is called)", True)
    if topk_weights is not None and not is_plain(topk_weights, torch.float32, (num_tokens, num_topk), index):
        check_tensor(op, "topk_weights", topk_weights, dtype=torch.float32, shape=(num_tokens, num_topk),
                     device=context.device)
    num_ranks = context.num_ranks
    stats_ptr = 0 if cumulative_local_expert_recv_stats is None else _stats_ptr(
        context, op, "cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32,
        num_experts // num_ranks)
    wait_ptr = 0 if dispatch_wait_recv_cost_stats is None else _stats_ptr(
        context, op, "dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, torch.int64, num_ranks)

    generation = shape.calls
    outputs = shape.sets[generation & 1]
    if outputs is None:
        outputs = shape.sets[generation & 1] = _OutputSet(context.handle_owner, max_tokens, hidden, num_experts, fmt,
                                                          num_ranks, context.device)
    # Before the launch: a call that fails after it has written the set must
    # not leave the set's older handle valid.
    shape.calls = generation + 1
    outputs.generation = generation
    # Whether weights were given reaches every peer's plan through this
    # address, so it must not be null when they were: with no tokens the
    # weights are never read, but an empty tensor has no address of its own.
    weights_ptr = 0 if topk_weights is None else topk_weights.data_ptr() or outputs.plan_ptr
    # round_scale only matters with FP8: the binding drops it otherwise.
    args = (outputs.args, x_ptr, num_tokens, topk_idx.data_ptr(), num_topk, weights_ptr, bool(round_scale), stats_ptr,
            wait_ptr)
    launch = context.native.low_latency_dispatch
    if async_finish or return_recv_hook:
        tensors = (x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
        if async_finish:
            event, hook = _launch_async(context, state, launch, args, tensors), None
        else:
            event, hook = _NO_EVENT, _launch_send(context, state, op, launch, args, tensors)
    else:
        # The common case, neither async_finish nor a hook: both phases on the caller's stream.
        caller = current_raw_stream(index)
        if context.tail != caller:
            follow(context, caller)
        launch(*args, _SEND_AND_RECEIVE, caller, None, None)
        event, hook = _NO_EVENT, None
    handle = LowLatencyHandle(outputs.handle_entries)
    handle._info = (outputs, generation, num_tokens, num_topk, topk_weights is not None, (num_tokens, num_topk))
    return outputs.result, outputs.recv_count, handle, event, hook


def _launch_send(context: OpContext, state: LowLatencyState, op: str, launch, args: tuple, tensors: tuple):
    """The send of a return_recv_hook op; returns the hook for its receive."""
    launch(*args, _SEND, _caller_after_tail(context), None, None)
    return _ReceiveHook(context, op, launch, args, tensors)


def _async_streams(context: OpContext) -> tuple:
    """The streams of an async_finish op, which runs on the communication
    stream after the caller's: ``(caller, comm, tail)``, ``tail`` the buffer's
    last stream before. The communication stream is the tail from now on,
    after the last op's stream if that is neither (the launch itself makes it
    wait for the caller's)."""
    caller = current_raw_stream(context.device_index)
    comm = context.comm_raw
    tail = context.tail
    if tail is not None and tail != comm and tail != caller:
        context.native.follow(comm, tail)
    context.tail = comm
    return caller, comm, tail


def _after_failed_launch(context: OpContext, caller: int) -> None:
    """A launch that raises may have queued work first: the caller's stream
    must not run ahead of it (nor free what it reads), and so follows every op
    before: it is the tail."""
    context.native.join(waiter=caller, waited=context.comm_raw)
    context.tail = caller


def _pending(context: OpContext, state: LowLatencyState, event, tensors: tuple, tail) -> EventOverlap:
    """The EventOverlap of an async_finish op queued with the ring's ``event``."""
    # Inside a capture the graph's replays, not this queue, decide how long
    # the tensors are needed, and its events cannot be queried (the ring saw
    # whether its stream was capturing). Nor is a captured op a step of the
    # eager order: the tail stays the eager one.
    if not state.ring.captured:
        pending = state.pending
        if not len(pending) % RELEASE_EVERY:
            state.release_finished()
        pending.append((event, tensors))
    else:
        context.tail = tail
    return EventOverlap(event, tensors)


def _launch_on_comm(context: OpContext, state: LowLatencyState, launch, args: tuple) -> tuple:
    """``launch(*args, phase, comm, caller, ring)`` as an async_finish op: on
    the communication stream, after the caller's stream, the launch recording
    the ring's next event after it. Returns ``(what it returned, the tail
    before)``."""
    caller, comm, tail = _async_streams(context)
    try:
        return launch(*args, _SEND_AND_RECEIVE, comm, caller, state.ring), tail
    except BaseException:
        _after_failed_launch(context, caller)
        raise


def _launch_async(context: OpContext, state: LowLatencyState, launch, args: tuple, tensors: tuple) -> EventOverlap:
    """An async_finish op of the Python path."""
    event, tail = _launch_on_comm(context, state, launch, args)
    return _pending(context, state, event, tensors, tail)


def _combine_async_in_one_call(context: OpContext, state: LowLatencyState, args: tuple):
    """An async_finish combine in one call: ``(combined_x, event, None)``, or
    None where the call declined (nothing queued, the tail as it was)."""
    made, tail = _launch_on_comm(context, state, _combine_in_one_call, args)
    if made is None:
        context.tail = tail
        return None
    combined_x, event = made
    x, topk_idx, topk_weights = args[1:4]
    return combined_x, _pending(context, state, event, (x, topk_idx, topk_weights, combined_x, args[11]), tail), None


def _combine_send_in_one_call(context: OpContext, op: str, args: tuple):
    """The send of a return_recv_hook combine in one call: ``(combined_x,
    event, hook)``, the hook's receive one call too; or None where the call
    declined (nothing queued)."""
    made = _combine_in_one_call(*args, _SEND, _caller_after_tail(context), None, None)
    if made is None:
        return None
    combined_x = made[0]
    # The receive gets the send's output as its out=, so it makes none.
    receive_args = args[:10] + (combined_x,) + args[11:]
    tensors = (*args[1:4], combined_x, args[11])
    return combined_x, _NO_EVENT, _ReceiveHook(context, op, _combine_receive_in_one_call, receive_args, tensors)


def _combine_receive_in_one_call(*args) -> None:
    if _combine_in_one_call(*args) is None:
        _declined_receive("low_latency_combine")


def _declined_receive(op: str) -> None:
    # A receive takes what its send took, unless a tensor changed in between
    # (resized, say): that receive must not be dropped, its peers would wait
    # for it.
    raise RuntimeError(f"{op}: the hook's receive was declined: one of the call's tensors changed shape, type or "
                       "place after its send")


def _dispatch_in_one_call_of(context: OpContext, state: LowLatencyState, op: str, shape: _Shape, x, topk_idx,
                             topk_weights, round_scale, cumulative_stats, wait_stats, async_finish: bool,
                             return_recv_hook: bool):
    """A dispatch into ``shape``'s next output set in one call: what
    low_latency_dispatch returns, or None where the call declined (nothing
    queued, the set and the tail as they were)."""
    generation = shape.calls
    outputs = shape.sets[generation & 1]
    if outputs is None:
        return None
    args = (context.native, outputs.args, x, topk_idx, topk_weights, outputs.dispatch_sizes, round_scale,
            cumulative_stats, wait_stats, context.device_index)
    if async_finish:
        caller, comm, tail = _async_streams(context)
        streams = (_SEND_AND_RECEIVE, comm, caller, state.ring)
    else:
        streams = (_SEND if return_recv_hook else _SEND_AND_RECEIVE, _caller_after_tail(context), None, None)
    try:
        made = _dispatch_in_one_call(*args, *streams)
    except BaseException:
        # A call that fails after it has written the set must not leave the
        # set's older handle valid (the Python path moves on before its launch).
        shape.calls = generation + 1
        outputs.generation = generation
        if async_finish:
            _after_failed_launch(context, caller)
        raise
    if made is None:
        if async_finish:
            context.tail = tail
        return None
    event, num_tokens, num_topk = made
    shape.calls = generation + 1
    outputs.generation = generation
    tensors = (x, topk_idx, topk_weights, cumulative_stats, wait_stats)
    hook = None
    if async_finish:
        event = _pending(context, state, event, tensors, tail)
    else:
        event = _NO_EVENT
        if return_recv_hook:
            hook = _ReceiveHook(context, op, _dispatch_receive_in_one_call, args, tensors)
    handle = LowLatencyHandle(outputs.handle_entries)
    handle._info = (outputs, generation, num_tokens, num_topk, topk_weights is not None, (num_tokens, num_topk))
    return outputs.result, outputs.recv_count, handle, event, hook


def _dispatch_receive_in_one_call(*args) -> None:
    if _dispatch_in_one_call(*args) is None:
        _declined_receive("low_latency_dispatch")


def _check_handle(context: OpContext, op: str, handle) -> tuple:
    """The handle's ``(output set, generation, T, K, has_weights, (T, K))`` once it is
    known to come from this buffer's dispatch and to be still valid."""
    if not isinstance(handle, LowLatencyHandle):
        fail(op, "handle", "the handle a low_latency_dispatch of this buffer returned", type(handle).__name__,
             TypeError)
    info = handle._info
    outputs, generation = info[0], info[1]
    if outputs.owner is not context.handle_owner:
        fail(op, "handle", "from a low_latency_dispatch of this buffer", "the handle of another Buffer")
    if outputs.generation != generation:
        fail(op, "handle", "from one of the two latest low_latency_dispatch calls of its shape (a later dispatch "
             "reused its outputs)", f"the handle of dispatch {generation} of that shape, whose outputs dispatch "
             f"{outputs.generation} has since reused")
    return info


def _check_combine_tensors(context: OpContext, op: str, x, topk_idx, topk_weights, rows_shape: tuple,
                           topk_shape: tuple) -> None:
    """Every check of combine's x, topk_idx and topk_weights, each naming what is wrong."""
    device = context.device
    check_tensor(op, "x", x, dtype=torch.bfloat16, shape=rows_shape, device=device)
    check_tensor(op, "topk_idx", topk_idx, dtype=TOPK_IDX_DTYPE, shape=topk_shape, device=device)
    # Required even when dispatch had weights and these are not read (DeepEP's signature).
    check_tensor(op, "topk_weights", topk_weights, dtype=torch.float32, shape=topk_shape, device=device)


def combine(context: OpContext, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            handle, use_logfmt: bool, zero_copy: bool, async_finish: bool, return_recv_hook: bool,
            out: Optional[torch.Tensor], combine_wait_recv_cost_stats: Optional[torch.Tensor]):
    """Buffer.low_latency_combine. Returns ``(combined_x, event, hook)``."""
    op = "low_latency_combine"
    state = context.low_latency
    if state is None or state.shapes is None:
        _state(context, op)
    index = context.device_index
    # The common case in one expression each, the full checks (which name what
    # is wrong) when it fails: this call's whole host budget is a few microseconds.
    info = handle._info if type(handle) is LowLatencyHandle else None
    if info is None or info[0].owner is not context.handle_owner or info[0].generation != info[1]:
        info = _check_handle(context, op, handle)
    outputs, _, num_tokens, num_topk, _, topk_shape = info
    # The common case in one call, where it is in use: it makes the fast-path
    # checks below and the output itself, and declines (None) what fails them.
    if _combine_in_one_call is not None and not (async_finish and return_recv_hook):
        source = outputs.combine_buffer if zero_copy else x
        if source is not None:
            args = (context.native, x, topk_idx, topk_weights, source, outputs.combine_sizes, num_tokens, num_topk,
                    use_logfmt, index, out, combine_wait_recv_cost_stats)
            if async_finish:
                made = _combine_async_in_one_call(context, state, args)
            elif return_recv_hook:
                made = _combine_send_in_one_call(context, op, args)
            else:
                caller = current_raw_stream(index)
                if context.tail != caller:
                    follow(context, caller)
                made = _combine_in_one_call(*args, _SEND_AND_RECEIVE, caller, None, None)
                if made is not None:
                    made = made[0], _NO_EVENT, None
            if made is not None:
                return made
    _, _, max_tokens, hidden, num_experts = handle
    if not (type(x) is _Tensor and type(topk_idx) is _Tensor and type(topk_weights) is _Tensor
            and x.dtype == _BF16_DTYPE and topk_idx.dtype == TOPK_IDX_DTYPE and topk_weights.dtype == _F32_DTYPE
            and x.shape == outputs.expert_rows_shape and topk_idx.shape == topk_shape
            and topk_weights.shape == topk_shape and x.get_device() == index and topk_idx.get_device() == index
            and topk_weights.get_device() == index and x.is_contiguous() and topk_idx.is_contiguous()
            and topk_weights.is_contiguous()):
        _check_combine_tensors(context, op, x, topk_idx, topk_weights, outputs.expert_rows_shape, topk_shape)
    if zero_copy:
        if outputs.combine_buffer is None:
            fail(op, "zero_copy", "used after writing the rows into get_next_low_latency_combine_buffer(handle)",
                 "zero_copy=True for a handle whose combine buffer was never taken")
        x_ptr = outputs.combine_buffer.data_ptr()
    else:
        x_ptr = x.data_ptr()
        if x_ptr % 16:
            _aligned_ptr(op, "x", x)
    if use_logfmt and hidden % SCALE_GROUP:
        fail(op, "use_logfmt", f"False for a hidden size that is not a multiple of {SCALE_GROUP}",
             f"use_logfmt=True with hidden {hidden}")
    if async_finish and return_recv_hook:
        fail(op, "return_recv_hook", "False with async_finish=True (a hook's receive runs on the stream current "
             "when it is called)", True)
    if out is None:
        (combined_x,) = _empty(context.device, _BF16_CODE, num_tokens, hidden)
        out_ptr = combined_x.data_ptr()  # the allocator's blocks are 512-byte aligned
    else:
        combined_x = check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(num_tokens, hidden),
                                  device=context.device)
        out_ptr = _aligned_ptr(op, "out", combined_x)
    wait_ptr = 0 if combine_wait_recv_cost_stats is None else _stats_ptr(
        context, op, "combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, torch.int64, context.num_ranks)
    args = (x_ptr, num_tokens, num_topk, hidden, max_tokens, num_experts, topk_idx.data_ptr(), topk_weights.data_ptr(),
            outputs.plan_ptr, bool(use_logfmt), out_ptr, wait_ptr)
    launch = context.native.low_latency_combine
    if not (async_finish or return_recv_hook):
        caller = current_raw_stream(index)
        if context.tail != caller:
            follow(context, caller)
        launch(*args, _SEND_AND_RECEIVE, caller, None, None)
        return combined_x, _NO_EVENT, None
    tensors = (x, topk_idx, topk_weights, combined_x, combine_wait_recv_cost_stats)
    if async_finish:
        return combined_x, _launch_async(context, state, launch, args, tensors), None
    return combined_x, _NO_EVENT, _launch_send(context, state, op, launch, args, tensors)


def get_next_combine_buffer(context: OpContext, handle) -> torch.Tensor:
    """Buffer.get_next_low_latency_combine_buffer: the bf16 ``[L, M*R, hidden]``
    tensor a zero-copy combine of ``handle`` sends from (two per shape, by the
    handle's generation parity; made on first request)."""
    op = "get_next_low_latency_combine_buffer"
    _state(context, op)
    outputs = _check_handle(context, op, handle)[0]
    if outputs.combine_buffer is None:
        outputs.combine_buffer = torch.empty(outputs.num_local_experts, outputs.num_rows, handle[3],
                                             dtype=torch.bfloat16, device=context.device)
    return outputs.combine_buffer


def clean(context: OpContext, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
          first_call: int = 1) -> None:
    """Buffer.clean_low_latency_buffer: a collective reset of the low-latency
    region, on the communication stream, joined both ways. The next calls are
    numbered from ``first_call`` (every rank the same; other than 1 only in
    tests of numbers far from the start, such as the 32-bit tags' wrap)."""
    op = "clean_low_latency_buffer"
    _state(context, op)
    check_int(op, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1, MAX_TOKENS)
    check_int(op, "hidden", hidden, 8, MAX_HIDDEN)
    if hidden % 8:
        fail(op, "hidden", "a multiple of 8", hidden)
    _check_experts(op, num_experts, context.num_ranks)
    check_int(op, "first_call", first_call, 1, 2**64 - 1)
    with OpStreams(context, op, None, False, False) as streams:
        context.native.clean_low_latency_buffer(context.comm_raw, streams.wait_for, streams.join_to, first_call)
