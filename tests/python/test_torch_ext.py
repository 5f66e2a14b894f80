"""The common intranode dispatch and combine, each in one call
(turnout._torch_ext's dispatch_worst and combine_plain), without a GPU: CPU
tensors stand for the buffer's device (index -1, their get_device()), and a
recording entry, built with ctypes as a mirror of
python/ext/intranode_entry.hpp, stands for _C's launch. Each call hands the
entry exactly the tensors it returns and the scalars of the call; every call
that is not the common case is declined before the entry is reached; and the
ops take these paths only where they may."""
import pytest
import torch
from test_normal_checks import FAST, Inputs, buffer_on, caller_stream  # noqa: F401 (autouse: stand-in streams)
from test_outputs import assert_packed

from intranode_entry_mirror import Entry, Recorder, capsule, install, sizes
from turnout import _C, torch_ext
from turnout.event import EventOverlap
from turnout.ops import intranode

MODULE = torch_ext.MODULE
pytestmark = pytest.mark.skipif(MODULE is None, reason="turnout._torch_ext is not in use here (not built against "
                                "this torch, or turned off)")

R, T, H, E, K, W = 4, 6, 64, 16, 3, 9
STREAM = 0x1234


@pytest.fixture
def recorder():
    rec = Recorder()
    alive = install(MODULE, rec)
    yield rec
    MODULE.set_intranode_entry(_C.Buffer.intranode_entry)
    del alive


