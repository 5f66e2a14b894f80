"""Normal mode's argument checks without a GPU: get_dispatch_layout, dispatch
and combine over CPU tensors and a stand-in for their native calls. Each op
checks its common case in one expression first and runs the full checks
when that fails: a bad argument raises the same error, naming it, whichever
path it meets, and nothing is launched."""
import types

import pytest
import torch

from low_latency_standin import CALLER_STREAM, NormalNativeStandIn, patch_streams
from turnout import Buffer, Config
from turnout.event import EventOverlap
from turnout.ops import handle as handle_module
from turnout.ops import intranode, layout
from turnout.ops import streams as streams_module

R, T, H, E, K = 4, 6, 64, 16, 3

# The stand-in's CPU tensors are on the context's "GPU" when its device index
# is -1 (their get_device()): the ops then take their fast paths. Index 0
# sends every call to the full checks.
FAST, FULL = -1, 0
PATHS = pytest.mark.parametrize("device_index", [FAST, FULL], ids=["fast path", "full checks"])


@pytest.fixture(autouse=True)
def caller_stream(monkeypatch):
    return patch_streams(monkeypatch)


def buffer_on(device_index):
    context = types.SimpleNamespace(native=NormalNativeStandIn(), device=torch.device("cpu"), device_index=device_index,
                                    num_ranks=R, num_rdma_ranks=1, comm_stream=None, comm_raw=0x2000,
                                    handle_owner=object(), low_latency=None, tail=None)
    buf = Buffer.__new__(Buffer)
    buf._context, buf._native, buf.group_size = context, context.native, R
    return buf


def launched(buf):
    return [method for method, _ in buf._context.native.calls if method != "join"]


class PreviousEvent(EventOverlap):
    """A previous_event whose event the communication stream waits for as a low-latency op's."""

    def __init__(self):
        super().__init__(types.SimpleNamespace(wait=lambda stream: None))


def misaligned(rows, cols, dtype=torch.bfloat16):
    return torch.zeros(rows * cols + 8, dtype=dtype)[1:1 + rows * cols].view(rows, cols)


class Inputs:
    def __init__(self, buf):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(T, H, generator=g).bfloat16()
        self.topk_idx = torch.randint(0, E, (T, K), generator=g)
        self.weights = torch.rand(T, K, generator=g)
        self.per_rank, _, self.per_expert, self.in_rank, _ = buf.get_dispatch_layout(self.topk_idx, E)

    def dispatch(self, buf, **changes):
        args = dict(x=self.x, num_tokens_per_rank=self.per_rank, is_token_in_rank=self.in_rank,
                    num_tokens_per_expert=self.per_expert, topk_idx=self.topk_idx, topk_weights=self.weights)
        args.update(changes)
        return buf.dispatch(**args)


LAYOUT_ERRORS = [
    (dict(topk_idx=torch.zeros(T, K, dtype=torch.int32)), TypeError, "topk_idx must be of dtype torch.int64"),
    (dict(topk_idx=torch.zeros(T * K, dtype=torch.int64)), ValueError, "topk_idx must be 2-D"),
    (dict(topk_idx=torch.zeros(K, T, dtype=torch.int64).t()), ValueError, "topk_idx must be contiguous"),
    (dict(num_experts=16.0), TypeError, "num_experts must be an int"),
    (dict(num_experts=True), TypeError, "num_experts must be an int"),
    (dict(num_experts=0), ValueError, "num_experts must be >= 1"),
    (dict(num_experts=18), ValueError, "num_experts must be a multiple of the group size 4"),
]


@PATHS
@pytest.mark.parametrize("changes, kind, message", LAYOUT_ERRORS)
def test_bad_layout_arguments_raise_naming_them(changes, kind, message, device_index):
    buf = buffer_on(device_index)
    args = dict(topk_idx=torch.zeros(T, K, dtype=torch.int64), num_experts=E)
    args.update(changes)
    with pytest.raises(kind, match=f"^get_dispatch_layout: {message}"):
        buf.get_dispatch_layout(args.pop("topk_idx"), args.pop("num_experts"))
    assert launched(buf) == []


