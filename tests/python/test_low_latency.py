"""Low-latency mode without a GPU: DeepEP's signatures, the size functions,
and the Python layer (checks, output sets, handles, hooks, streams) driven
over CPU tensors against a stand-in for the native buffer that holds every
call to the binding's own signature (low_latency_standin)."""
import inspect
import weakref

import pytest
import torch

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
from turnout import _C, Buffer
from turnout.ops import low_latency as ll
from turnout.ops import streams as ops_streams

# -- DeepEP's signatures ----------------------------------------------------------------------------------------

EMPTY = inspect.Parameter.empty

DEEPEP_SIGNATURES = {
    "low_latency_dispatch": [
        ("x", EMPTY), ("topk_idx", EMPTY), ("num_max_dispatch_tokens_per_rank", EMPTY), ("num_experts", EMPTY),
        ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
        ("round_scale", False), ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [
        ("x", EMPTY), ("topk_idx", EMPTY), ("topk_weights", EMPTY), ("handle", EMPTY), ("use_logfmt", False),
        ("zero_copy", False), ("async_finish", False), ("return_recv_hook", False), ("out", None),
        ("combine_wait_recv_cost_stats", None)],
    "get_next_low_latency_combine_buffer": [("handle", EMPTY)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", EMPTY), ("hidden", EMPTY),
                                 ("num_experts", EMPTY)],
}


@pytest.mark.parametrize("method", sorted(DEEPEP_SIGNATURES))
def test_methods_take_deepeps_arguments_in_deepeps_order(method):
    params = list(inspect.signature(getattr(Buffer, method)).parameters.values())
    assert params[0].name == "self"
    positional = [(p.name, p.default) for p in params[1:] if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == DEEPEP_SIGNATURES[method]
    others = [(p.name, p.kind, p.default) for p in params[1:] if p.kind is not p.POSITIONAL_OR_KEYWORD]
    # Ours, after DeepEP's and by keyword only: code written for DeepEP never meets it.
    assert others == ([("topk_weights", inspect.Parameter.KEYWORD_ONLY, None)]
                      if method == "low_latency_dispatch" else [])


@pytest.mark.parametrize("method, args, fork_arg", [
    ("low_latency_dispatch", 4, "use_nvfp4"),
    ("low_latency_dispatch", 4, "x_global_scale"),
    ("low_latency_combine", 4, "overlap"),
    ("low_latency_combine", 4, "comp_signal"),
])
def test_arguments_of_deepep_forks_raise_type_error_naming_them(method, args, fork_arg):
    buffer = Buffer.__new__(Buffer)  # the arguments are refused before the buffer is read
    with pytest.raises(TypeError, match=fork_arg):
        getattr(buffer, method)(*([None] * args), **{fork_arg: True})


# -- sizes -------------------------------------------------------------------------------------------------------

GRID = [(m, h, r, e) for m in (1, 128, 1024) for h in (128, 2048, 7168) for r in (2, 4, 8) for e in (8 * r, 256)
        if e % r == 0]


@pytest.mark.parametrize("m, h, r, e", GRID)
def test_size_hint_covers_every_topk(m, h, r, e):
    hint = Buffer.get_low_latency_rdma_size_hint(m, h, r, e)
    needs = [_C.low_latency_required_bytes(m, h, r, k) for k in range(1, ll.MAX_TOPK + 1)]
    assert all(n <= hint for n in needs), f"hint {hint} < needs {needs}"
    assert needs == sorted(needs), "more top-k never needs fewer bytes"


def test_size_hint_grows_with_tokens_and_hidden():
    by_tokens = [Buffer.get_low_latency_rdma_size_hint(m, 7168, 8, 256) for m in (1, 64, 128, 512, 1024)]
    assert by_tokens == sorted(set(by_tokens)), by_tokens
    by_hidden = [Buffer.get_low_latency_rdma_size_hint(128, h, 8, 256) for h in (128, 1024, 4096, 7168, 16384)]
    assert by_hidden == sorted(set(by_hidden)), by_hidden
    # A row of 7168 bf16 per (rank, token) slot twice over is a floor no layout goes under.
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) >= 2 * 8 * 128 * 7168 * 2


@pytest.mark.parametrize("m, r, e", [(1, 1, 1), (128, 8, 256), (1024, 8, 1024), (64, 4, 32), (7, 3, 9)])
def test_plan_bytes_hold_the_plan_and_stay_aligned(m, r, e):
    plan = _C.low_latency_plan_bytes(m, r, e)
    local = e // r
    # Header, counts per expert and per source, and per (source, token) an entry count plus per top-k
    # entry its row, its slots (two bytes) and its weight.
    floor = 32 + 4 * local + 4 * r + 4 * r * m + (4 + 2 + 4) * r * m * ll.MAX_TOPK
    assert plan >= floor and plan % 16 == 0
    # Bounded too: no more than the parts each rounded up to 128 bytes.
    assert plan <= floor + 7 * 128


def test_plan_bytes_grow_with_tokens_ranks_and_experts():
    assert _C.low_latency_plan_bytes(128, 8, 256) > _C.low_latency_plan_bytes(64, 8, 256)
    assert _C.low_latency_plan_bytes(128, 8, 256) > _C.low_latency_plan_bytes(128, 4, 256)
    assert _C.low_latency_plan_bytes(128, 8, 512) > _C.low_latency_plan_bytes(128, 8, 256)


@pytest.mark.parametrize("m, h, r", [(1, 8, 1), (32, 2880, 8), (128, 7168, 4), (1024, 16384, 2)])
def test_region_offsets_lie_in_the_region_and_apart(m, h, r):
    o = _C.low_latency_region_offsets(m, h, r)
    total = _C.low_latency_required_bytes(m, h, r, ll.MAX_TOPK)
    areas = [(o["dispatch_slots"][p], r * m * o["message_bytes"]) for p in (0, 1)]
    areas += [(o["weights"][p], r * m * ll.MAX_TOPK * 8) for p in (0, 1)]
    # A slot holds a 144-byte header and a bf16 row; every area in the region, none over another.
    assert o["message_bytes"] >= 144 + 2 * h
    areas.sort()
    assert areas[0][0] > 0 and areas[-1][0] + areas[-1][1] <= total, (areas, total)
    for (a, size), (b, _) in zip(areas, areas[1:]):
        assert a + size <= b, areas


@pytest.mark.parametrize("fn, args, name", [
    (_C.low_latency_region_offsets, (0, 7168, 8), "num_max_tokens"),
    (_C.low_latency_region_offsets, (128, 100, 8), "hidden"),
    (_C.low_latency_region_offsets, (128, 7168, 0), "num_ranks"),
    (_C.low_latency_plan_bytes, (128, 0, 256), "num_ranks"),
    (_C.low_latency_plan_bytes, (128, 2048, 2048), "num_ranks"),  # more ranks than experts can ever be
    (_C.low_latency_plan_bytes, (0, 8, 256), "num_max_tokens"),
    (_C.low_latency_plan_bytes, (128, 8, 100), "num_experts"),
    (_C.low_latency_plan_bytes, (128, 8, 2048), "num_experts"),
    (_C.low_latency_required_bytes, (128, 7168, 8, 0), "num_topk"),
    (_C.low_latency_required_bytes, (128, 7168, 8, 17), "num_topk"),
    (_C.low_latency_required_bytes, (128, 100, 8, 8), "hidden"),
    (_C.low_latency_required_bytes, (1025, 7168, 8, 8), "num_max_tokens"),
])
def test_size_functions_refuse_what_no_call_can_use(fn, args, name):
    with pytest.raises(ValueError, match=name):
        fn(*args)


# -- construction ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_low_latency_arguments_pass_their_checks():
    hint = Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    with pytest.raises(RuntimeError, match="CUDA"):
        Buffer(object(), num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=12,
               allow_nvlink_for_low_latency_mode=False)


# -- the Python layer over a stand-in native buffer --------------------------------------------------------------

@pytest.fixture(autouse=True)
def caller_stream(monkeypatch):
    """The caller's stream as the ops read it; tests change it through the list."""
    return patch_streams(monkeypatch)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "ue8m0"])
