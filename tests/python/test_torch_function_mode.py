"""Buffer's ops in a process set up as DeepEP's test harness sets up every rank:
``torch.set_default_device("cuda")``, which installs a TorchFunctionMode, and
``torch.set_default_dtype(torch.bfloat16)``. Through such a mode each tensor
access costs microseconds of Python, so the ops must make no torch-function
call at all, and must return the dtypes they return without the defaults.

Driven on the CPU: the low-latency ops over the low-latency stand-in
(low_latency_standin), the normal ops over a stand-in for their native calls.
The context's device is "meta" and the default device another one, so an
allocation that does not name the context's device shows on the outputs."""
import ast
import types
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import turnout
from low_latency_standin import E, K, M, NormalNativeStandIn, R, T, expert_rows, inputs, make_context, patch_streams
from turnout import Buffer

META = torch.device("meta")


class CountingMode(TorchFunctionMode):
    """Records the name of every torch function that reaches it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def default_device_setting():
    """What torch.set_default_device was last given (None: never, or cleared)."""
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return None if context is None else context.device


@pytest.fixture(autouse=True)
def caller_stream(monkeypatch):
    return patch_streams(monkeypatch)


@pytest.fixture
def deepep_defaults():
    """The defaults of DeepEP's test harness, for the test's body; restored after."""
    device, dtype = default_device_setting(), torch.get_default_dtype()
    torch.set_default_device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_device(device)
        torch.set_default_dtype(dtype)
    assert default_device_setting() == device and torch.get_default_dtype() == dtype


def buffer_over(context):
    """A Buffer whose ops run on ``context`` (no GPU, no group)."""
    buf = Buffer.__new__(Buffer)
    buf._context = context
    buf.group_size = context.num_ranks
    return buf


def tensors_of(value):
    """Every tensor in a (nested) result, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    return []


# -- low-latency mode --------------------------------------------------------------------------------------------