DISPATCH_ERRORS = [
    (dict(x=torch.randn(T, H)), TypeError, "x must be of dtype torch.bfloat16"),
    (dict(x=torch.randn(H, T).bfloat16().t()), ValueError, "x must be contiguous"),
    (dict(x=torch.randn(1, T, H).bfloat16()), ValueError, "x must be 2-D"),
    (dict(x=torch.randn(T, 60).bfloat16()), ValueError, "x must be of a hidden size that is a multiple of 8"),
    (dict(x=misaligned(T, H)), ValueError, "x must be starting at a 16-byte aligned address"),
    (dict(x=(torch.randn(T, H).bfloat16(), torch.ones(T, 1))), TypeError, r"x\[0\] must be of dtype"),
    (dict(is_token_in_rank=torch.zeros(T - 1, R, dtype=torch.bool)), ValueError,
     r"is_token_in_rank must be of shape \(6, 4\)"),
    (dict(is_token_in_rank=torch.zeros(T, R, dtype=torch.int32)), TypeError, "is_token_in_rank must be of dtype"),
    (dict(num_tokens_per_rank=torch.zeros(R, dtype=torch.int64)), TypeError, "num_tokens_per_rank must be of dtype"),
    (dict(num_tokens_per_rank=torch.zeros(R + 1, dtype=torch.int32)), ValueError,
     r"num_tokens_per_rank must be of shape \(4,\)"),
    (dict(num_tokens_per_expert=torch.zeros(E, dtype=torch.int64)), TypeError,
     "num_tokens_per_expert must be of dtype"),
    (dict(num_tokens_per_expert=torch.zeros(2, E, dtype=torch.int32)), ValueError, "num_tokens_per_expert must be 1-D"),
    (dict(num_tokens_per_expert=torch.zeros(E + 2, dtype=torch.int32)), ValueError,
     "num_tokens_per_expert must be of a length that is a positive multiple"),
    (dict(topk_idx=torch.zeros(T, K, dtype=torch.int32)), TypeError, "topk_idx must be of dtype torch.int64"),
    (dict(topk_idx=torch.zeros(T - 1, K, dtype=torch.int64)), ValueError, "topk_idx must be of 6 rows like x"),
    (dict(topk_weights=torch.rand(T, K + 1)), ValueError, r"topk_weights must be of shape \(6, 3\)"),
    (dict(topk_weights=torch.rand(T, K).double()), TypeError, "topk_weights must be of dtype torch.float32"),
    (dict(topk_weights=None), ValueError, "topk_weights must be given with the other top-k tensor"),
    (dict(expert_alignment=0), ValueError, "expert_alignment must be >= 1"),
    (dict(expert_alignment=True), TypeError, "expert_alignment must be an int"),
    (dict(num_worst_tokens=-1), ValueError, "num_worst_tokens must be >= 0"),
    (dict(num_worst_tokens=8.0), TypeError, "num_worst_tokens must be an int"),
    (dict(config=7), TypeError, "config must be a turnout.Config or None"),
]


@PATHS
@pytest.mark.parametrize("changes, kind, message", DISPATCH_ERRORS)
def test_bad_dispatch_arguments_raise_naming_them_and_launch_nothing(changes, kind, message, device_index):
    buf = buffer_on(device_index)
    inputs = Inputs(buf)
    inputs.dispatch(buf)
    with pytest.raises(kind, match=f"^dispatch: {message}"):
        inputs.dispatch(buf, **changes)
    assert launched(buf) == ["get_dispatch_layout", "dispatch_counts", "dispatch"]


def combine_case(buf, inputs, **changes):
    recv_x, _, recv_weights, _, handle, _ = inputs.dispatch(buf)
    args = dict(x=recv_x, handle=handle, topk_weights=recv_weights)
    args.update({k: v(args) if callable(v) else v for k, v in changes.items()})
    return args


COMBINE_ERRORS = [
    (dict(x=lambda a: torch.zeros(T + 1, H, dtype=torch.bfloat16)), ValueError,
     r"x must be of 6 rows \(the handle's receive count\)"),
    (dict(x=lambda a: torch.zeros(T, H)), TypeError, "x must be of dtype torch.bfloat16"),
    (dict(x=lambda a: misaligned(T, H)), ValueError, "x must be starting at a 16-byte aligned address"),
    (dict(x=lambda a: torch.zeros(T, 60, dtype=torch.bfloat16)), ValueError, "x must be of a hidden size"),
    (dict(handle=(1, 2)), TypeError, "handle must be the six-entry handle"),
    (dict(handle=lambda a: tuple(a["handle"][:3]) + (a["handle"][3].long(),) + tuple(a["handle"][4:])), TypeError,
     r"handle\[3\] \(recv_src_idx\) must be of dtype torch.int32"),
    (dict(topk_weights=lambda a: torch.zeros(T + 2, K)), ValueError, "topk_weights must be of 6 rows like x"),
    (dict(topk_weights=lambda a: torch.zeros(T, K, dtype=torch.float64)), TypeError, "topk_weights must be of dtype"),
    (dict(bias=torch.zeros(5, H, dtype=torch.bfloat16)), ValueError, r"bias must be of shape \(6, 64\)"),
    (dict(bias=(None, torch.zeros(T, H))), TypeError, r"bias\[1\] must be of dtype torch.bfloat16"),
    (dict(bias=(None, None, None)), TypeError, "bias must be None, a tensor or a tuple of two tensors"),
    (dict(bias=misaligned(T, H)), ValueError, "bias must be starting at a 16-byte aligned address"),
]


