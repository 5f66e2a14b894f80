"""Low-latency mode across declared NVL domains, as its own job: the suite's
low-latency tests run in fresh processes whose environment declares the domain
size (TURNOUT_NVL_DOMAIN_SIZE), so every Buffer they make spans domains and
runs over NVSHMEM (its P2P transport: this machine has no NIC). Run by
test_low_latency_domains.py.

    python low_latency_domains_job.py RANKS DOMAIN_SIZE NVLINK(0|1) TEST...

TEST is module::function of a suite test (tests/gpu), or one of LOCAL_TESTS
below. Prints one line per test (PASS / SKIP / FAIL) and exits
non-zero if any failed. With TURNOUT_JOB_PROGRESS set, each rank says when a
test starts, and after TURNOUT_JOB_STACKS_AFTER_S (600) seconds prints every
rank's Python stack and exits: what a hung collective looks like. With
TURNOUT_JOB_TIMING set, every rank adds a TIME line per test: the seconds in
Buffer() (NVSHMEM's init), destroy, the low-latency calls, torch.cuda.synchronize
and the rest (harness.HostTimes).

Each rank's torch thread pool gets its share of the cores, as the runner's
workers do (harness.share_cpu_cores): the host references run in every rank
at once."""
import contextlib
import os
import sys
import time
import traceback

TIMEOUT_S = 3.0
HOST_GRACE_S = 2.0


def make_context(rank: int, world_size: int, allow_nvlink: bool):
    import torch
    import torch.distributed as dist

    import harness

    class DomainContext(harness.Context):
        """The harness's context with one group, all ranks (a smaller group
        would not hold whole domains); its buffers keep NVLink out of
        low-latency mode when asked."""

        def __init__(self) -> None:
            self.rank = rank
            self.world_size = world_size
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.num_devices = torch.cuda.device_count()
            self.groups = {world_size: dist.group.WORLD}

        def buffer(self, group, *args, **kwargs):
            kwargs.setdefault("allow_nvlink_for_low_latency_mode", allow_nvlink)
            return super().buffer(group, *args, **kwargs)

    return DomainContext()


def absent_rank(ctx) -> None:
    """Every rank but the last calls low_latency_dispatch: each raises
    TimeoutError naming the last rank within timeout_s (+ grace); then every
    rank destroys its buffer together (NVSHMEM frees collectively) and a new
    buffer's round trip is right."""
    import torch

    from low_latency_cases import LLCase, dispatch, inputs_of, round_trip, size_hint

    case = LLCase("uniform", 32, 32, 2048, 8, 64, "fp8")
    n, dev, me = ctx.world_size, ctx.device, ctx.rank
    absent = n - 1
    with ctx.buffer(ctx.groups[n], num_rdma_bytes=size_hint([case], n), low_latency_mode=True,
                    timeout_s=TIMEOUT_S) as buf:
        if me != absent:
            start = time.monotonic()
            error = None
            try:
                dispatch(buf, case, inputs_of(case, n, me), dev)
                torch.cuda.synchronize()
                buf.check_errors()
            except TimeoutError as e:
                error = e
            elapsed = time.monotonic() - start
            assert error is not None, f"n={n}: rank {absent} never called, and no TimeoutError came"
            assert f"rank {absent}" in str(error), f"n={n}: the error does not name rank {absent}: {error}"
            assert elapsed <= TIMEOUT_S + HOST_GRACE_S, f"n={n}: TimeoutError after {elapsed:.2f} s"
            assert torch.arange(10, device=dev).sum().item() == 45, f"n={n}: the CUDA context is broken"
        ctx.all_gather(None)
    with ctx.buffer(ctx.groups[n], num_rdma_bytes=size_hint([case], n), low_latency_mode=True) as fresh:
        round_trip(ctx, fresh, case, n, f"n={n}: a new buffer after the timeout")


def wrong_domain_size(ctx) -> None:
    """A declared domain size that does not divide the group is refused by name."""
    import turnout
    from harness import assert_raises

    n = ctx.world_size
    bad = n + 1
    assert_raises(ValueError, lambda: turnout.Buffer(ctx.groups[n], num_rdma_bytes=1 << 20, low_latency_mode=True,
                                                     nvl_domain_size=bad, explicitly_destroy=True),
                  "nvl_domain_size", str(bad))


