"""Low-latency calls in a process set up as DeepEP's own test harness sets up
every rank: torch.set_default_device("cuda") (which installs a
TorchFunctionMode) and torch.set_default_dtype(torch.bfloat16), then many
calls of every kind, as a long-running job makes them.

After 34 mixed calls (BF16, FP8, FP8 with round_scale, UE8M0; receive hooks;
async_finish, its events waited for both ways DeepEP code waits; two
dispatches of a shape before their combines; weights at dispatch;
cumulative_local_expert_recv_stats on every dispatch), 50 dispatch FP8 +
combine pairs back to back, their results dropped each time, must
- make no host sync: torch.cuda.set_sync_debug_mode("error") raises on one;
- make no torch-function call inside turnout: a counting TorchFunctionMode
  above the default device's counts only while a turnout call runs (the
  test's own tensor work is outside it), over the mixed calls too;
- grow no memory: torch.cuda.memory_allocated() after the 50th pair is what it
  was after the 10th.
Checked after them: the last pair's recv_count per local expert equals the
(token, expert) entries routed to it, counted from every rank's topk_idx (all
gathered); its combined_x is finite and bitwise the combine of the same handle
run once more; the stats hold every dispatch's counts. Default device, dtype
and sync-debug mode are restored whatever happens."""
import contextlib
import types

import torch
from torch.overrides import TorchFunctionMode

from harness import assert_equal
from low_latency_cases import MODES, LLCase, inputs_of, size_hint, world

CASE = LLCase("uniform", 32, 32, 2048, 8, 64, "fp8")
PAIRS = 50
MEMORY_AFTER = 10  # pairs before the memory figure the last pair must match

# (mode, kind) of the mixed calls, in order: 14 dispatches, 34 calls.
MIXED = (
    ("bf16", "plain"), ("fp8", "hook"), ("fp8_round", "async"), ("ue8m0", "twice"),
    ("fp8", "plain"), ("bf16", "async"), ("ue8m0", "hook"), ("fp8", "twice"),
    ("fp8_round", "hook"), ("bf16", "weights"), ("ue8m0", "async"), ("fp8", "plain"),
)


class TurnoutCallCounter(TorchFunctionMode):
    """Records the torch functions that reach it while a turnout call runs
    (inside ``counting()``); lets every call through."""

    def __init__(self):
        super().__init__()
        self.inside = False
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.inside:
            self.seen.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def default_device_setting():
    """What torch.set_default_device was last given (None: never, or cleared)."""
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return None if context is None else context.device


def mixed_step(buf, counter: TurnoutCallCounter, a, mode: str, kind: str) -> int:
    """One entry of MIXED: its dispatches and their combines (hooks called,
    events waited for); returns the number of dispatches."""
    use_fp8, round_scale, use_ue8m0 = MODES[mode]
    n, e = CASE.max_tokens, CASE.experts

    def dispatch(**kwargs):
        with counter.counting():
            return buf.low_latency_dispatch(a.x, a.topk_idx, n, e, a.stats, use_fp8=use_fp8, round_scale=round_scale,
                                            use_ue8m0=use_ue8m0, **kwargs)

    def combine(handle, **kwargs):
        with counter.counting():
            return buf.low_latency_combine(a.expert_out, a.topk_idx, a.weights, handle, **kwargs)

    if kind == "twice":
        first, second = dispatch(), dispatch()
        combine(first[2])
        combine(second[2])
        return 2
    if kind == "hook":
        out = dispatch(return_recv_hook=True)
        with counter.counting():
            out[4]()
        hook = combine(out[2], return_recv_hook=True)[2]
        with counter.counting():
            hook()
        return 1
    if kind == "async":
        out = dispatch(async_finish=True)
        with counter.counting():
            out[3].current_stream_wait()
        event = combine(out[2], async_finish=True)[1]
        with counter.counting(), event:
            pass
        return 1
    out = dispatch(topk_weights=a.weights) if kind == "weights" else dispatch()
    combine(out[2])
    return 1