@PATHS
@pytest.mark.parametrize("changes, kind, message", COMBINE_ERRORS)
def test_bad_combine_arguments_raise_naming_them_and_launch_nothing(changes, kind, message, device_index):
    buf = buffer_on(device_index)
    inputs = Inputs(buf)
    buf.combine(**combine_case(buf, inputs))
    args = combine_case(buf, inputs, **changes)
    with pytest.raises(kind, match=f"^combine: {message}"):
        buf.combine(**args)
    assert launched(buf)[-1] == "dispatch" and launched(buf).count("combine") == 1


@PATHS
def test_combine_hands_on_where_the_dispatch_counts_put_its_own_rows(device_index):
    buf = buffer_on(device_index)
    inputs = Inputs(buf)
    buf._context.native.own_rows = (2, 3)
    recv_x, _, recv_weights, _, handle, _ = inputs.dispatch(buf)
    buf.combine(recv_x, handle, recv_weights)
    worst = inputs.dispatch(buf, num_worst_tokens=T * R)
    buf.combine(worst[0], worst[4], worst[2])
    # A handle as a plain tuple of the same tensors does not say.
    buf.combine(recv_x, tuple(handle), recv_weights)
    combines = [(c["own_rows_begin"], c["num_own_rows"]) for m, c in buf._context.native.calls if m == "combine"]
    assert combines == [(2, 3), (-1, 0), (-1, 0)]


def test_a_handle_of_another_buffer_is_refused():
    mine, other = buffer_on(FAST), buffer_on(FAST)
    handle = Inputs(other).dispatch(other)[4]
    recv_x, recv_weights = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, K)
    with pytest.raises(ValueError, match="^combine: handle must be from a dispatch of this buffer"):
        mine.combine(recv_x, handle, recv_weights)
    with pytest.raises(ValueError, match="^dispatch: handle must be from a dispatch of this buffer"):
        mine.dispatch(recv_x, handle)


def test_a_plain_tuple_handle_is_checked_and_accepted():
    buf = buffer_on(FAST)
    inputs = Inputs(buf)
    recv_x, _, recv_weights, _, handle, _ = inputs.dispatch(buf)
    buf.combine(recv_x, tuple(handle), recv_weights)
    buf.dispatch(inputs.x, list(handle))
    assert launched(buf)[-2:] == ["combine", "dispatch_known_rows"]


def test_plain_arguments_skip_the_full_checks(monkeypatch):
    buf = buffer_on(FAST)
    inputs = Inputs(buf)
    inputs.dispatch(buf)

    def full_check(*args, **kwargs):
        raise AssertionError("the full check ran")

    for module in (intranode, layout, handle_module):
        for name in ("check_tensor", "check_int", "check_x", "check_aligned"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, full_check)
    buf.get_dispatch_layout(inputs.topk_idx, E)
    recv_x, _, recv_weights, _, handle, _ = inputs.dispatch(buf, num_worst_tokens=T * R)
    inputs.dispatch(buf)
    buf.dispatch(inputs.x, handle)
    for scales_dtype in (torch.float32, torch.int32):
        x_fp8 = (torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(2, T, dtype=scales_dtype).t())
        (recv_fp8, recv_scales), *_ = inputs.dispatch(buf, x=x_fp8)
        assert recv_fp8.dtype == torch.float8_e4m3fn and recv_scales.dtype == scales_dtype
        call = [c for m, c in buf._context.native.calls if m == "dispatch"][-1]
        assert (call["row_bytes"], call["num_scales"], call["scale_stride_token"], call["scale_stride_group"]) == \
            (H, 2, 1, T)
        buf.dispatch(x_fp8, handle)
    bias = torch.zeros(T, H, dtype=torch.bfloat16)
    buf.combine(torch.zeros(T * R, H, dtype=torch.bfloat16), handle, torch.zeros(T * R, K), (bias, bias))
    assert launched(buf)[-1] == "combine"


