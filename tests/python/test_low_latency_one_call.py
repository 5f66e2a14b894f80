"""The low-latency dispatch and combine in one call (turnout._torch_ext's
low_latency_dispatch and low_latency_combine), without a GPU: CPU tensors
stand for the buffer's device (index -1, their get_device()), and a recording
entry, built with ctypes as a mirror of python/ext/low_latency_entry.hpp,
stands for _C's launch. Each call hands the entry the tensors it was given
(and combine the output it returns); every call that fails a fast-path check
is declined before the entry is reached; and the ops take these paths only
where they may, with the output sets, streams and pending calls of the Python
path."""
import pytest
import torch

from low_latency_entry_mirror import Entry, Recorder, capsule, install, sizes
from low_latency_standin import (
    CALLER_STREAM,
    COMM_STREAM,
    E,
    FakeRing,
    H,
    K,
    M,
    R,
    T,
    combine,
    dispatch,
    expert_rows,
    inputs,
    make_context,
    patch_streams,
)
from turnout import _C, torch_ext
from turnout.ops import low_latency as ll

MODULE = torch_ext.MODULE
pytestmark = pytest.mark.skipif(MODULE is None, reason="turnout._torch_ext is not in use here (not built against "
                                "this torch, or turned off)")

FAST = -1  # the device index of CPU tensors
L, ROWS, PLAN = E // R, M * R, 0x7000
BOTH = _C.LOW_LATENCY_SEND_AND_RECEIVE


@pytest.fixture
def recorder():
    rec = Recorder()
    alive = install(MODULE, rec)
    yield rec
    MODULE.set_low_latency_entry(_C.Buffer.low_latency_entry)
    del alive


@pytest.fixture(autouse=True)
def caller_stream(monkeypatch):
    return patch_streams(monkeypatch)


class Call:
    """A common call's arguments, each replaceable."""

    def __init__(self):
        g = torch.Generator().manual_seed(2)
        x = torch.randn(L, ROWS, H, generator=g).bfloat16()
        self.args = dict(native=object(), x=x, topk_idx=torch.randint(-1, E, (T, K), generator=g),
                         topk_weights=torch.rand(T, K, generator=g), source=x, sizes=(L, ROWS, H, M, E, PLAN),
                         num_tokens=T, num_topk=K, use_logfmt=False, device_index=FAST, out=None, wait_stats=None,
                         phase=BOTH, stream=CALLER_STREAM, wait_for=None, ring=None)

    def __call__(self, **changes):
        return MODULE.low_latency_combine(*dict(self.args, **changes).values())


def test_the_build_has_the_entry_of_its_own_c_module():
    assert MODULE.set_low_latency_entry(_C.Buffer.low_latency_entry) is None


def test_an_entry_of_another_build_or_name_is_refused(recorder):
    for field in ("entry_size", "dispatch_size", "combine_size"):
        other = Entry(**sizes(**{field: getattr(recorder.entry, field) + 8}), dispatch=recorder.fns[0],
                      combine=recorder.fns[1])
        made, _ = capsule(other)
        with pytest.raises(ImportError, match="different builds"):
            MODULE.set_low_latency_entry(made)
    made, _ = capsule(recorder.entry, b"another.capsule")
    with pytest.raises(ValueError):
        MODULE.set_low_latency_entry(made)


@pytest.mark.parametrize("use_logfmt", [False, True], ids=["bf16", "logfmt"])
def test_the_common_call_hands_the_entry_what_it_returns(recorder, use_logfmt):
    call = Call()
    a = call.args
    combined_x, event = call(use_logfmt=use_logfmt)
    assert event is None and combined_x.dtype == torch.bfloat16 and tuple(combined_x.shape) == (T, H)
    got, = recorder.calls
    assert got["native"] is a["native"] and (got["phase"], got["stream"], got["wait_for"]) == (BOTH, CALLER_STREAM,
                                                                                                None)
    assert got["ring"] is None
    assert got["args"] == {"x": a["x"].data_ptr(), "topk_idx": a["topk_idx"].data_ptr(),
                           "topk_weights": a["topk_weights"].data_ptr(), "num_tokens": T, "num_topk": K, "hidden": H,
                           "num_max_tokens": M, "num_experts": E, "plan": PLAN, "use_logfmt": use_logfmt,
                           "out": combined_x.data_ptr(), "wait_recv_cost_stats": None}