def test_low_latency_calls_in_a_deepep_test_process(ctx):
    n, g = world(ctx)
    if CASE.unfit(n):
        ctx.skip(f"{CASE}: {CASE.unfit(n)}")
    dev, me, local = ctx.device, ctx.rank, CASE.experts // n
    mine = inputs_of(CASE, n, me)
    # This rank's receive count per local expert, from every rank's routing.
    all_idx = torch.tensor(ctx.all_gather(mine.topk_idx.tolist(), g), dtype=torch.int64)
    per_expert = torch.bincount(all_idx[all_idx >= 0], minlength=CASE.experts)
    expected = per_expert[me * local:(me + 1) * local].to(torch.int32)

    with ctx.buffer(g, num_rdma_bytes=size_hint([CASE], n), low_latency_mode=True) as buf:
        saved = default_device_setting(), torch.get_default_dtype(), torch.cuda.get_sync_debug_mode()
        counter = TurnoutCallCounter()
        memory = {}
        try:
            torch.set_default_device("cuda")
            torch.set_default_dtype(torch.bfloat16)
            with counter:
                # Made as DeepEP's tests make them: on the default device, in the default dtype where unnamed.
                a = types.SimpleNamespace(x=mine.x.to(dev), topk_idx=mine.topk_idx.to(dev),
                                          weights=mine.topk_weights.to(dev),
                                          expert_out=torch.randn(local, CASE.max_tokens * n, CASE.hidden),
                                          stats=torch.zeros(local, dtype=torch.int32))
                assert a.expert_out.device == dev and a.expert_out.dtype == torch.bfloat16, "the defaults apply"
                dispatches = sum(mixed_step(buf, counter, a, mode, kind) for mode, kind in MIXED)
                torch.cuda.synchronize()
                mixed_stats = a.stats.cpu()
                torch.cuda.set_sync_debug_mode("error")
                for i in range(PAIRS):
                    with counter.counting():
                        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
                            a.x, a.topk_idx, CASE.max_tokens, CASE.experts, a.stats, use_fp8=True)
                        combined_x, _, _ = buf.low_latency_combine(a.expert_out, a.topk_idx, a.weights, handle)
                    if i + 1 in (MEMORY_AFTER, PAIRS):
                        memory[i + 1] = torch.cuda.memory_allocated()
                torch.cuda.set_sync_debug_mode(saved[2])
                again, _, _ = buf.low_latency_combine(a.expert_out, a.topk_idx, a.weights, handle)
                torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(saved[2])
            torch.set_default_dtype(saved[1])
            torch.set_default_device(saved[0])
        what = f"n={n} rank {me}"
        assert counter.seen == [], f"{what}: torch functions called inside turnout: {counter.seen[:40]}"
        assert memory[PAIRS] == memory[MEMORY_AFTER], \
            f"{what}: memory_allocated {memory[MEMORY_AFTER]} after {MEMORY_AFTER} pairs, {memory[PAIRS]} after {PAIRS}"
        assert recv_x[0].dtype == torch.float8_e4m3fn and combined_x.dtype == torch.bfloat16, \
            f"{what}: dtypes {recv_x[0].dtype} / {combined_x.dtype}"
        assert_equal(recv_count, expected, f"{what}: recv_count of the last pair")
        assert int(recv_count.sum()) == int(expected.sum()), f"{what}: recv_count sum"
        assert bool(torch.isfinite(combined_x).all()), f"{what}: combined_x of the last pair is not finite"
        assert_equal(again.view(torch.int16), combined_x.view(torch.int16),
                     f"{what}: the last pair's combine run once more")
        assert_equal(mixed_stats, expected * dispatches, f"{what}: stats after {dispatches} mixed dispatches")
        assert_equal(a.stats, expected * (dispatches + PAIRS), f"{what}: stats after the pairs")
    assert default_device_setting() == saved[0] and torch.get_default_dtype() == saved[1]


test_low_latency_calls_in_a_deepep_test_process.timeout = 180