def shrink_lost_rank(ctx) -> None:
    """Shrink mode across domains: every rank makes checked round trips and a
    clean together, then the last rank (in the last domain) stops calling.
    The survivors' next dispatch gives up on it after the shrink timeout and
    masks it; that call and the ones after it match the host reference
    without its tokens and experts; a clean and a destroy return within
    bounded time, without NVSHMEM's collectives (which would wait for it
    forever). NVSHMEM then stays initialized in every process, so this test
    comes last in its job. The stopped rank destroys its buffer after the
    survivors: it gives up on them in turn."""
    import torch

    from low_latency_cases import size_hint
    from shrink_cases import CASES, SHRINK_S, References, Step, assert_mask

    n, dev, me = ctx.world_size, ctx.device, ctx.rank
    lost = n - 1
    refs = References(n)
    with ctx.buffer(ctx.groups[n], num_rdma_bytes=size_hint(CASES, n), low_latency_mode=True, enable_shrink=True,
                    shrink_timeout_s=SHRINK_S) as buf:
        for case in CASES:
            step = Step(ctx, buf, refs, case)
            step.dispatch(set(), f"n={n} {case}: before the stop: dispatch")
            step.combine(set(), set(), f"n={n} {case}: before the stop: combine")
        # Every rank at the group barrier (clean's two): the counters start again, the next call is right.
        buf.clean_low_latency_buffer(CASES[0].max_tokens, CASES[0].hidden, CASES[0].experts)
        step = Step(ctx, buf, refs, CASES[0])
        step.dispatch(set(), f"n={n}: after a clean of every rank: dispatch")
        step.combine(set(), set(), f"n={n}: after a clean of every rank: combine")
        assert_mask(buf, n, dev, set(), f"n={n}: before the stop")
        ctx.all_gather(None)
        if me != lost:
            gone = {lost}
            step = Step(ctx, buf, refs, CASES[0])
            took = step.dispatch(gone, f"n={n}: the first call without rank {lost}: dispatch")
            assert SHRINK_S * 0.9 <= took <= SHRINK_S + HOST_GRACE_S, \
                f"n={n}: the dispatch gave up on rank {lost} after {took:.2f} s (shrink_timeout_s={SHRINK_S})"
            step.combine(gone, gone, f"n={n}: the first call without rank {lost}: combine")
            assert_mask(buf, n, dev, gone, f"n={n}: after the first call without rank {lost}")
            for i in range(4):
                step = Step(ctx, buf, refs, CASES[i % len(CASES)], weights_at_dispatch=(i % 2 == 1), hook=(i == 2))
                took = step.dispatch(gone, f"n={n} call {i} without rank {lost}: dispatch")
                took += step.combine(gone, gone, f"n={n} call {i} without rank {lost}: combine")
                assert took < SHRINK_S, f"n={n} call {i}: the round trip took {took:.2f} s with rank {lost} masked"
            start = time.monotonic()
            buf.clean_low_latency_buffer(CASES[0].max_tokens, CASES[0].hidden, CASES[0].experts)
            torch.cuda.synchronize()
            took = time.monotonic() - start
            assert took < SHRINK_S, f"n={n}: clean_low_latency_buffer took {took:.2f} s with rank {lost} masked"
            step = Step(ctx, buf, refs, CASES[1])
            step.dispatch(gone, f"n={n}: after the clean: dispatch")
            step.combine(gone, gone, f"n={n}: after the clean: combine")
            assert_mask(buf, n, dev, gone, f"n={n}: after the clean")
            start = time.monotonic()
            buf.destroy()
            took = time.monotonic() - start
            assert took < SHRINK_S, f"n={n}: destroy took {took:.2f} s with rank {lost} masked"
        ctx.all_gather(None)
        if me == lost:
            # Its peers are gone from the buffer: its destroy gives up on them (once, together).
            start = time.monotonic()
            buf.destroy()
            took = time.monotonic() - start
            assert took <= SHRINK_S + HOST_GRACE_S, f"n={n}: the stopped rank's destroy took {took:.2f} s"
        ctx.all_gather(None)


LOCAL_TESTS = {"absent_rank": absent_rank, "wrong_domain_size": wrong_domain_size, "shrink_lost_rank": shrink_lost_rank}


def job(rank: int, world_size: int, allow_nvlink: bool, tests):
    import importlib

    import harness

    if os.environ.get("TURNOUT_JOB_PROGRESS"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ.get("TURNOUT_JOB_STACKS_AFTER_S", "600")), exit=True)
    harness.share_cpu_cores(world_size)
    ctx = make_context(rank, world_size, allow_nvlink)
    timing = bool(os.environ.get("TURNOUT_JOB_TIMING"))
    lines = []
    for name in tests:
        if name in LOCAL_TESTS:
            fn = LOCAL_TESTS[name]
        else:
            module, function = name.split("::")
            fn = getattr(importlib.import_module(module), function)
        start = time.monotonic()
        if os.environ.get("TURNOUT_JOB_PROGRESS"):
            print(f"[rank {rank}] start {name}", file=sys.stderr, flush=True)
        times = harness.HostTimes() if timing else None
        try:
            with times or contextlib.nullcontext():
                fn(ctx)
            took = time.monotonic() - start
            lines.append(f"PASS {name} ({took:.1f} s)")
            if times:
                lines.append(times.line(name, took))
        except harness.Skipped as e:
            lines.append(f"SKIP {name}: {e}")
        except Exception:
            lines.append(f"FAIL {name}:\n{traceback.format_exc()}")
            break  # the others may wait for this rank in a collective
    return lines


def main() -> int:
    from turnout.launch import run_on_local_gpus

    num_ranks, domain, nvlink = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    tests = sys.argv[4:]
    assert os.environ.get("TURNOUT_NVL_DOMAIN_SIZE") == str(domain), "the caller declares the domain size"
    try:
        results = run_on_local_gpus(job, (nvlink, tests), num_ranks, "gloo", timeout_s=900)
    except RuntimeError as e:
        print(f"FAIL job: {e}")
        return 1
    failed = False
    for rank, lines in enumerate(results):
        for line in lines:
            if rank == 0 or not line.startswith(("PASS", "SKIP")):
                print(f"[rank {rank}] {line}")
            failed |= line.startswith("FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