@pytest.mark.parametrize("hidden", [640, 7168])
def test_dispatch_outputs_have_deepeps_shapes_and_layouts(fmt, hidden):
    context = make_context()
    x, topk_idx = inputs(hidden=hidden)
    recv_x, recv_count, handle, event, hook = dispatch(context, x, topk_idx, use_fp8=fmt != "bf16",
                                                       round_scale=fmt == "ue8m0", use_ue8m0=fmt == "ue8m0")
    local, rows = E // R, M * R
    if fmt == "bf16":
        assert isinstance(recv_x, torch.Tensor) and recv_x.dtype == torch.bfloat16
        data = recv_x
    else:
        data, scales = recv_x
        assert data.dtype == torch.float8_e4m3fn
        groups = hidden // 128 if fmt == "fp8" else -(-hidden // 512)
        assert scales.dtype == (torch.float32 if fmt == "fp8" else torch.int32)
        assert scales.shape == (local, rows, groups)
        assert scales.stride() == (rows * groups, 1, rows), "scales must be column-major in their last two dims"
    assert data.shape == (local, rows, hidden) and data.is_contiguous()
    assert recv_count.dtype == torch.int32 and recv_count.shape == (local,)
    assert event.event is None and hook is None

    src_info, layout_range, max_tokens, handle_hidden, experts = handle
    assert (max_tokens, handle_hidden, experts) == (M, hidden, E)
    assert src_info.dtype == torch.int32 and src_info.shape == (local, rows)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (local, R)
    assert handle.plan.dtype == torch.uint8 and handle.plan.numel() == _C.low_latency_plan_bytes(M, R, E)
    assert (handle.num_tokens, handle.num_topk, handle.has_weights, handle.generation) == (T, K, False, 0)

    (method, call), = context.native.calls
    assert method == "low_latency_dispatch"
    args = call["outputs"]
    assert (args.hidden, args.num_max_tokens, args.num_experts) == (hidden, M, E)
    assert (args.use_fp8, args.use_ue8m0) == (fmt != "bf16", fmt == "ue8m0")
    assert call["x"] == x.data_ptr() and call["topk_idx"] == topk_idx.data_ptr()
    assert (call["num_tokens"], call["num_topk"], call["topk_weights"]) == (T, K, 0)
    assert call["round_scale"] == (fmt == "ue8m0")
    assert (call["phase"], call["stream"], call["wait_for"]) == (_C.LOW_LATENCY_SEND_AND_RECEIVE, CALLER_STREAM, None)