class LowLatencyInputs:
    """What the low-latency calls below take, made before any mode is entered."""

    def __init__(self, context):
        self.x, self.topk_idx = inputs(device=META)
        self.weights = torch.empty(T, K, dtype=torch.float32, device=META)
        self.y = expert_rows(context)
        self.hidden = self.x.shape[1]
        self.out = torch.empty(T, self.hidden, dtype=torch.bfloat16, device=META)
        self.stats = torch.empty(E // R, dtype=torch.int32, device=META)
        self.wait = torch.empty(R, dtype=torch.int64, device=META)


def low_latency_calls(buf, a: LowLatencyInputs):
    """Every public low-latency op of ``buf``, with each kind of output; returns
    the results in call order. Touches no tensor itself."""
    results = []
    for kwargs in (dict(use_fp8=False), dict(use_fp8=True), dict(round_scale=True),
                   dict(round_scale=True, use_ue8m0=True), dict(topk_weights=a.weights)):
        out = buf.low_latency_dispatch(a.x, a.topk_idx, M, E, a.stats, a.wait, **kwargs)
        results.append(out)
        results.append(buf.low_latency_combine(a.y, a.topk_idx, a.weights, out[2]))
    handle = results[-2][2]
    results.append(buf.low_latency_combine(a.y, a.topk_idx, a.weights, handle, out=a.out, use_logfmt=True,
                                           combine_wait_recv_cost_stats=a.wait))
    results.append(buf.get_next_low_latency_combine_buffer(handle))
    results.append(buf.low_latency_combine(a.y, a.topk_idx, a.weights, handle, zero_copy=True))
    hooked = buf.low_latency_dispatch(a.x, a.topk_idx, M, E, return_recv_hook=True)
    hooked[4]()
    results.append(hooked)
    combined = buf.low_latency_combine(a.y, a.topk_idx, a.weights, hooked[2], return_recv_hook=True)
    combined[2]()
    results.append(combined)
    # async_finish, its events waited for both ways DeepEP code waits.
    out = buf.low_latency_dispatch(a.x, a.topk_idx, M, E, a.stats, async_finish=True)
    out[3].current_stream_wait()
    results.append(out)
    combined = buf.low_latency_combine(a.y, a.topk_idx, a.weights, out[2], async_finish=True)
    with combined[1]:
        results.append(combined)
    buf.clean_low_latency_buffer(M, a.hidden, E)
    return results


def test_low_latency_ops_make_no_torch_function_call(deepep_defaults):
    context = make_context(device=META, device_index=-1)
    buf, a = buffer_over(context), LowLatencyInputs(context)
    with CountingMode() as mode:
        results = low_latency_calls(buf, a)
        made_by_ops = list(mode.seen)
        _ = a.x.shape  # the mode sees an access made outside the ops
    assert made_by_ops == [], f"torch functions called through the mode inside the ops: {made_by_ops}"
    assert len(mode.seen) == 1, f"the mode must see the test's own access, saw {mode.seen}"
    kinds = [method for method, _ in context.native.calls]
    assert kinds.count("low_latency_dispatch") == 8 and kinds.count("low_latency_combine") == 10, kinds
    assert context.low_latency.ring.records, "the async calls recorded events"
    assert kinds[-1] == "clean_low_latency_buffer"
    outputs = [t for r in results for t in tensors_of(r)]
    assert outputs and all(t.device == META for t in outputs), \
        f"outputs off the context's device: {[t.device for t in outputs if t.device != META]}"


def output_dtypes(results):
    return [t.dtype for r in results for t in tensors_of(r)]


def test_low_latency_output_dtypes_ignore_the_default_dtype(deepep_defaults):
    context = make_context(device=META, device_index=-1)
    under_defaults = low_latency_calls(buffer_over(context), LowLatencyInputs(context))
    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    context = make_context(device=META, device_index=-1)
    plain = low_latency_calls(buffer_over(context), LowLatencyInputs(context))
    assert output_dtypes(under_defaults) == output_dtypes(plain)
    bf16_recv_x, fp8_recv_x, ue8m0_recv_x = under_defaults[0][0], under_defaults[2][0], under_defaults[6][0]
    assert bf16_recv_x.dtype == torch.bfloat16
    assert (fp8_recv_x[0].dtype, fp8_recv_x[1].dtype) == (torch.float8_e4m3fn, torch.float32)
    assert (ue8m0_recv_x[0].dtype, ue8m0_recv_x[1].dtype) == (torch.float8_e4m3fn, torch.int32)
    recv_count, handle = under_defaults[0][1], under_defaults[0][2]
    assert (recv_count.dtype, handle[0].dtype, handle[1].dtype, handle.plan.dtype) == \
        (torch.int32, torch.int32, torch.int64, torch.uint8)
    combined_x, combine_buffer = under_defaults[1][0], under_defaults[11]
    assert combined_x.dtype == combine_buffer.dtype == torch.bfloat16


# -- normal mode -------------------------------------------------------------------------------------------------

NUM_RECV = 12


class NormalStandIn(NormalNativeStandIn):
    """A fresh dispatch without num_worst_tokens receives NUM_RECV rows."""

    def counts(self, call):
        return NUM_RECV, [NUM_RECV] + [0] * (call["num_experts"] - 1), 0, NUM_RECV


def normal_calls(buf, topk_idx, weights, x, bias, async_finish):
    """get_dispatch_layout, a fresh dispatch with and without num_worst_tokens,
    a cached one, and a combine with weights and a bias; the results in order.
    Touches no tensor itself."""
    layout = buf.get_dispatch_layout(topk_idx, E, async_finish=async_finish)
    per_rank, _, per_expert, in_rank, _ = layout
    fresh = buf.dispatch(x, None, per_rank, None, in_rank, per_expert, topk_idx, weights, async_finish=async_finish)
    worst = buf.dispatch(x, None, per_rank, None, in_rank, per_expert, topk_idx, weights, num_worst_tokens=NUM_RECV,
                         async_finish=async_finish)
    cached = buf.dispatch(x, fresh[4], async_finish=async_finish)
    rows, recv_weights = fresh[0], fresh[2]
    combined = buf.combine(rows, fresh[4], recv_weights, bias, async_finish=async_finish)
    return [layout, fresh, worst, cached, combined]


@pytest.mark.parametrize("async_finish", [False, pytest.param(True, marks=pytest.mark.skip(
    reason="the normal ops' async_finish records a torch.cuda.Event and calls record_stream: the CPU stand-in "
           "cannot run that path"))])
def test_normal_ops_make_no_torch_function_call(deepep_defaults, async_finish):
    context = types.SimpleNamespace(native=NormalStandIn(), device=META, device_index=-1, num_ranks=R,
                                    num_rdma_ranks=1, comm_stream=None, comm_raw=0x2000, handle_owner=object(),
                                    low_latency=None, tail=None)
    buf = buffer_over(context)
    _, topk_idx = inputs(device=META)
    weights = torch.empty(T, K, dtype=torch.float32, device=META)
    x = torch.empty(T, 256, dtype=torch.bfloat16, device=META)
    bias = torch.empty(T, 256, dtype=torch.bfloat16, device=META)
    args = (buf, topk_idx, weights, x, bias, async_finish)
    with CountingMode() as mode:
        results = normal_calls(*args)
    assert mode.seen == [], f"torch functions called through the mode inside the ops: {mode.seen}"
    assert [m for m, _ in context.native.calls] == ["get_dispatch_layout", "dispatch_counts", "dispatch",
                                                    "dispatch_known_rows", "dispatch_known_rows", "combine"]
    outputs = [t for r in results for t in tensors_of(r)]
    assert outputs and all(t.device == META for t in outputs)
    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    assert output_dtypes(results) == output_dtypes(normal_calls(*args))
    recv_x, recv_topk_idx, recv_weights = results[1][:3]
    assert (recv_x.dtype, recv_topk_idx.dtype, recv_weights.dtype) == (torch.bfloat16, torch.int64, torch.float32)
    assert results[4][0].dtype == torch.bfloat16 and results[4][1].dtype == torch.float32


# -- every allocation names its device and dtype -----------------------------------------------------------------

FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "linspace", "rand", "randn", "randint",
             "empty_strided", "eye"}


def factory_calls(path: Path):
    """(line, factory, keyword names) of every ``torch.<factory>(...)`` call in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
            yield node.lineno, node.func.attr, {k.arg for k in node.keywords}


def test_every_allocation_of_the_ops_names_its_device_and_dtype():
    """With torch-function dispatch off inside the ops the default device no
    longer applies, and the default dtype never should: each factory call
    says both. (The ops' new_empty calls take both from an input they have
    checked; test_normal_ops_make_no_torch_function_call sees their dtypes.)"""
    package = Path(turnout.__file__).parent
    files = [package / "buffer.py", *sorted((package / "ops").glob("*.py"))]
    calls = [(f.name, line, name, keywords) for f in files for line, name, keywords in factory_calls(f)]
    assert len(calls) >= 10, f"the walk found only {len(calls)} factory calls: {calls}"
    missing = [(f, line, name, sorted({"device", "dtype"} - kw)) for f, line, name, kw in calls
               if not {"device", "dtype"} <= kw]
    assert missing == [], f"factory calls without an explicit device or dtype: {missing}"
