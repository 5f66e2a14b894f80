"""Shrink mode (Buffer(..., enable_shrink=True)) in low-latency mode: a masked
rank is neither sent to nor waited for, and every survivor's dispatch and
combine match the host reference with the masked ranks' tokens and experts
removed.

- A rank masked through the API (it sits the calls out): every call shape
  against the reduced reference, no call waits for it; unmasking it on every
  rank and a clean brings the full results back.
- Ranks that stop calling (alive, not dead) at their first dispatch, combine
  and clean: every survivor's next mask query shows exactly the ranks that
  stopped, and 100 calls after it are correct. The time each survivor's call
  takes to give up on the stopped rank is printed per op.
- A slow rank (asleep past the shrink timeout, then calling) never corrupts
  the survivors' results, and comes back through unmask and clean.
- 200 create / mask / destroy cycles leave the device memory where it was.
- A rank killed by SIGKILL in the middle of a call, in low-latency and in
  normal mode: shrink_kill_job.py, a job of its own."""
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import turnout
from harness import count_check, memory_kept
from low_latency_cases import round_trip, size_hint, world
from shrink_cases import CASES, SHRINK_S, References, Step, assert_mask, variants

HERE = Path(__file__).resolve().parent


def shrink_buffer(ctx, g, n: int):
    return ctx.buffer(g, num_rdma_bytes=size_hint(CASES, n), low_latency_mode=True, enable_shrink=True,
                      shrink_timeout_s=SHRINK_S)


def test_rank_masked_by_the_api(ctx):
    n, g = world(ctx)
    me, dev = ctx.rank, ctx.device
    masked = {n - 1} if n < 4 else {1, n - 1}
    survivors = [r for r in range(n) if r not in masked]
    refs = References(n)
    with shrink_buffer(ctx, g, n) as buf:
        assert_mask(buf, n, dev, set(), f"n={n}: a new buffer")
        if me in survivors:
            for r in masked:
                buf.low_latency_update_mask_buffer(r, mask=True)
            assert_mask(buf, n, dev, masked, f"n={n}: after masking {sorted(masked)}")
            for case in CASES:
                for weights_at_dispatch, hook, logfmt in variants(case):
                    what = f"n={n} masked {sorted(masked)} {case} weights@dispatch={weights_at_dispatch} " \
                           f"hook={hook} logfmt={logfmt}"
                    step = Step(ctx, buf, refs, case, weights_at_dispatch, hook, logfmt)
                    took = step.dispatch(masked, what + ": dispatch")
                    took += step.combine(masked, masked, what + ": combine")
                    assert took < SHRINK_S, f"{what}: the round trip took {took:.2f} s: it waited for a masked rank"
            assert_mask(buf, n, dev, masked, f"n={n}: after the calls")
        ctx.all_gather(None)
        # Back: every rank unmasks, then all clean together (the call counters meet again).
        for r in masked:
            buf.low_latency_update_mask_buffer(r, mask=False)
        assert_mask(buf, n, dev, set(), f"n={n}: after unmasking")
        ctx.all_gather(None)
        buf.clean_low_latency_buffer(CASES[0].max_tokens, CASES[0].hidden, CASES[0].experts)
        for case in CASES:
            round_trip(ctx, buf, case, n, f"n={n} {case}: after unmask and clean")
        # clean_mask unmasks everything at once.
        buf.low_latency_update_mask_buffer(0 if me != 0 else n - 1, mask=True)
        buf.low_latency_clean_mask_buffer()
        assert_mask(buf, n, dev, set(), f"n={n}: after low_latency_clean_mask_buffer")


test_rank_masked_by_the_api.timeout = 240

# Which rank stops at its first call of each op (DeepEP's shrink test uses the same pattern).
STOPS = {2: {"dispatch": 1}, 4: {"dispatch": 1, "combine": 3}, 8: {"dispatch": 1, "combine": 3, "clean": 5}}
CALLS = 100


def test_ranks_that_stop_calling(ctx):
    n, g = world(ctx)
    me, dev = ctx.rank, ctx.device
    stops = STOPS[min(8, max(k for k in STOPS if k <= n))]
    refs = References(n)
    expected = set()
    calls = 0
    detection = {}  # op -> seconds the survivor's call took to give up on the stopped rank
    stopped = False
    with shrink_buffer(ctx, g, n) as buf:
        it = 0
        while calls < CALLS and not stopped:
            case = CASES[it % len(CASES)]
            step = Step(ctx, buf, refs, case, weights_at_dispatch=(it % 3 == 1), hook=(it % 3 == 2))
            what = f"n={n} call {calls}"
            for op in ("dispatch", "combine", "clean"):
                if stops.get(op) is not None and stops[op] not in expected:
                    expected.add(stops[op])
                    if me == stops[op]:
                        stopped = True
                        break
                    new = True
                else:
                    new = False
                before = set(expected)
                if op == "dispatch":
                    took = step.dispatch(expected, f"{what}: dispatch")
                    dispatch_masked = set(expected)
                elif op == "combine":
                    took = step.combine(dispatch_masked, expected, f"{what}: combine")
                else:
                    start = time.monotonic()
                    buf.clean_low_latency_buffer(case.max_tokens, case.hidden, case.experts)
                    torch.cuda.synchronize()
                    took = time.monotonic() - start
                calls += 1
                assert_mask(buf, n, dev, before, f"{what}: after {op}")
                if new:
                    detection[op] = took
                    # The first wait for the stopped rank gives up after the shrink timeout (combine: twice it).
                    limit = (2 if op == "combine" else 1) * SHRINK_S + 2.0
                    assert SHRINK_S * 0.9 <= took <= limit, f"{what}: {op} gave up after {took:.2f} s"
                else:
                    assert took < SHRINK_S, f"{what}: {op} took {took:.2f} s with every stopped rank masked"
            it += 1
        if not stopped:
            assert calls >= CALLS, f"n={n}: only {calls} calls"
            print(f"rank {me}: gave up on the stopped rank after " +
                  ", ".join(f"{op} {s:.2f} s" for op, s in detection.items()) +
                  f" (shrink_timeout_s={SHRINK_S}); {calls} calls checked", flush=True)
        ctx.all_gather(None)