def test_outputs_alternate_between_two_sets_and_are_allocated_once(monkeypatch):
    context = make_context()
    x, topk_idx = inputs()
    first = [dispatch(context, x, topk_idx) for _ in range(2)]
    assert first[0][0][0].data_ptr() != first[1][0][0].data_ptr()

    made = []
    real_empty, real_zeros = torch.empty, torch.zeros
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: made.append(a) or real_zeros(*a, **k))
    later = [dispatch(context, x, topk_idx) for _ in range(4)]
    assert made == [], "a dispatch of a shape seen before must allocate nothing"
    for i, (recv_x, recv_count, handle, _, _) in enumerate(later):
        earlier = first[i % 2]
        assert recv_x[0] is earlier[0][0] and recv_x[1] is earlier[0][1] and recv_count is earlier[1]
        assert handle[0] is earlier[2][0] and handle.plan is earlier[2].plan
        assert handle.generation == i + 2

    # Another format of the same shape has sets of its own.
    bf16 = dispatch(context, x, topk_idx, use_fp8=False)
    assert len(made) > 0 and bf16[0].data_ptr() not in {f[0][0].data_ptr() for f in first}


def test_combine_refuses_a_handle_whose_outputs_were_reused():
    context = make_context()
    x, topk_idx = inputs()
    weights = torch.rand(T, K)
    handles = [dispatch(context, x, topk_idx)[2] for _ in range(3)]
    y = expert_rows(context)
    with pytest.raises(ValueError, match=r"handle must be from one of the two latest .* dispatch 0 .* dispatch 2"):
        combine(context, y, topk_idx, weights, handles[0])
    with pytest.raises(ValueError, match="handle"):
        ll.get_next_combine_buffer(context, handles[0])
    calls = len(context.native.calls)
    for handle in handles[1:]:
        combined_x, event, hook = combine(context, y, topk_idx, weights, handle)
        assert combined_x.shape == (T, H) and combined_x.dtype == torch.bfloat16
    assert len(context.native.calls) == calls + 2


def test_combine_refuses_handles_of_other_buffers_and_other_objects():
    mine, theirs = make_context(), make_context()
    x, topk_idx = inputs()
    handle = dispatch(theirs, x, topk_idx)[2]
    y, weights = expert_rows(mine), torch.rand(T, K)
    with pytest.raises(ValueError, match="handle must be from a low_latency_dispatch of this buffer"):
        combine(mine, y, topk_idx, weights, handle)
    with pytest.raises(TypeError, match="handle"):
        combine(mine, y, topk_idx, weights, tuple(handle))
    assert mine.native.calls == []


def test_combine_passes_the_handle_and_its_inputs():
    context = make_context()
    x, topk_idx = inputs()
    handle = dispatch(context, x, topk_idx)[2]
    y, weights, out = expert_rows(context), torch.rand(T, K), torch.empty(T, H, dtype=torch.bfloat16)
    wait = torch.zeros(R, dtype=torch.int64)
    combined_x, event, hook = combine(context, y, topk_idx, weights, handle, use_logfmt=True, out=out, wait=wait)
    assert combined_x is out and event.event is None and hook is None
    method, call = context.native.calls[-1]
    assert method == "low_latency_combine"
    assert call == {"x": y.data_ptr(), "num_tokens": T, "num_topk": K, "hidden": H, "num_max_tokens": M,
                    "num_experts": E, "topk_idx": topk_idx.data_ptr(), "topk_weights": weights.data_ptr(),
                    "plan": handle.plan.data_ptr(), "use_logfmt": True, "out": out.data_ptr(),
                    "wait_recv_cost_stats": wait.data_ptr(), "phase": _C.LOW_LATENCY_SEND_AND_RECEIVE,
                    "stream": CALLER_STREAM, "wait_for": None, "ring": None}