def test_an_async_call_gets_the_rings_event_and_sends_from_the_source(recorder):
    call, ring = Call(), FakeRing()
    source = torch.zeros(L, ROWS, H, dtype=torch.bfloat16)
    combined_x, event = call(source=source, stream=COMM_STREAM, wait_for=CALLER_STREAM, ring=ring,
                             phase=_C.LOW_LATENCY_SEND)
    assert event is ring.events[0] and ring.records == [(event, COMM_STREAM)]
    got, = recorder.calls
    assert (got["phase"], got["stream"], got["wait_for"], got["ring"]) == (_C.LOW_LATENCY_SEND, COMM_STREAM,
                                                                           CALLER_STREAM, ring)
    assert got["args"]["x"] == source.data_ptr() and got["args"]["out"] == combined_x.data_ptr()


def test_a_given_out_is_returned_itself_and_the_stats_are_passed(recorder):
    call = Call()
    out, stats = torch.empty(T, H, dtype=torch.bfloat16), torch.zeros(R, dtype=torch.int64)
    combined_x, _ = call(out=out, wait_stats=stats)
    assert combined_x is out
    args = recorder.calls[-1]["args"]
    assert args["out"] == out.data_ptr() and args["wait_recv_cost_stats"] == stats.data_ptr()


def not_contiguous(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def misaligned_rows():
    flat = torch.zeros(L * ROWS * H + 1, dtype=torch.bfloat16)
    return flat[1:].view(L, ROWS, H)


def narrower(call, **changes):
    """The call with rows 8 channels narrower, its sizes to match, and ``changes``."""
    x = call.args["x"][..., :H - 8].contiguous()
    return dict(x=x, source=x, sizes=(L, ROWS, H - 8, M, E, PLAN), **changes)


DECLINED = {
    "x float32": lambda c: dict(x=c.args["x"].float()),
    "x of another hidden": lambda c: dict(x=c.args["x"][..., :H - 8].contiguous()),
    "x of fewer rows": lambda c: dict(x=c.args["x"][:, :ROWS - 1].contiguous()),
    "x of another expert count": lambda c: dict(x=c.args["x"][:L - 1].contiguous()),
    "x 2-D": lambda c: dict(x=c.args["x"].view(L * ROWS, H)),
    "x not contiguous": lambda c: dict(x=not_contiguous(c.args["x"])),
    "x a Parameter": lambda c: dict(x=torch.nn.Parameter(c.args["x"], requires_grad=False)),
    "x a tuple": lambda c: dict(x=(c.args["x"],)),
    "source of another shape": lambda c: dict(source=c.args["x"][:, :ROWS - 1].contiguous()),
    "source float32": lambda c: dict(source=c.args["x"].float()),
    "source misaligned": lambda c: dict(source=misaligned_rows()),
    "source None": lambda c: dict(source=None),
    "topk_idx int32": lambda c: dict(topk_idx=c.args["topk_idx"].int()),
    "topk_idx of another token count": lambda c: dict(topk_idx=c.args["topk_idx"][:T - 1].contiguous()),
    "topk_idx of no column": lambda c: dict(topk_idx=c.args["topk_idx"][:, :0].contiguous(), num_topk=0),
    "topk_weights float64": lambda c: dict(topk_weights=c.args["topk_weights"].double()),
    "topk_weights of another shape": lambda c: dict(topk_weights=c.args["topk_weights"][:, :K - 1].contiguous()),
    "topk_weights not contiguous": lambda c: dict(topk_weights=not_contiguous(c.args["topk_weights"])),
    "another device index": lambda c: dict(device_index=0),
    "use_logfmt 1, not a bool": lambda c: dict(use_logfmt=1),
    "use_logfmt with hidden not in groups of 128": lambda c: narrower(c, use_logfmt=True),
    "num_tokens negative": lambda c: dict(num_tokens=-1),
    "out float32": lambda c: dict(out=torch.empty(T, H)),
    "out of another token count": lambda c: dict(out=torch.empty(T + 1, H, dtype=torch.bfloat16)),
    "out of another hidden": lambda c: dict(out=torch.empty(T, H - 8, dtype=torch.bfloat16)),
    "out not contiguous": lambda c: dict(out=not_contiguous(torch.empty(T, H, dtype=torch.bfloat16))),
    "out misaligned": lambda c: dict(out=torch.empty(T * H + 1, dtype=torch.bfloat16)[1:].view(T, H)),
    "out a list": lambda c: dict(out=[]),
    "wait stats int32": lambda c: dict(wait_stats=torch.zeros(R, dtype=torch.int32)),
    "wait stats of another rank count": lambda c: dict(wait_stats=torch.zeros(R + 1, dtype=torch.int64)),
    "wait stats 2-D": lambda c: dict(wait_stats=torch.zeros(1, R, dtype=torch.int64)),
}


def test_narrower_rows_alone_are_taken(recorder):
    """What the logfmt case declines for is the width: 8-channel rows alone pass."""
    call = Call()
    assert call(**narrower(call)) is not None and recorder.calls[-1]["args"]["hidden"] == H - 8


def test_bad_sizes_or_phase_are_errors_naming_them(recorder):
    with pytest.raises(TypeError, match="low_latency_combine: sizes"):
        Call()(sizes=[L, ROWS, H, M, E, PLAN])
    with pytest.raises(TypeError, match="low_latency_dispatch: sizes"):
        DispatchCall()(sizes=(H, M, L, R))
    with pytest.raises(ValueError, match="low_latency_dispatch: phase"):
        DispatchCall()(phase=1 << 40)
    assert recorder.calls == []


def launched_by_native(context):
    return [name for name, _ in context.native.calls if name == "low_latency_combine"]


def test_the_op_combines_in_one_call_where_it_may(recorder, caller_stream):
    context = make_context(device_index=FAST)
    state, ring = context.low_latency, context.low_latency.ring
    x, topk_idx = inputs()
    handle = dispatch(context, x, topk_idx)[2]
    y, weights = expert_rows(context), torch.rand(T, K)
    combined_x, event, hook = combine(context, y, topk_idx, weights, handle)
    assert event.event is None and hook is None and not launched_by_native(context)
    got = recorder.calls[-1]
    assert got["native"] is context.native and (got["stream"], got["wait_for"], got["ring"]) == (CALLER_STREAM, None,
                                                                                                 None)
    assert got["args"]["x"] == y.data_ptr() and got["args"]["out"] == combined_x.data_ptr()
    assert got["args"]["plan"] == handle.plan.data_ptr() and got["phase"] == BOTH

    # async_finish: on the comm stream after the caller's, the ring's event, the call pending.
    combined_x, event, hook = combine(context, y, topk_idx, weights, handle, async_finish=True)
    got = recorder.calls[-1]
    assert (got["stream"], got["wait_for"], got["ring"]) == (COMM_STREAM, CALLER_STREAM, ring)
    assert event.event is ring.events[0] and hook is None and context.tail == COMM_STREAM
    (pending_event, tensors), = state.pending
    assert pending_event is ring.events[0] and event.extra_tensors is tensors
    assert tensors[0] is y and any(t is combined_x for t in tensors), "the output must live until its event"

    # Zero copy: the rows go from the combine buffer; a plain call after the async one follows it first.
    buffer = ll.get_next_combine_buffer(context, handle)
    combine(context, y, topk_idx, weights, handle, zero_copy=True)
    assert recorder.calls[-1]["args"]["x"] == buffer.data_ptr() and recorder.calls[-1]["stream"] == CALLER_STREAM
    assert ("follow", {"waiter": CALLER_STREAM, "waited": COMM_STREAM}) in context.native.calls
    assert len(recorder.calls) == 3 and not launched_by_native(context)

    # out= and the wait stats: one call too.
    out, stats = torch.empty(T, H, dtype=torch.bfloat16), torch.zeros(R, dtype=torch.int64)
    assert combine(context, y, topk_idx, weights, handle, out=out, wait=stats)[0] is out
    args = recorder.calls[-1]["args"]
    assert args["out"] == out.data_ptr() and args["wait_recv_cost_stats"] == stats.data_ptr()

    # A hook: the send in one call on the caller's stream, then the receive on the stream current at hook().
    combined_x, event, hook = combine(context, y, topk_idx, weights, handle, return_recv_hook=True)
    send = recorder.calls[-1]
    assert (send["phase"], send["stream"], send["args"]["out"]) == (_C.LOW_LATENCY_SEND, CALLER_STREAM,
                                                                    combined_x.data_ptr())
    assert event.event is None and len(recorder.calls) == 5
    caller_stream[0] = 0x4000
    hook()
    receive = recorder.calls[-1]
    assert (receive["phase"], receive["stream"], receive["wait_for"]) == (_C.LOW_LATENCY_RECEIVE, 0x4000, None)
    assert receive["args"] == send["args"], "the receive writes the send's output, from the same inputs"
    with pytest.raises(RuntimeError, match="already called"):
        hook()
    assert len(recorder.calls) == 6 and not launched_by_native(context)


def test_a_hooks_receive_that_is_declined_raises(recorder):
    context = make_context(device_index=FAST)
    x, topk_idx = inputs()
    handle = dispatch(context, x, topk_idx)[2]
    y = expert_rows(context)
    hook = combine(context, y, topk_idx, torch.rand(T, K), handle, return_recv_hook=True)[2]
    y.resize_(1, 1, H)
    with pytest.raises(RuntimeError, match="hook's receive was declined"):
        hook()
    assert [c["phase"] for c in recorder.calls] == [_C.LOW_LATENCY_SEND]


@pytest.mark.parametrize("async_finish", [False, True], ids=["plain", "async"])
def test_a_declined_call_takes_the_python_path_which_names_what_is_wrong(recorder, async_finish):
    context = make_context(device_index=FAST)
    x, topk_idx = inputs()
    handle = dispatch(context, x, topk_idx)[2]
    tail = context.tail
    with pytest.raises(TypeError, match="topk_weights"):
        combine(context, expert_rows(context), topk_idx, torch.rand(T, K).double(), handle, async_finish=async_finish)
    assert recorder.calls == [] and not launched_by_native(context)
    assert context.tail == tail and not context.low_latency.pending


def test_an_async_one_call_that_raises_joins_the_callers_stream_back(monkeypatch):
    context = make_context(device_index=FAST)
    x, topk_idx = inputs()
    handle = dispatch(context, x, topk_idx)[2]
    calls = []

    def raises(*args):
        calls.append(args)
        raise RuntimeError("raised after the launch")

    monkeypatch.setattr(ll, "_combine_in_one_call", raises)
    with pytest.raises(RuntimeError, match="raised after the launch"):
        combine(context, expert_rows(context), topk_idx, torch.rand(T, K), handle, async_finish=True)
    assert len(calls) == 1 and context.native.calls[-1] == ("join", {"waiter": CALLER_STREAM, "waited": COMM_STREAM})
    assert context.tail == CALLER_STREAM and not context.low_latency.pending


class DispatchCall:
    """A common dispatch's arguments, each replaceable."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.args = dict(native=object(), outputs=object(), x=torch.randn(T, H, generator=g).bfloat16(),
                         topk_idx=torch.randint(-1, E, (T, K), generator=g), topk_weights=None,
                         sizes=(H, M, L, R, PLAN), round_scale=False, cumulative=None, wait_stats=None,
                         device_index=FAST, phase=BOTH, stream=CALLER_STREAM, wait_for=None, ring=None)

    def __call__(self, **changes):
        return MODULE.low_latency_dispatch(*dict(self.args, **changes).values())


def test_the_common_dispatch_hands_the_entry_what_it_is_given(recorder):
    call = DispatchCall()
    a = call.args
    assert call() == (None, T, K)
    got, = recorder.calls
    assert got["op"] == "dispatch" and got["native"] is a["native"] and got["outputs"] is a["outputs"]
    assert (got["phase"], got["stream"], got["wait_for"], got["ring"]) == (BOTH, CALLER_STREAM, None, None)
    args = got["args"]
    assert (args["x"], args["num_tokens"], args["topk_idx"], args["num_topk"]) == (
        a["x"].data_ptr(), T, a["topk_idx"].data_ptr(), K)
    assert args["topk_weights"] is None and args["round_scale"] is False
    assert args["cumulative_local_expert_recv_stats"] is None and args["wait_recv_cost_stats"] is None

    ring, weights = FakeRing(), torch.rand(T, K)
    cumulative, wait = torch.zeros(L, dtype=torch.int32), torch.zeros(R, dtype=torch.int64)
    event, tokens, topk = call(topk_weights=weights, round_scale=True, cumulative=cumulative, wait_stats=wait,
                               phase=_C.LOW_LATENCY_SEND, stream=COMM_STREAM, wait_for=CALLER_STREAM, ring=ring)
    assert event is ring.events[0] and (tokens, topk) == (T, K)
    got = recorder.calls[-1]
    assert (got["phase"], got["stream"], got["wait_for"], got["ring"]) == (_C.LOW_LATENCY_SEND, COMM_STREAM,
                                                                           CALLER_STREAM, ring)
    args = got["args"]
    assert args["topk_weights"] == weights.data_ptr() and args["round_scale"] is True
    assert args["cumulative_local_expert_recv_stats"] == cumulative.data_ptr()
    assert args["wait_recv_cost_stats"] == wait.data_ptr()


def test_weights_of_no_token_still_reach_the_plan(recorder):
    """An empty tensor has no address: the plan's stands for it, so peers
    still learn that this rank gave weights."""
    call = DispatchCall()
    x, idx = torch.empty(0, H, dtype=torch.bfloat16), torch.empty(0, K, dtype=torch.int64)
    assert call(x=x, topk_idx=idx, topk_weights=torch.empty(0, K)) == (None, 0, K)
    assert recorder.calls[-1]["args"]["topk_weights"] == PLAN


DISPATCH_DECLINED = {
    "x float32": lambda c: dict(x=c.args["x"].float()),
    "x of another hidden": lambda c: dict(x=c.args["x"][:, :H - 8].contiguous()),
    "x of more rows than M": lambda c: dict(x=torch.zeros(M + 1, H, dtype=torch.bfloat16),
                                            topk_idx=torch.zeros(M + 1, K, dtype=torch.int64)),
    "x 3-D": lambda c: dict(x=c.args["x"].view(1, T, H)),
    "x not contiguous": lambda c: dict(x=not_contiguous(c.args["x"])),
    "x misaligned": lambda c: dict(x=torch.zeros(T * H + 1, dtype=torch.bfloat16)[1:].view(T, H)),
    "x a Parameter": lambda c: dict(x=torch.nn.Parameter(c.args["x"], requires_grad=False)),
    "topk_idx int32": lambda c: dict(topk_idx=c.args["topk_idx"].int()),
    "topk_idx of another token count": lambda c: dict(topk_idx=c.args["topk_idx"][:T - 1].contiguous()),
    "topk_idx of no column": lambda c: dict(topk_idx=c.args["topk_idx"][:, :0].contiguous()),
    "topk_idx of too many columns": lambda c: dict(topk_idx=torch.zeros(T, ll.MAX_TOPK + 1, dtype=torch.int64)),
    "topk_weights float64": lambda c: dict(topk_weights=torch.rand(T, K).double()),
    "topk_weights of another shape": lambda c: dict(topk_weights=torch.rand(T, K + 1)),
    "topk_weights not contiguous": lambda c: dict(topk_weights=not_contiguous(torch.rand(T, K))),
    "cumulative stats int64": lambda c: dict(cumulative=torch.zeros(L, dtype=torch.int64)),
    "cumulative stats of another length": lambda c: dict(cumulative=torch.zeros(L + 1, dtype=torch.int32)),
    "wait stats int32": lambda c: dict(wait_stats=torch.zeros(R, dtype=torch.int32)),
    "wait stats of another length": lambda c: dict(wait_stats=torch.zeros(R - 1, dtype=torch.int64)),
    "round_scale 1, not a bool": lambda c: dict(round_scale=1),
    "another device index": lambda c: dict(device_index=0),
}


# Both ops' declined calls: (id, the op's call, the change to its arguments).
DECLINED_CASES = ([(f"combine: {k}", Call, DECLINED[k]) for k in sorted(DECLINED)] +
                  [(f"dispatch: {k}", DispatchCall, DISPATCH_DECLINED[k]) for k in sorted(DISPATCH_DECLINED)])
OPS = pytest.mark.parametrize("make", [Call, DispatchCall], ids=["combine", "dispatch"])


@pytest.mark.parametrize("name, make, change", DECLINED_CASES, ids=[case[0] for case in DECLINED_CASES])
def test_a_call_that_is_not_the_common_case_is_declined_before_the_entry(recorder, name, make, change):
    call = make()
    assert call(**change(call)) is None
    assert recorder.calls == []


@OPS
def test_an_entry_that_does_not_take_the_buffer_gives_none(recorder, make):
    recorder.code = 1
    assert make()() is None and len(recorder.calls) == 1


@OPS
def test_the_c_entry_does_not_take_what_is_not_its_buffer(make):
    MODULE.set_low_latency_entry(_C.Buffer.low_latency_entry)
    assert make()() is None


def dispatches_by_native(context):
    return [name for name, _ in context.native.calls if name == "low_latency_dispatch"]


def test_the_op_dispatches_in_one_call_once_the_shape_has_both_sets(recorder, caller_stream):
    context = make_context(device_index=FAST)
    state, ring = context.low_latency, context.low_latency.ring
    x, topk_idx = inputs()
    # The first two make the shape's two output sets: the Python path.
    handles = [dispatch(context, x, topk_idx)[2] for _ in range(2)]
    assert recorder.calls == [] and len(dispatches_by_native(context)) == 2
    recv_x, recv_count, handle, event, hook = dispatch(context, x, topk_idx)
    got = recorder.calls[-1]
    assert got["op"] == "dispatch" and got["outputs"] is handle._info[0].args and event.event is None
    assert hook is None and len(dispatches_by_native(context)) == 2
    assert handle.generation == 2 and handle[0] is handles[0][0] and recv_x[0] is handle._info[0].result[0]
    assert (handle.num_tokens, handle.num_topk, handle.has_weights) == (T, K, False)
    # The set it reused no longer serves the first handle; the second's still does.
    with pytest.raises(ValueError, match="handle"):
        combine(context, expert_rows(context), topk_idx, torch.rand(T, K), handles[0])
    combine(context, expert_rows(context), topk_idx, torch.rand(T, K), handles[1])

    # async_finish: on the comm stream after the caller's, the ring's event, the call pending.
    weights = torch.rand(T, K)
    _, _, handle, event, _ = dispatch(context, x, topk_idx, async_finish=True, topk_weights=weights)
    got = recorder.calls[-1]
    assert got["op"] == "dispatch" and (got["stream"], got["wait_for"], got["ring"]) == (COMM_STREAM, CALLER_STREAM,
                                                                                         ring)
    assert event.event is state.pending[-1][0] and event.extra_tensors[0] is x and handle.has_weights
    assert context.tail == COMM_STREAM and handle.generation == 3

    # A hook: the send now, the receive on the stream current at hook().
    _, _, handle, event, hook = dispatch(context, x, topk_idx, return_recv_hook=True)
    assert recorder.calls[-1]["phase"] == _C.LOW_LATENCY_SEND and recorder.calls[-1]["stream"] == CALLER_STREAM
    caller_stream[0] = 0x4000
    hook()
    got = recorder.calls[-1]
    assert (got["op"], got["phase"], got["stream"]) == ("dispatch", _C.LOW_LATENCY_RECEIVE, 0x4000)
    assert got["args"] == recorder.calls[-2]["args"] and len(dispatches_by_native(context)) == 2

    # Another hidden size: a shape of its own, the Python path until it has both sets.
    wide = torch.randn(T, 2 * H).bfloat16()
    dispatch(context, wide, topk_idx)
    assert len(dispatches_by_native(context)) == 3


@pytest.mark.parametrize("mode", ["plain", "async_finish", "hook"])
def test_a_declined_dispatch_takes_the_python_path_and_keeps_the_set(recorder, mode):
    context = make_context(device_index=FAST)
    x, topk_idx = inputs()
    shape_handles = [dispatch(context, x, topk_idx)[2] for _ in range(2)]
    kwargs = {"async_finish": mode == "async_finish", "return_recv_hook": mode == "hook"}
    with pytest.raises(ValueError, match="topk_weights"):
        dispatch(context, x, topk_idx, topk_weights=torch.rand(T, K + 1), **kwargs)
    assert recorder.calls == [] and not context.low_latency.pending
    for handle in shape_handles:  # both handles still valid: no set was taken
        combine(context, expert_rows(context), topk_idx, torch.rand(T, K), handle)


def test_a_dispatch_one_call_that_raises_invalidates_the_sets_older_handle(monkeypatch):
    context = make_context(device_index=FAST)
    x, topk_idx = inputs()
    handles = [dispatch(context, x, topk_idx)[2] for _ in range(2)]

    def raises(*args):
        raise RuntimeError("raised after the launch")

    monkeypatch.setattr(ll, "_dispatch_in_one_call", raises)
    with pytest.raises(RuntimeError, match="raised after the launch"):
        dispatch(context, x, topk_idx, async_finish=True)
    assert context.native.calls[-1] == ("join", {"waiter": CALLER_STREAM, "waited": COMM_STREAM})
    assert context.tail == CALLER_STREAM and not context.low_latency.pending
    with pytest.raises(ValueError, match="handle"):
        combine(context, expert_rows(context), topk_idx, torch.rand(T, K), handles[0])