def test_the_default_config_is_made_once_per_group_size_and_sm_count():
    buf = buffer_on(FAST)
    inputs = Inputs(buf)
    inputs.dispatch(buf)
    inputs.dispatch(buf)
    first, second = [c["config"] for m, c in buf._context.native.calls if m == "dispatch"]
    assert first is second and isinstance(first, Config) and first.num_sms == Buffer.num_sms
    Buffer.set_num_sms(Buffer.num_sms + 2)  # the conftest fixture restores it
    inputs.dispatch(buf)
    third = [c["config"] for m, c in buf._context.native.calls if m == "dispatch"][-1]
    assert third is not first and third.num_sms == Buffer.num_sms
    assert repr(third) == repr(Buffer.get_dispatch_config(R))


def plain_calls(buf, inputs):
    """Each plain op once, by name; the handle from a dispatch made first."""
    recv_x, _, recv_weights, _, handle, _ = inputs.dispatch(buf)
    return {"layout": lambda: buf.get_dispatch_layout(inputs.topk_idx, E),
            "worst": lambda: inputs.dispatch(buf, num_worst_tokens=T * R),
            "waited": lambda: inputs.dispatch(buf),
            "cached": lambda: buf.dispatch(inputs.x, handle),
            "combine": lambda: buf.combine(recv_x, handle, recv_weights)}


def stream_calls(buf):
    return [(m, c) for m, c in buf._context.native.calls if m in ("join", "follow")]


@pytest.mark.parametrize("call", ["layout", "worst", "waited", "cached", "combine"])
def test_a_native_call_that_raises_leaves_the_callers_stream_as_it_is(call, caller_stream):
    """A plain op queues its work on the caller's stream alone: nothing to join
    back. Issued on another stream than the last op's, that stream waited for
    it before the call, so it is the tail even though the call failed."""
    buf = buffer_on(FAST)
    calls = plain_calls(buf, Inputs(buf))
    buf._context.native.fail_next = RuntimeError("raised by the native call")
    with pytest.raises(RuntimeError, match="raised by the native call"):
        calls[call]()
    assert stream_calls(buf) == [] and buf._context.tail == CALLER_STREAM
    caller_stream[0] = 0x3000
    buf._context.native.fail_next = RuntimeError("raised by the native call")
    with pytest.raises(RuntimeError, match="raised by the native call"):
        calls[call]()
    assert stream_calls(buf) == [("follow", {"waiter": 0x3000, "waited": CALLER_STREAM})]
    assert buf._context.tail == 0x3000


@pytest.mark.parametrize("device_index", [FAST, FULL], ids=["fast path", "full checks"])
def test_plain_ops_run_on_the_callers_stream_without_a_join(device_index):
    buf = buffer_on(device_index)
    calls = plain_calls(buf, Inputs(buf))
    for call in calls.values():
        call()
    assert stream_calls(buf) == []
    assert all((c["stream"], c.get("wait_for"), c.get("join_to")) == (CALLER_STREAM, None, None)
               for _, c in buf._context.native.calls)
    assert buf._context.tail == CALLER_STREAM


@pytest.mark.parametrize("call", ["layout", "worst", "waited", "cached", "combine"])
def test_a_plain_op_on_another_stream_first_waits_for_the_last_op(call, caller_stream):
    buf = buffer_on(FAST)
    calls = plain_calls(buf, Inputs(buf))
    caller_stream[0] = 0x3000
    calls[call]()
    assert stream_calls(buf) == [("follow", {"waiter": 0x3000, "waited": CALLER_STREAM})]
    assert buf._context.native.calls[-1][1]["stream"] == 0x3000
    calls[call]()
    assert len(stream_calls(buf)) == 1, "the same stream again: no wait"


@pytest.mark.parametrize("call", ["layout", "worst", "waited", "cached", "combine"])
def test_a_plain_op_after_an_async_one_first_waits_for_the_comm_stream(call):
    buf = buffer_on(FAST)
    calls = plain_calls(buf, Inputs(buf))
    streams_module.OpStreams(buf._context, "dispatch", None, True, False)
    assert buf._context.tail == 0x2000, "an async op leaves the communication stream ahead"
    calls[call]()
    assert stream_calls(buf) == [("follow", {"waiter": CALLER_STREAM, "waited": 0x2000})]
    assert buf._context.tail == CALLER_STREAM