test_ranks_that_stop_calling.timeout = 300


def test_slow_rank_never_corrupts_the_survivors(ctx):
    n, g = world(ctx)
    me, dev = ctx.rank, ctx.device
    slow = n - 1
    refs = References(n)
    case = CASES[0]
    with shrink_buffer(ctx, g, n) as buf:
        if me == slow:
            time.sleep(2.5 * SHRINK_S)
            # Its calls go out while the survivors go on; it waits for nobody
            # that answers, so it masks every peer itself.
            # The first takes the survivors' sends of the call they gave up on.
            inp = refs.inputs(case)[me]
            for _ in range(3):
                buf.low_latency_dispatch(inp.x.to(dev), inp.topk_idx.to(dev), case.max_tokens, case.experts)
                torch.cuda.synchronize()
            assert_mask(buf, n, dev, set(range(n)) - {slow}, f"n={n}: the slow rank's own mask")
            buf.low_latency_clean_mask_buffer()
        else:
            masked = {slow}
            for i in range(12):
                step = Step(ctx, buf, refs, CASES[i % len(CASES)])
                step.dispatch(masked, f"n={n} survivor call {i}: dispatch")
                step.combine(masked, masked, f"n={n} survivor call {i}: combine")
                assert_mask(buf, n, dev, masked, f"n={n} survivor call {i}")
                time.sleep(0.1 * SHRINK_S)  # spread the calls over the slow rank's
            buf.low_latency_update_mask_buffer(slow, mask=False)
        ctx.all_gather(None)
        buf.clean_low_latency_buffer(case.max_tokens, case.hidden, case.experts)
        for c in CASES:
            round_trip(ctx, buf, c, n, f"n={n} {c}: the slow rank back after unmask and clean")
        assert_mask(buf, n, dev, set(), f"n={n}: after the slow rank came back")


test_slow_rank_never_corrupts_the_survivors.timeout = 240


def test_create_mask_destroy_cycles_keep_memory(ctx):
    n, g = world(ctx)
    me, dev = ctx.rank, ctx.device
    hint = size_hint(CASES[:1], n)

    def cycle():
        buf = turnout.Buffer(g, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True,
                             shrink_timeout_s=SHRINK_S, explicitly_destroy=True)
        buf.low_latency_update_mask_buffer((me + 1) % n, mask=True)
        assert_mask(buf, n, dev, {(me + 1) % n}, f"n={n}: a cycle's mask")
        buf.destroy()

    pids = set(ctx.all_gather(os.getpid()))
    for _ in range(10):
        cycle()

    def cycles():
        for _ in range(190):
            cycle()

    # Every rank on this GPU cycles too; 8 MiB is far below one buffer's allocation.
    window = memory_kept(ctx, g, pids, cycles)
    assert window.kept < 8 << 20, \
        f"n={n}: 190 cycles took {window.kept / 2**20:.1f} MiB of device memory and kept it (memory: {window.note})"


test_create_mask_destroy_cycles_keep_memory.timeout = 300


def run_kill_job(ctx, mode: str) -> None:
    """The job of shrink_kill_job.py (n ranks, its own processes), run from
    rank 0; its summary line is printed."""
    n, _ = world(ctx)
    result = None
    if ctx.rank == 0:
        # The job starts an MPS daemon of its own where its ranks share a GPU.
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        proc = subprocess.run([sys.executable, str(HERE / "shrink_kill_job.py"), "--ranks", str(n), "--mode", mode],
                              env=env, capture_output=True, text=True, timeout=240)
        result = (proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:])
    code, out, err = ctx.all_gather(result)[0]
    count_check()
    if code != 0:
        raise AssertionError(f"n={n}: the {mode} kill job exited with {code}\nstdout:\n{out}\nstderr:\n{err}")
    if ctx.rank == 0:
        print(out.strip().splitlines()[-1], flush=True)


def test_killed_rank_in_low_latency_mode(ctx):
    """One rank SIGKILLs itself between a dispatch's send and its receive."""
    run_kill_job(ctx, "low_latency")


test_killed_rank_in_low_latency_mode.timeout = 300


def test_killed_rank_in_normal_mode(ctx):
    """One rank SIGKILLs itself while the others wait for it in dispatch."""
    run_kill_job(ctx, "normal")


test_killed_rank_in_normal_mode.timeout = 300