class Call:
    """A common call's arguments, each replaceable."""

    def __init__(self, fp8=False):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, H, generator=g).bfloat16()
        self.args = dict(native=object(), config=object(),
                         x=(x.float().to(torch.float8_e4m3fn), torch.rand(T, H // 32, generator=g)) if fp8 else x,
                         num_tokens_per_rank=torch.zeros(R, dtype=torch.int32),
                         is_token_in_rank=torch.ones(T, R, dtype=torch.bool),
                         num_tokens_per_expert=torch.zeros(E, dtype=torch.int32),
                         topk_idx=torch.randint(0, E, (T, K), generator=g), topk_weights=torch.rand(T, K, generator=g),
                         expert_alignment=1, num_worst_tokens=W, num_ranks=R, device_index=FAST, stream=STREAM)

    def __call__(self, **changes):
        args = dict(self.args, **changes)
        return MODULE.dispatch_worst(*args.values())


def test_the_build_has_the_entry_of_its_own_c_module():
    assert MODULE.set_intranode_entry(_C.Buffer.intranode_entry) is None


def test_an_entry_of_another_build_or_name_is_refused(recorder):
    for field in ("entry_size", "args_size", "counts_size", "combine_size", "waited_size"):
        other = Entry(**sizes(**{field: getattr(recorder.entry, field) + 8}), **recorder.functions())
        made, _ = capsule(other)
        with pytest.raises(ImportError, match="different builds"):
            MODULE.set_intranode_entry(made)
    made, _ = capsule(recorder.entry, b"another.capsule")
    with pytest.raises(ValueError):
        MODULE.set_intranode_entry(made)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_common_call_hands_the_entry_what_it_returns(recorder, fp8):
    call = Call(fp8)
    a = call.args
    out = call(expert_alignment=2)
    assert out is not None and len(recorder.calls) == 1
    recv_x, recv_scales, recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx, prefix = out
    got = recorder.calls[0]
    assert got["native"] is a["native"] and got["config"] is a["config"] and got["stream"] == STREAM
    data, scales = a["x"] if fp8 else (a["x"], None)
    assert recv_x.dtype == data.dtype and tuple(recv_x.shape) == (W, H)
    assert tuple(recv_topk_idx.shape) == (W, K) and recv_topk_idx.dtype == torch.int64
    assert tuple(recv_topk_weights.shape) == (W, K) and recv_topk_weights.dtype == torch.float32
    assert tuple(source_num_tokens.shape) == (R,) and tuple(recv_src_idx.shape) == (W,)
    assert tuple(prefix.shape) == (R, R) and prefix.dtype == source_num_tokens.dtype == torch.int32
    args, counts, outs = got["args"], got["counts"], got["out"]
    assert args["x"] == data.data_ptr() and args["num_tokens"] == T
    assert args["row_bytes"] == H * data.element_size()
    if fp8:
        assert recv_scales.dtype == scales.dtype and tuple(recv_scales.shape) == (W, scales.shape[1])
        assert args["x_scales"] == scales.data_ptr() and args["num_scales"] == scales.shape[1]
        assert (args["scale_stride_token"], args["scale_stride_group"]) == scales.stride()
        assert outs["recv_x_scales"] == recv_scales.data_ptr()
    else:
        assert recv_scales is None and args["x_scales"] is None and outs["recv_x_scales"] is None
    assert args["topk_idx"] == counts["topk_idx"] == a["topk_idx"].data_ptr()
    assert args["topk_weights"] == a["topk_weights"].data_ptr()
    assert args["is_token_in_rank"] == counts["is_token_in_rank"] == a["is_token_in_rank"].data_ptr()
    assert args["rank_prefix_matrix"] == counts["rank_prefix_matrix"] == prefix.data_ptr()
    assert (args["num_topk"], args["num_experts"], args["num_recv_rows"], args["num_worst_tokens"]) == (K, E, W, W)
    assert (counts["num_tokens"], counts["num_topk"], counts["num_experts"]) == (T, K, E)
    assert counts["num_tokens_per_expert"] == a["num_tokens_per_expert"].data_ptr()
    assert counts["expert_alignment"] == 2 and counts["num_worst_tokens"] == W
    assert outs["recv_x"] == recv_x.data_ptr() and outs["recv_topk_idx"] == recv_topk_idx.data_ptr()
    assert outs["recv_topk_weights"] == recv_topk_weights.data_ptr()
    assert outs["recv_src_idx"] == recv_src_idx.data_ptr()
    assert outs["source_num_tokens"] == source_num_tokens.data_ptr()
    assert_packed([recv_x] + ([recv_scales] if fp8 else []),
                  [recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx, prefix])


class WaitedCall(Call):
    """A common call without num_worst_tokens: it waits for its counts."""

    def __init__(self, fp8=False):
        super().__init__(fp8)
        del self.args["num_worst_tokens"]

    def __call__(self, **changes):
        return MODULE.dispatch_waited(*dict(self.args, **changes).values())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_recv", [5, 0])
def test_the_waited_call_hands_the_entry_what_it_returns(recorder, fp8, num_recv):
    recorder.num_recv, recorder.own_rows = num_recv, (3, 1)
    call = WaitedCall(fp8)
    a = call.args
    outputs, per_expert, own_begin, num_own = call(expert_alignment=2)
    recv_x, recv_scales, recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx, prefix = outputs
    assert [c["op"] for c in recorder.calls] == ["counts", "data"]
    counts_call, data_call = recorder.calls
    for got in recorder.calls:
        assert got["native"] is a["native"] and got["config"] is a["config"] and got["stream"] == STREAM
    counts, args, outs = counts_call["counts"], data_call["args"], data_call["out"]
    assert counts_call["num_local_experts"] == E // R and per_expert == list(range(1, E // R + 1))
    assert (own_begin, num_own) == (3, 1)
    assert counts["num_worst_tokens"] == 0 and counts["expert_alignment"] == 2
    assert (counts["num_tokens"], counts["num_topk"], counts["num_experts"]) == (T, K, E)
    assert counts["num_tokens_per_expert"] == a["num_tokens_per_expert"].data_ptr()
    assert counts["topk_idx"] == args["topk_idx"] == a["topk_idx"].data_ptr()
    assert counts["is_token_in_rank"] == args["is_token_in_rank"] == a["is_token_in_rank"].data_ptr()
    assert counts["rank_prefix_matrix"] == args["rank_prefix_matrix"] == prefix.data_ptr()
    assert tuple(prefix.shape) == (R, R) and prefix.dtype == torch.int32
    data, scales = a["x"] if fp8 else (a["x"], None)
    assert recv_x.dtype == data.dtype and tuple(recv_x.shape) == (num_recv, H)
    assert (args["num_recv_rows"], args["num_worst_tokens"], args["num_topk"], args["num_experts"]) == (
        num_recv, 0, K, E)
    assert args["x"] == data.data_ptr() and args["row_bytes"] == H * data.element_size()
    if fp8:
        assert tuple(recv_scales.shape) == (num_recv, scales.shape[1]) and recv_scales.dtype == scales.dtype
        assert args["x_scales"] == scales.data_ptr() and (outs["recv_x_scales"] or 0) == recv_scales.data_ptr()
        assert (args["scale_stride_token"], args["scale_stride_group"]) == scales.stride()
    else:
        assert recv_scales is None and args["x_scales"] is None and outs["recv_x_scales"] is None
    assert tuple(recv_topk_idx.shape) == tuple(recv_topk_weights.shape) == (num_recv, K)
    assert tuple(source_num_tokens.shape) == (R,) and tuple(recv_src_idx.shape) == (num_recv,)
    for name, t in (("recv_x", recv_x), ("recv_topk_idx", recv_topk_idx), ("recv_topk_weights", recv_topk_weights),
                    ("recv_src_idx", recv_src_idx), ("source_num_tokens", source_num_tokens)):
        assert (outs[name] or 0) == t.data_ptr(), name  # ctypes gives None for 0
    if num_recv:
        assert_packed([recv_x] + ([recv_scales] if fp8 else []),
                      [recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx])


def test_a_waited_call_the_entry_does_not_take_gives_none_and_moves_nothing(recorder):
    recorder.counts_code = 1
    assert WaitedCall()() is None
    assert [c["op"] for c in recorder.calls] == ["counts"]


def test_a_data_step_refused_after_its_counts_step_is_an_error(recorder):
    recorder.code = 1
    with pytest.raises(RuntimeError, match="dispatch_waited: the data step's entry did not take the buffer"):
        WaitedCall()()
    assert [c["op"] for c in recorder.calls] == ["counts", "data"]


def not_contiguous(t):
    return t.t().contiguous().t() if t.dim() == 2 else t.repeat(2)[::2]


DECLINED = {
    "x of 60 channels": lambda c: dict(x=c.args["x"][:, :60].contiguous()),
    "x not contiguous": lambda c: dict(x=not_contiguous(c.args["x"])),
    "x a Parameter": lambda c: dict(x=torch.nn.Parameter(c.args["x"], requires_grad=False)),
    "x float32": lambda c: dict(x=c.args["x"].float()),
    "x a list": lambda c: dict(x=[c.args["x"]]),
    "another device index": lambda c: dict(device_index=0),
    "num_worst_tokens 0": lambda c: dict(num_worst_tokens=0),
    "num_worst_tokens True": lambda c: dict(num_worst_tokens=True),
    "num_worst_tokens 2**31": lambda c: dict(num_worst_tokens=1 << 31),
    "num_worst_tokens 9.0": lambda c: dict(num_worst_tokens=9.0),
    "expert_alignment 0": lambda c: dict(expert_alignment=0),
    "no top-k": lambda c: dict(topk_idx=None, topk_weights=None),
    "top-k of no slot": lambda c: dict(topk_idx=c.args["topk_idx"][:, :0].contiguous(),
                                       topk_weights=c.args["topk_weights"][:, :0].contiguous()),
    "topk_idx int32": lambda c: dict(topk_idx=c.args["topk_idx"].int()),
    "topk_weights of another shape": lambda c: dict(topk_weights=c.args["topk_weights"][:, :2].contiguous()),
    "topk_weights not contiguous": lambda c: dict(topk_weights=not_contiguous(c.args["topk_weights"])),
    "is_token_in_rank of 3 ranks": lambda c: dict(is_token_in_rank=c.args["is_token_in_rank"][:, :3].contiguous()),
    "is_token_in_rank uint8": lambda c: dict(is_token_in_rank=c.args["is_token_in_rank"].byte()),
    "num_tokens_per_rank of 5": lambda c: dict(num_tokens_per_rank=torch.zeros(5, dtype=torch.int32)),
    "num_tokens_per_expert of 18": lambda c: dict(num_tokens_per_expert=torch.zeros(18, dtype=torch.int32)),
    "num_tokens_per_expert empty": lambda c: dict(num_tokens_per_expert=torch.zeros(0, dtype=torch.int32)),
    "num_tokens_per_expert int64": lambda c: dict(num_tokens_per_expert=torch.zeros(E, dtype=torch.int64)),
}
DECLINED_FP8 = {
    "scales float64": lambda c: dict(x=(c.args["x"][0], c.args["x"][1].double())),
    "scales of 5 rows": lambda c: dict(x=(c.args["x"][0], c.args["x"][1][:5])),
    "scales 1-D": lambda c: dict(x=(c.args["x"][0], c.args["x"][1][:, 0].contiguous())),
    "rows of 40 channels": lambda c: dict(x=(c.args["x"][0][:, :40].contiguous(), c.args["x"][1])),
    "a tuple of three": lambda c: dict(x=c.args["x"] + (c.args["x"][1],)),
    "a list of two": lambda c: dict(x=list(c.args["x"])),
}


CASES = [(name, Call, {}, change) for name, change in DECLINED.items()]
CASES += [(name, Call, dict(fp8=True), change) for name, change in DECLINED_FP8.items()]
CASES += [(f"{name}, waited", WaitedCall, {}, change) for name, change in DECLINED.items()
          if "num_worst_tokens" not in name]
CASES += [(f"{name}, waited", WaitedCall, dict(fp8=True), change) for name, change in DECLINED_FP8.items()]


@pytest.mark.parametrize("name, make, kwargs, change", CASES, ids=[case[0] for case in CASES])
def test_a_call_that_is_not_the_common_case_is_declined_before_the_entry(recorder, name, make, kwargs, change):
    call = make(**kwargs)
    assert call(**change(call)) is None
    assert recorder.calls == []


def test_an_entry_that_does_not_take_the_buffer_gives_none(recorder):
    recorder.code = 1
    assert Call()() is None and len(recorder.calls) == 1


def test_the_c_entry_does_not_take_what_is_not_its_buffer():
    MODULE.set_intranode_entry(_C.Buffer.intranode_entry)
    assert Call()() is None and WaitedCall()() is None


class PythonPath(Exception):
    pass


def assert_events_take_the_python_path(monkeypatch, op):
    """``op(**changes)`` with async_finish, allocate_on_comm_stream or a
    previous_event reaches the Python path's streams (stopped there, as they
    need a GPU)."""
    def python_path(*args):
        raise PythonPath()

    with monkeypatch.context() as patch:
        patch.setattr(intranode.op_streams, "normal_op_streams", python_path)
        for changes in (dict(async_finish=True), dict(allocate_on_comm_stream=True),
                        dict(previous_event=EventOverlap())):
            with pytest.raises(PythonPath):
                op(**changes)


def test_the_op_takes_the_path_only_where_it_may(recorder, request, monkeypatch):
    streams_now = request.getfixturevalue("caller_stream")  # the autouse stand-in streams' list
    buf = buffer_on(FAST)
    inputs = Inputs(buf)
    native = buf._context.native
    # Until an op makes the caller's stream the buffer's last: the Python path.
    buf._context.tail = None
    inputs.dispatch(buf, num_worst_tokens=W)
    assert recorder.calls == [] and [name for name, _ in native.calls][-1] == "dispatch_known_rows"
    before = len(native.calls)
    recv_x, recv_idx, recv_weights, per_expert, handle, event = inputs.dispatch(buf, num_worst_tokens=W)
    assert len(recorder.calls) == 1 and len(native.calls) == before
    got = recorder.calls[0]
    assert got["native"] is native and got["out"]["recv_x"] == recv_x.data_ptr() and per_expert == []
    assert got["out"]["recv_topk_idx"] == recv_idx.data_ptr()
    assert got["out"]["recv_topk_weights"] == recv_weights.data_ptr()
    prefix, source_num_tokens, _, src_idx, in_rank, _ = handle
    assert got["args"]["rank_prefix_matrix"] == prefix.data_ptr() and in_rank is inputs.in_rank
    assert got["out"]["source_num_tokens"] == source_num_tokens.data_ptr()
    assert got["out"]["recv_src_idx"] == src_idx.data_ptr() and event.event is None
    # Waiting for the counts: the counts step, then the data step, each through the entry.
    recv_x, _, _, per_expert, handle, _ = inputs.dispatch(buf)
    assert [c["op"] for c in recorder.calls] == ["dispatch", "counts", "data"] and len(native.calls) == before
    assert recorder.calls[2]["out"]["recv_x"] == recv_x.data_ptr() and recv_x.shape[0] == recorder.num_recv
    assert per_expert == list(range(1, E // R + 1)) and handle._own_rows == recorder.own_rows
    # Not the common case: the Python path, and the entry is not called.
    buf.dispatch(inputs.x, handle=handle)
    streams_now[0] += 1  # another stream than the buffer's last: it must follow first
    inputs.dispatch(buf, num_worst_tokens=W)
    assert len(recorder.calls) == 3 and buf._context.tail == streams_now[0]
    # A bad argument still raises naming it, from the Python path.
    for worst in (W, 0):
        with pytest.raises(TypeError, match="topk_weights"):
            inputs.dispatch(buf, num_worst_tokens=worst, topk_weights=inputs.weights.double())
    assert len(recorder.calls) == 3

    for worst in (W, 0):
        assert_events_take_the_python_path(monkeypatch, lambda **changes: inputs.dispatch(buf, num_worst_tokens=worst,
                                                                                          **changes))
    assert len(recorder.calls) == 3


N = 7  # rows a dispatch received


class CombineCall:
    """A common combine's arguments (the handle's tensors made up), each replaceable."""

    def __init__(self, weights=True):
        g = torch.Generator().manual_seed(1)
        self.args = dict(native=object(), config=object(), x=torch.randn(N, H, generator=g).bfloat16(),
                         topk_weights=torch.rand(N, K, generator=g) if weights else None,
                         rank_prefix_matrix=torch.zeros(R, R, dtype=torch.int32),
                         source_num_tokens=torch.zeros(R, dtype=torch.int32),
                         recv_src_idx=torch.zeros(N, dtype=torch.int32),
                         is_token_in_rank=torch.ones(T, R, dtype=torch.bool), device_index=FAST, stream=STREAM,
                         own_rows_begin=2, num_own_rows=3)

    def __call__(self, **changes):
        return MODULE.combine_plain(*dict(self.args, **changes).values())


@pytest.mark.parametrize("weights", [True, False], ids=["weights", "no weights"])
def test_the_common_combine_hands_the_entry_what_it_returns(recorder, weights):
    call = CombineCall(weights)
    a = call.args
    combined_x, combined_weights = call()
    assert [c["op"] for c in recorder.calls] == ["combine"]
    got = recorder.calls[0]
    args = got["args"]
    assert got["native"] is a["native"] and got["config"] is a["config"] and got["stream"] == STREAM
    assert combined_x.dtype == torch.bfloat16 and tuple(combined_x.shape) == (T, H)
    assert args["x"] == a["x"].data_ptr() and (args["num_rows"], args["hidden"], args["num_tokens"]) == (N, H, T)
    assert args["combined_x"] == combined_x.data_ptr()
    for name in ("rank_prefix_matrix", "source_num_tokens", "recv_src_idx", "is_token_in_rank"):
        assert args[name] == a[name].data_ptr(), name
    assert args["bias0"] is None and args["bias1"] is None
    assert (args["own_rows_begin"], args["num_own_rows"]) == (2, 3)
    if weights:
        assert combined_weights.dtype == torch.float32 and tuple(combined_weights.shape) == (T, K)
        assert args["topk_weights"] == a["topk_weights"].data_ptr() and args["num_topk"] == K
        assert args["combined_topk_weights"] == combined_weights.data_ptr()
    else:
        assert combined_weights is None and args["topk_weights"] is None and args["num_topk"] == 0
        assert args["combined_topk_weights"] is None


@pytest.mark.parametrize("begin, count", [(-1, 0), (-1, 3), (2, 0), (2, -1)])
def test_a_combine_without_its_own_rows_known_hands_the_entry_none(recorder, begin, count):
    CombineCall()(own_rows_begin=begin, num_own_rows=count)
    args = recorder.calls[0]["args"]
    assert (args["own_rows_begin"], args["num_own_rows"]) == (-1, 0)


COMBINE_DECLINED = {
    "x of 6 rows": lambda c: dict(x=c.args["x"][:6].contiguous()),
    "x float32": lambda c: dict(x=c.args["x"].float()),
    "x of 60 channels": lambda c: dict(x=c.args["x"][:, :60].contiguous()),
    "x not contiguous": lambda c: dict(x=not_contiguous(c.args["x"])),
    "x a Parameter": lambda c: dict(x=torch.nn.Parameter(c.args["x"], requires_grad=False)),
    "x a tuple": lambda c: dict(x=(c.args["x"],)),
    "another device index": lambda c: dict(device_index=0),
    "weights of 6 rows": lambda c: dict(topk_weights=c.args["topk_weights"][:6].contiguous()),
    "weights of no slot": lambda c: dict(topk_weights=c.args["topk_weights"][:, :0].contiguous()),
    "weights float64": lambda c: dict(topk_weights=c.args["topk_weights"].double()),
    "weights not contiguous": lambda c: dict(topk_weights=not_contiguous(c.args["topk_weights"])),
}


@pytest.mark.parametrize("case", sorted(COMBINE_DECLINED))
def test_a_combine_that_is_not_the_common_case_is_declined_before_the_entry(recorder, case):
    test_a_call_that_is_not_the_common_case_is_declined_before_the_entry(recorder, case, CombineCall, {},
                                                                        COMBINE_DECLINED[case])


def test_a_handle_entry_that_is_not_a_tensor_is_a_type_error(recorder):
    with pytest.raises(TypeError, match="handle tensor 2"):
        CombineCall()(recv_src_idx=[0] * N)
    assert recorder.calls == []


def test_the_op_combines_in_one_call_only_where_it_may(recorder, monkeypatch):
    buf = buffer_on(FAST)
    inputs = Inputs(buf)
    native = buf._context.native
    recv_x, _, recv_weights, _, handle, _ = inputs.dispatch(buf, num_worst_tokens=W)
    before = len(native.calls)
    combined_x, combined_weights, event = buf.combine(recv_x, handle, recv_weights)
    assert [c["op"] for c in recorder.calls] == ["dispatch", "combine"] and len(native.calls) == before
    got = recorder.calls[-1]["args"]
    assert got["combined_x"] == combined_x.data_ptr() and got["combined_topk_weights"] == combined_weights.data_ptr()
    assert got["x"] == recv_x.data_ptr() and got["recv_src_idx"] == handle[3].data_ptr() and event.event is None
    # A bias, or a handle of another buffer: the Python path (which names the bad handle).
    buf.combine(recv_x, handle, recv_weights, bias=torch.zeros(T, H, dtype=torch.bfloat16))
    assert len(recorder.calls) == 2 and [name for name, _ in native.calls][-1] == "combine"
    other = buffer_on(FAST)
    with pytest.raises(ValueError, match="handle"):
        other.combine(recv_x, handle, recv_weights)
    assert len(recorder.calls) == 2
    assert_events_take_the_python_path(monkeypatch, lambda **changes: buf.combine(recv_x, handle, recv_weights,
                                                                                  **changes))
    assert len(recorder.calls) == 2