def test_an_op_on_the_comm_stream_waits_for_the_plain_ones(caller_stream):
    buf = buffer_on(FAST)
    context = buf._context
    Inputs(buf)
    ops = streams_module.OpStreams(context, "dispatch", None, True, False)
    assert stream_calls(buf) == [] and ops.wait_for == CALLER_STREAM, "its first native call joins the caller's"
    # Plain ops on another stream, then an async op issued on the first: it waits for both.
    caller_stream[0] = 0x3000
    buf.get_dispatch_layout(torch.zeros(T, K, dtype=torch.int64), E)
    caller_stream[0] = CALLER_STREAM
    ops = streams_module.OpStreams(context, "dispatch", None, True, False)
    assert stream_calls(buf)[-1] == ("follow", {"waiter": 0x2000, "waited": 0x3000})
    assert ops.wait_for == CALLER_STREAM and context.tail == 0x2000
    # With previous_event the caller's stream is not joined by the op: it waits for the last plain op there.
    buf.get_dispatch_layout(torch.zeros(T, K, dtype=torch.int64), E)
    ops = streams_module.OpStreams(context, "dispatch", PreviousEvent(), False, False)
    assert stream_calls(buf)[-1] == ("follow", {"waiter": 0x2000, "waited": CALLER_STREAM})
    assert ops.wait_for is None and ops.join_to == CALLER_STREAM and context.tail == CALLER_STREAM


def test_an_op_being_captured_does_not_become_the_eager_tail(caller_stream, monkeypatch):
    """Eager on the caller's stream, then an op captured on another: the
    native follow skips the wait (the capture's boundary) and the eager tail
    stays, so the next eager op on a third stream waits for the first."""
    buf = buffer_on(FAST)
    calls = plain_calls(buf, Inputs(buf))
    context = buf._context
    assert context.tail == CALLER_STREAM
    context.native.follow_waits = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    caller_stream[0] = 0x3000
    calls["layout"]()
    assert stream_calls(buf)[-1] == ("follow", {"waiter": 0x3000, "waited": CALLER_STREAM})
    assert context.tail == CALLER_STREAM, "the captured op left the eager tail as it was"
    context.native.follow_waits = True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    caller_stream[0] = 0x4000
    calls["layout"]()
    assert stream_calls(buf)[-1] == ("follow", {"waiter": 0x4000, "waited": CALLER_STREAM})
    assert context.tail == 0x4000


def test_an_eager_op_after_a_captured_tail_becomes_the_tail(caller_stream, monkeypatch):
    """The tail a capture left (the buffer's first op was captured): an eager
    op whose wait on it was skipped becomes the tail, so eager ops on other
    streams wait for it, not for the capture."""
    buf = buffer_on(FAST)
    calls = plain_calls(buf, Inputs(buf))
    context = buf._context
    context.tail = 0x5000  # a stream still capturing
    context.native.follow_waits = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls["layout"]()
    assert stream_calls(buf)[-1] == ("follow", {"waiter": CALLER_STREAM, "waited": 0x5000})
    assert context.tail == CALLER_STREAM


@pytest.mark.parametrize("tail", [CALLER_STREAM, 0x3000, 0x2000], ids=["caller", "another stream", "comm"])
def test_an_async_op_that_fails_before_its_native_call_leaves_the_callers_stream_the_tail(tail, caller_stream):
    """An async op sets the comm stream as the tail up front; failing before
    its first native call (an allocation, say), the comm stream never waited
    for the caller's: unwind makes the caller's stream wait for the comm
    stream and the caller's stream the tail, which is after both."""
    buf = buffer_on(FAST)
    context = buf._context
    context.tail = tail
    with pytest.raises(MemoryError):
        with streams_module.OpStreams(context, "dispatch", None, True, False):
            assert context.tail == 0x2000
            raise MemoryError("an allocation failed")
    assert stream_calls(buf)[-1] == ("join", {"waiter": CALLER_STREAM, "waited": 0x2000})
    assert context.tail == CALLER_STREAM
    if tail == 0x3000:
        assert ("follow", {"waiter": 0x2000, "waited": 0x3000}) in stream_calls(buf)


class NoEvent:
    """torch.cuda.Event without a GPU: nothing to record."""

    def record(self, stream):
        pass


@pytest.mark.parametrize("async_finish", [True, False])
def test_an_op_on_the_comm_stream_in_a_capture_leaves_the_eager_tail(async_finish, monkeypatch):
    """previous_event or async_finish inside a capture: the op's streams are
    the capture's, so its finish puts the eager tail back; eager, the tail is
    the comm stream (async) or the caller's."""
    buf = buffer_on(FAST)
    context = buf._context
    context.tail = 0x3000
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    previous = None if async_finish else PreviousEvent()
    ops = streams_module.OpStreams(context, "dispatch", previous, async_finish, False)
    ops.join_to = None
    monkeypatch.setattr(torch.cuda, "Event", NoEvent)
    ops.finish(())
    assert context.tail == 0x3000
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ops = streams_module.OpStreams(context, "dispatch", previous, async_finish, False)
    ops.finish(())
    assert context.tail == (0x2000 if async_finish else CALLER_STREAM)