def test_zero_copy_sends_from_the_combine_buffer_of_the_handles_parity():
    context = make_context()
    x, topk_idx = inputs()
    handles = [dispatch(context, x, topk_idx)[2] for _ in range(2)]
    weights = torch.rand(T, K)
    with pytest.raises(ValueError, match="zero_copy"):
        combine(context, expert_rows(context), topk_idx, weights, handles[0], zero_copy=True)
    buffers = [ll.get_next_combine_buffer(context, h) for h in handles]
    assert buffers[0].shape == (E // R, M * R, H) and buffers[0].dtype == torch.bfloat16
    assert buffers[0].data_ptr() != buffers[1].data_ptr()
    assert ll.get_next_combine_buffer(context, handles[1]) is buffers[1]
    third = dispatch(context, x, topk_idx)[2]
    assert ll.get_next_combine_buffer(context, third) is buffers[0]
    combine(context, buffers[1], topk_idx, weights, handles[1], zero_copy=True)
    assert context.native.calls[-1][1]["x"] == buffers[1].data_ptr()
    # x need not be the buffer: what is sent is the buffer's contents.
    combine(context, expert_rows(context), topk_idx, weights, third, zero_copy=True)
    assert context.native.calls[-1][1]["x"] == buffers[0].data_ptr()


def test_dispatch_weights_reach_the_plan_even_without_tokens():
    context = make_context()
    x, topk_idx = inputs()
    weights = torch.rand(T, K)
    handle = dispatch(context, x, topk_idx, topk_weights=weights)[2]
    assert handle.has_weights and context.native.calls[-1][1]["topk_weights"] == weights.data_ptr()
    x0, idx0 = inputs(tokens=0)
    handle = dispatch(context, x0, idx0, topk_weights=torch.empty(0, K))[2]
    assert handle.has_weights and handle.num_tokens == 0
    assert context.native.calls[-1][1]["topk_weights"] != 0, "peers learn of the weights by a non-null address"


def test_receive_hook_launches_once_on_the_stream_current_then(caller_stream):
    context = make_context()
    x, topk_idx = inputs()
    _, _, handle, event, hook = dispatch(context, x, topk_idx, return_recv_hook=True)
    assert event.event is None and callable(hook)
    (_, send), = context.native.calls
    assert (send["phase"], send["stream"]) == (_C.LOW_LATENCY_SEND, CALLER_STREAM)
    alive = weakref.ref(x)
    del x
    assert alive() is not None, "the hook keeps the call's tensors"
    caller_stream[0] = 0x3000
    hook()
    # On another stream than the send's, the receive first waits for it.
    assert context.native.calls[1] == ("follow", {"waiter": 0x3000, "waited": CALLER_STREAM})
    _, receive = context.native.calls[-1]
    assert (receive["phase"], receive["stream"], receive["wait_for"]) == (_C.LOW_LATENCY_RECEIVE, 0x3000, None)
    assert {k: v for k, v in receive.items() if k not in ("phase", "stream")} == \
        {k: v for k, v in send.items() if k not in ("phase", "stream")}
    with pytest.raises(RuntimeError, match="already called"):
        hook()
    assert len(context.native.calls) == 3 and context.tail == 0x3000

    y, weights = expert_rows(context), torch.rand(T, K)
    combined_x, _, hook = combine(context, y, topk_idx, weights, handle, return_recv_hook=True)
    assert context.native.calls[-1][1]["phase"] == _C.LOW_LATENCY_SEND
    hook()
    assert context.native.calls[-1][1]["phase"] == _C.LOW_LATENCY_RECEIVE
    assert context.native.calls[-1][1]["out"] == combined_x.data_ptr()


def test_an_op_on_the_callers_stream_first_waits_for_an_async_one():
    context = make_context()
    x, topk_idx = inputs()
    dispatch(context, x, topk_idx, async_finish=True)
    assert context.tail == COMM_STREAM
    dispatch(context, x, topk_idx)
    assert context.native.calls[-2] == ("follow", {"waiter": CALLER_STREAM, "waited": COMM_STREAM})
    assert context.native.calls[-1][1]["wait_for"] is None and context.tail == CALLER_STREAM
    dispatch(context, x, topk_idx)
    assert [m for m, _ in context.native.calls].count("follow") == 1


def test_an_op_on_another_stream_first_waits_for_the_last_ones(caller_stream):
    context = make_context()
    x, topk_idx = inputs()
    dispatch(context, x, topk_idx)
    assert [m for m, _ in context.native.calls] == ["low_latency_dispatch"], "nothing ran before: no wait"
    caller_stream[0] = 0x3000
    dispatch(context, x, topk_idx)
    assert context.native.calls[-2] == ("follow", {"waiter": 0x3000, "waited": CALLER_STREAM})
    # An async op issued on a third stream: the communication stream waits for both.
    caller_stream[0] = 0x4000
    dispatch(context, x, topk_idx, async_finish=True)
    assert context.native.calls[-2] == ("follow", {"waiter": COMM_STREAM, "waited": 0x3000})
    assert context.native.calls[-1][1]["wait_for"] == 0x4000 and context.tail == COMM_STREAM


# -- async_finish: the ring's events and the pending calls -------------------------------------------------------

def test_async_finish_runs_on_the_comm_stream_and_returns_the_rings_event():
    context = make_context()
    state, ring = context.low_latency, context.low_latency.ring
    x, topk_idx = inputs()
    _, _, handle, event, hook = dispatch(context, x, topk_idx, async_finish=True)
    assert hook is None and event.event is ring.events[0]
    method, call = context.native.calls[-1]
    assert method == "low_latency_dispatch"
    assert (call["phase"], call["stream"], call["wait_for"], call["ring"]) == \
        (_C.LOW_LATENCY_SEND_AND_RECEIVE, COMM_STREAM, CALLER_STREAM, ring)
    assert ring.records == [(ring.events[0], COMM_STREAM)] and context.tail == COMM_STREAM
    (pending_event, tensors), = state.pending
    assert pending_event is ring.events[0] and tensors[0] is x and tensors[1] is topk_idx
    assert event.extra_tensors is tensors

    y, weights = expert_rows(context), torch.rand(T, K)
    combined_x, event, hook = combine(context, y, topk_idx, weights, handle, async_finish=True)
    assert hook is None and event.event is ring.events[1]
    assert context.native.calls[-1][1]["ring"] is ring and context.native.calls[-1][1]["stream"] == COMM_STREAM
    assert [e for e, _ in state.pending] == ring.events[:2]
    assert any(t is combined_x for t in state.pending[1][1]), "combine's output must live until its event"
    # Not async: no ring, no event, nothing pending added; it waits for the comm stream first.
    dispatch(context, x, topk_idx)
    call = context.native.calls[-1][1]
    assert (call["ring"], call["wait_for"]) == (None, None) and len(state.pending) == 2
    assert context.native.calls[-2] == ("follow", {"waiter": CALLER_STREAM, "waited": COMM_STREAM})


def async_call_holding(context, tokens):
    """An async_finish dispatch of fresh inputs; returns a weak reference to its x."""
    x, topk_idx = inputs(tokens=tokens)
    dispatch(context, x, topk_idx, async_finish=True)
    return weakref.ref(x)


def test_pending_calls_are_released_oldest_first_once_their_event_completed():
    context = make_context()
    context.low_latency.ring = FakeRing(size=16)
    state, events, every = context.low_latency, context.low_latency.ring.events, ll.RELEASE_EVERY
    xs = []

    def calls(n):
        xs.extend(async_call_holding(context, 1 + len(xs) % M) for _ in range(n))

    calls(every)
    assert all(x() is not None for x in xs), "the pending calls keep their inputs"
    assert all(e.queries == 0 for e in events), "no query before the queue holds RELEASE_EVERY calls"
    events[1].done = True  # completed, but behind an older call that has not
    calls(1)
    assert [e.queries for e in events[:3]] == [1, 0, 0], "the oldest pending call is asked, and only it"
    assert [e for e, _ in state.pending] == events[:every + 1] and all(x() is not None for x in xs)
    events[0].done = True
    calls(every - 1)
    assert events[0].queries == 1 and xs[0]() is not None, "asked again only at the next multiple"
    calls(1)
    assert [e for e, _ in state.pending] == events[2:2 * every + 1]
    assert (xs[0](), xs[1]()) == (None, None), "the two completed calls are released, oldest first"
    assert all(x() is not None for x in xs[2:])
    calls(-len(state.pending) % every)
    for e in events:
        e.done = True
    calls(1)
    newest = events[len(xs) - 1]
    assert [e for e, _ in state.pending] == [newest] and all(x() is None for x in xs[:-1])
    # Calls on the caller's stream do not query: the pending call stays until the next async one.
    newest.done = True
    queries = newest.queries
    dispatch(context, *inputs())
    assert newest.queries == queries and len(state.pending) == 1


def test_a_wrapped_ring_event_holds_both_calls_until_the_later_one_completed():
    context = make_context()
    context.low_latency.ring = ring = FakeRing(size=2)
    state = context.low_latency
    xs = [async_call_holding(context, t) for t in (1, 2, 3)]  # the third re-records the first's event
    assert [e for e, _ in state.pending] == [ring.events[0], ring.events[1], ring.events[0]]
    ring.events[1].done = True
    xs += [async_call_holding(context, t) for t in range(4, ll.RELEASE_EVERY + 2)]  # events[1] recorded again
    assert ring.events[0].queries == 1, "the oldest pending event was asked"
    assert len(state.pending) == ll.RELEASE_EVERY + 1 and all(x() is not None for x in xs)


def test_destroy_releases_the_pending_calls_after_the_native_buffer():
    context = make_context()
    buf = Buffer.__new__(Buffer)
    buf._native, buf._context, buf.explicitly_destroy = context.native, context, True
    xs = [async_call_holding(context, t) for t in (1, 2)]
    buf.destroy()
    assert context.native.calls[-1] == ("destroy", {})
    assert not context.low_latency.pending and all(x() is None for x in xs)
    with pytest.raises(RuntimeError, match="destroyed"):
        dispatch(context, *inputs(), async_finish=True)


def test_a_collected_state_waits_for_its_newest_pending_call_first():
    """A Buffer collected without destroy(): its low-latency state goes before
    the native buffer, so it waits on the host for the GPU to be done with
    what its pending calls hold."""
    context = make_context()
    events = context.low_latency.ring.events
    every = ll.RELEASE_EVERY
    xs = [async_call_holding(context, t) for t in range(1, every + 1)]
    events[0].done = True
    async_call_holding(context, every + 1)  # releases the first call
    assert len(context.low_latency.pending) == every
    context.low_latency = None
    assert [e.synchronized for e in events[:every + 1]] == [0] * every + [1], \
        "only the newest pending event is waited for"
    assert all(x() is None for x in xs)
    # After destroy (release) nothing is pending: collecting the state waits for nothing.
    destroyed = make_context()
    events = destroyed.low_latency.ring.events
    async_call_holding(destroyed, 1)
    destroyed.low_latency.release()
    destroyed.low_latency = None
    assert events[0].synchronized == 0


def test_an_async_launch_that_raises_joins_the_callers_stream_back():
    context = make_context()
    x, topk_idx = inputs()
    context.native.fail_next = RuntimeError("raised after the launch")
    with pytest.raises(RuntimeError, match="raised after the launch"):
        dispatch(context, x, topk_idx, async_finish=True)
    assert context.native.calls[-1] == ("join", {"waiter": CALLER_STREAM, "waited": COMM_STREAM})
    assert not context.low_latency.pending


def test_an_async_call_inside_a_graph_capture_neither_queries_nor_queues(monkeypatch):
    context = make_context()
    state, events, every = context.low_latency, context.low_latency.ring.events, ll.RELEASE_EVERY
    for t in range(1, every + 1):
        async_call_holding(context, t)  # the next call would ask the oldest
    state.ring.captured = True
    x, topk_idx = inputs(tokens=every + 1)
    event = dispatch(context, x, topk_idx, async_finish=True)[3]
    assert event.event is events[every] and event.extra_tensors[0] is x, "the EventOverlap keeps the tensors"
    assert events[0].queries == 0 and [e for e, _ in state.pending] == events[:every]


def test_an_async_call_in_a_capture_leaves_the_eager_tail():
    """A captured async call is no step of the eager order: the tail stays the
    stream of the last eager op; an eager one makes it the comm stream."""
    context = make_context()
    context.tail = 0x3000
    context.low_latency.ring.captured = True
    dispatch(context, *inputs(), async_finish=True)
    assert ("follow", {"waiter": COMM_STREAM, "waited": 0x3000}) in context.native.calls
    assert context.tail == 0x3000
    context.low_latency.ring.captured = False
    dispatch(context, *inputs(), async_finish=True)
    assert context.tail == COMM_STREAM


def test_an_async_launch_that_raises_leaves_the_callers_stream_the_tail():
    context = make_context()
    context.tail = 0x3000
    context.native.fail_next = RuntimeError("raised after the launch")
    with pytest.raises(RuntimeError, match="raised after the launch"):
        dispatch(context, *inputs(), async_finish=True)
    assert context.native.calls[-1] == ("join", {"waiter": CALLER_STREAM, "waited": COMM_STREAM})
    assert context.tail == CALLER_STREAM


def test_previous_event_may_be_a_low_latency_event():
    """A normal op after an async_finish low-latency one: the communication
    stream waits for the native event by its raw handle."""
    context = make_context()
    event = dispatch(context, *inputs(), async_finish=True)[3]
    streams = ops_streams.OpStreams(context, "get_dispatch_layout", event, False, False)
    assert event.event.waits == [COMM_STREAM] and streams.wait_for is None
    assert streams.join_to == CALLER_STREAM


def test_event_overlap_waits_for_a_low_latency_event_on_the_current_stream(caller_stream):
    context = make_context()
    event = dispatch(context, *inputs(), async_finish=True)[3]
    caller_stream[0] = 0x3000
    event.current_stream_wait()
    with event as entered:
        assert entered is event
    assert event.event.waits == [0x3000, 0x3000]


def test_clean_runs_on_the_comm_stream_joined_both_ways():
    context = make_context()
    context.tail = COMM_STREAM  # as an async_finish op leaves it
    ll.clean(context, M, H, E)
    method, call = context.native.calls[-1]
    assert method == "clean_low_latency_buffer"
    assert call == {"stream": COMM_STREAM, "wait_for": CALLER_STREAM, "join_to": CALLER_STREAM, "first_call": 1}
    assert context.tail == CALLER_STREAM
    # After an op on another stream it waits for that stream too.
    context.tail = 0x3000
    ll.clean(context, M, H, E)
    assert context.native.calls[-2] == ("follow", {"waiter": COMM_STREAM, "waited": 0x3000})
    for args, name in [((0, H, E), "num_max_dispatch_tokens_per_rank"), ((M, 100, E), "hidden"),
                       ((M, H, 10), "num_experts")]:
        with pytest.raises(ValueError, match=name):
            ll.clean(context, *args)


def test_clean_can_restart_the_call_numbers_far_from_one():
    """A test of the 32-bit tags' wrap starts the calls just below 2^32: the
    number reaches the module as given; below 1 or above 64 bits it raises."""
    context = make_context()
    ll.clean(context, M, H, E, first_call=2**32 - 3)
    assert context.native.calls[-1][1]["first_call"] == 2**32 - 3
    for bad in (0, -1, 2**64):
        with pytest.raises(ValueError, match="first_call"):
            ll.clean(context, M, H, E, first_call=bad)
    with pytest.raises(TypeError, match="first_call"):
        ll.clean(context, M, H, E, first_call=1.5)


def test_calls_on_a_buffer_without_low_latency_mode_say_so():
    context = make_context(low_latency_mode=False)
    x, topk_idx = inputs()
    with pytest.raises(ValueError, match="low_latency_mode=True"):
        dispatch(context, x, topk_idx)
    with pytest.raises(ValueError, match="low_latency_mode=True"):
        ll.clean(context, M, H, E)
    assert context.native.calls == []


def test_calls_after_destroy_raise():
    context = make_context()
    x, topk_idx = inputs()
    handle = dispatch(context, x, topk_idx)[2]
    context.low_latency.release()
    with pytest.raises(RuntimeError, match="destroyed"):
        dispatch(context, x, topk_idx)
    with pytest.raises(RuntimeError, match="destroyed"):
        combine(context, expert_rows(context), topk_idx, torch.rand(T, K), handle)


def misaligned(tokens, hidden):
    flat = torch.zeros(tokens * hidden + 8, dtype=torch.bfloat16)
    return flat[1:1 + tokens * hidden].view(tokens, hidden)


def dispatch_case(**changes):
    """Dispatch arguments (as keyword arguments of ``dispatch`` above) with ``changes``."""
    x, topk_idx = inputs()
    return {"x": x, "topk_idx": topk_idx, **changes}


DISPATCH_ERRORS = [
    (dict(x=torch.randn(T, H)), TypeError, "x must be of dtype torch.bfloat16"),
    (dict(x=torch.randn(1, T, H).bfloat16()), ValueError, "x must be 2-D"),
    (dict(x=torch.randn(H, T).bfloat16().t()), ValueError, "x must be contiguous"),
    (dict(x=torch.empty(T, H, dtype=torch.bfloat16, device="meta")), ValueError, "x must be on cpu"),
    (dict(x=misaligned(T, H)), ValueError, "x must be starting at a 16-byte aligned address"),
    (dict(max_tokens=T - 1), ValueError, "x must be of at most num_max_dispatch_tokens_per_rank=4 rows"),
    (dict(x=torch.randn(M + 1, H).bfloat16(), topk_idx=torch.zeros(M + 1, K, dtype=torch.int64)), ValueError,
     "x must be of at most num_max_dispatch_tokens_per_rank=8 rows"),
    (dict(max_tokens=0), ValueError, "num_max_dispatch_tokens_per_rank must be >= 1"),
    (dict(max_tokens=1025), ValueError, "num_max_dispatch_tokens_per_rank must be <= 1024"),
    (dict(max_tokens=8.0), TypeError, "num_max_dispatch_tokens_per_rank must be an int"),
    (dict(x=torch.randn(T, 200).bfloat16()), ValueError, r"x must be of a hidden size that is a multiple of 128"),
    (dict(x=torch.randn(T, 100).bfloat16(), use_fp8=False), ValueError, "x must be of a hidden size .* of 8"),
    (dict(x=torch.randn(T, 16392).bfloat16(), use_fp8=False), ValueError, r"x must be .* in \[8, 16384\]"),
    (dict(topk_idx=torch.zeros(T, K, dtype=torch.int32)), TypeError, "topk_idx must be of dtype torch.int64"),
    (dict(topk_idx=torch.zeros(T + 1, K, dtype=torch.int64)), ValueError, r"topk_idx must be of shape \(5, k\)"),
    (dict(topk_idx=torch.zeros(T, 0, dtype=torch.int64)), ValueError, r"topk_idx .* k in \[1, 16\]"),
    (dict(topk_idx=torch.zeros(T, 17, dtype=torch.int64)), ValueError, r"topk_idx .* k in \[1, 16\]"),
    (dict(topk_idx=torch.zeros(T * K, dtype=torch.int64)), ValueError, "topk_idx must be 2-D"),
    (dict(experts=18), ValueError, "num_experts must be a multiple of the group size 4"),
    (dict(experts=1028), ValueError, "num_experts must be <= 1024"),
    (dict(experts=0), ValueError, "num_experts must be >= 4"),
    (dict(use_ue8m0=True), ValueError, "use_ue8m0 must be used with round_scale=True"),
    (dict(async_finish=True, return_recv_hook=True), ValueError, "return_recv_hook must be False with async_finish"),
    (dict(topk_weights=torch.rand(T, K + 1)), ValueError, r"topk_weights must be of shape \(5, 3\)"),
    (dict(topk_weights=torch.rand(T, K).double()), TypeError, "topk_weights must be of dtype torch.float32"),
    (dict(cumulative=torch.zeros(E // R, dtype=torch.int64)), TypeError,
     "cumulative_local_expert_recv_stats must be of dtype torch.int32"),
    (dict(cumulative=torch.zeros(E, dtype=torch.int32)), ValueError,
     r"cumulative_local_expert_recv_stats must be of shape \(4,\)"),
    (dict(wait=torch.zeros(R, dtype=torch.int32)), TypeError, "dispatch_wait_recv_cost_stats must be of dtype "
     "torch.int64"),
    (dict(wait=torch.zeros(R + 1, dtype=torch.int64)), ValueError, r"dispatch_wait_recv_cost_stats must be of shape"),
]


# The stand-in's CPU tensors are on the context's "GPU" when its device index
# is -1 (their get_device()): the ops then take their fast paths, which must
# refuse what the full checks refuse, with the same message. Index 0 sends
# every call to the full checks.
FAST, FULL = -1, 0
PATHS = pytest.mark.parametrize("device_index", [FAST, FULL], ids=["fast path", "full checks"])


def skip_meta_on_fast_path(changes, device_index):
    # A meta tensor's get_device() is -1 too: on a GPU no index matches it.
    if device_index == FAST and any(getattr(v, "is_meta", False) for v in changes.values()):
        pytest.skip("a meta tensor reads as on device -1")


@PATHS
@pytest.mark.parametrize("changes, kind, message", DISPATCH_ERRORS)
def test_bad_dispatch_arguments_raise_naming_them_and_launch_nothing(changes, kind, message, device_index):
    skip_meta_on_fast_path(changes, device_index)
    context = make_context(device_index=device_index)
    # Twice: the shape is known and its checks passed when the bad call comes.
    dispatch(context, *inputs())
    good = dispatch(context, *inputs())[2]
    with pytest.raises(kind, match=f"^low_latency_dispatch: {message}"):
        dispatch(context, **dispatch_case(**changes))
    assert len(context.native.calls) == 2
    assert good.generation == good._info[0].generation, "a refused call must not take an output set"


def test_good_stats_tensors_are_passed():
    context = make_context()
    cumulative, wait = torch.zeros(E // R, dtype=torch.int32), torch.zeros(R, dtype=torch.int64)
    dispatch(context, *inputs(), cumulative=cumulative, wait=wait)
    call = context.native.calls[-1][1]
    assert (call["cumulative_local_expert_recv_stats"], call["wait_recv_cost_stats"]) == \
        (cumulative.data_ptr(), wait.data_ptr())


COMBINE_ERRORS = [
    (dict(x=torch.zeros(E // R, M * R, H)), TypeError, "x must be of dtype torch.bfloat16"),
    (dict(x=torch.zeros(E // R, M * R + 1, H, dtype=torch.bfloat16)), ValueError, r"x must be of shape \(4, 32, 256\)"),
    (dict(topk_idx=torch.zeros(T, K + 1, dtype=torch.int64)), ValueError, r"topk_idx must be of shape \(5, 3\)"),
    (dict(topk_weights=None), TypeError, "topk_weights must be a torch.Tensor"),
    (dict(topk_weights=torch.rand(T - 1, K)), ValueError, r"topk_weights must be of shape \(5, 3\)"),
    (dict(out=torch.empty(T, H)), TypeError, "out must be of dtype torch.bfloat16"),
    (dict(out=torch.empty(T, H + 8, dtype=torch.bfloat16)), ValueError, r"out must be of shape \(5, 256\)"),
    (dict(out=misaligned(T, H)), ValueError, "out must be starting at a 16-byte aligned address"),
    (dict(wait=torch.zeros(R)), TypeError, "combine_wait_recv_cost_stats must be of dtype torch.int64"),
    (dict(async_finish=True, return_recv_hook=True), ValueError, "return_recv_hook must be False"),
]


@PATHS
@pytest.mark.parametrize("changes, kind, message", COMBINE_ERRORS)
def test_bad_combine_arguments_raise_naming_them_and_launch_nothing(changes, kind, message, device_index):
    context = make_context(device_index=device_index)
    x, topk_idx = inputs()
    handle = dispatch(context, x, topk_idx)[2]
    combine(context, expert_rows(context), topk_idx, torch.rand(T, K), handle)
    args = {"x": expert_rows(context), "topk_idx": topk_idx, "topk_weights": torch.rand(T, K), **changes}
    with pytest.raises(kind, match=f"^low_latency_combine: {message}"):
        combine(context, args.pop("x"), args.pop("topk_idx"), args.pop("topk_weights"), handle, **args)
    assert len(context.native.calls) == 2


def test_known_shapes_and_plain_tensors_skip_the_full_checks(monkeypatch):
    context = make_context(device_index=FAST)
    x, topk_idx = inputs()
    weights, stats = torch.rand(T, K), torch.zeros(E // R, dtype=torch.int32)
    handle = dispatch(context, x, topk_idx, topk_weights=weights, cumulative=stats)[2]

    def full_check(*args, **kwargs):
        raise AssertionError("the full check ran")

    for name in ("check_tensor", "check_int", "_check_dispatch_shape", "_check_combine_tensors", "_check_handle"):
        monkeypatch.setattr(ll, name, full_check)
    handle = dispatch(context, x, topk_idx, topk_weights=weights, cumulative=stats)[2]
    combine(context, expert_rows(context), topk_idx, weights, handle)
    assert [method for method, _ in context.native.calls] == ["low_latency_dispatch"] * 2 + ["low_latency_combine"]


class SubclassTensor(torch.Tensor):
    pass


@pytest.mark.parametrize("wrap", [lambda t: torch.nn.Parameter(t, requires_grad=False),
                                  lambda t: t.as_subclass(SubclassTensor)], ids=["Parameter", "subclass"])
def test_tensor_subclasses_pass_the_full_checks(wrap):
    context = make_context(device_index=FAST)
    x, topk_idx = inputs()
    dispatch(context, x, topk_idx)
    handle = dispatch(context, wrap(x), wrap(topk_idx))[2]
    combine(context, wrap(expert_rows(context)), wrap(topk_idx), wrap(torch.rand(T, K)), handle)
    assert [method for method, _ in context.native.calls] == ["low_latency_dispatch"] * 2 + ["low_latency_combine"]


def test_logfmt_needs_hidden_in_groups_of_128():
    context = make_context()
    x, topk_idx = inputs(hidden=200)
    handle = dispatch(context, x, topk_idx, use_fp8=False)[2]
    with pytest.raises(ValueError, match="use_logfmt"):
        combine(context, expert_rows(context, hidden=200), topk_idx, torch.rand(T, K), handle, use_logfmt=True)
    combine(context, expert_rows(context, hidden=200), topk_idx, torch.rand(T, K), handle)
    assert context.native.calls[-1][1]["use_logfmt"] is False
