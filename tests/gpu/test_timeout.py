"""A peer that never comes raises a TimeoutError naming it instead of a hang;
the job can then build a new buffer. The timeout's sources: argument, env."""
import contextlib
import os
import signal
import threading
import time

import torch

import routing
import turnout
import turnout_reference
from harness import assert_equal, assert_layout_matches, assert_raises, generator

TIMEOUT_S = 1.0
HOST_GRACE_S = 2.0  # the host's margin over the kernels' own timeout


@contextlib.contextmanager
def environment(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def test_absent_peer_times_out_at_barrier(ctx):
    for n in ctx.sizes():
        g = ctx.group(n)
        absent = n - 1
        buf = None
        if g is not None:
            buf = turnout.Buffer(g, num_nvl_bytes=1 << 20, explicitly_destroy=True, timeout_s=TIMEOUT_S)
            if ctx.rank != absent:
                start = time.monotonic()
                assert_raises(TimeoutError, buf._barrier, f"rank {absent}", "barrier")
                elapsed = time.monotonic() - start
                assert 0.9 * TIMEOUT_S <= elapsed <= TIMEOUT_S + HOST_GRACE_S, \
                    f"n={n}: the barrier gave up after {elapsed:.2f} s, timeout_s is {TIMEOUT_S}"

        # The absent rank frees its buffer while the others' mappings are still
        # valid; then the others, whose destroy must skip the meeting that
        # the absent rank will never join.
        ctx.all_gather(None)
        if buf is not None and ctx.rank == absent:
            buf.destroy()
        ctx.all_gather(None)
        if buf is not None and ctx.rank != absent:
            start = time.monotonic()
            buf.destroy()
            elapsed = time.monotonic() - start
            assert elapsed < TIMEOUT_S, f"n={n}: destroy after a timeout took {elapsed:.2f} s (it waited for peers)"
        ctx.all_gather(None)

        if g is None:
            continue
        with ctx.buffer(g, num_nvl_bytes=1 << 20, timeout_s=TIMEOUT_S) as buf:
            buf._barrier()
            topk_idx = routing.uniform(256, 8 * n, 4, generator("after timeout", n, ctx.rank), ctx.device)
            out = buf.get_dispatch_layout(topk_idx, 8 * n)
            assert_layout_matches(out, topk_idx, n, 8 * n, f"n={n} after a timeout")


test_absent_peer_times_out_at_barrier.timeout = 120


def test_timeout_from_environment(ctx):
    for _, g in ctx.each_group():
        with environment("TURNOUT_TIMEOUT_S", "2.5"):
            with ctx.buffer(g, num_nvl_bytes=1 << 20) as buf:
                assert buf._native.timeout_s == 2.5, f"timeout_s {buf._native.timeout_s} with TURNOUT_TIMEOUT_S=2.5"
            # The argument wins over the environment.
            with ctx.buffer(g, num_nvl_bytes=1 << 20, timeout_s=7.0) as buf:
                assert buf._native.timeout_s == 7.0, f"timeout_s {buf._native.timeout_s} with timeout_s=7.0"
        # Fails before any collective, on every rank alike.
        with environment("TURNOUT_TIMEOUT_S", "abc"):
            assert_raises(ValueError, lambda: turnout.Buffer(g, num_nvl_bytes=1 << 20), "TURNOUT_TIMEOUT_S")
        assert os.environ.get("TURNOUT_TIMEOUT_S") != "abc", "the environment must be restored"


test_timeout_from_environment.timeout = 120


def test_ctrl_c_ends_a_host_wait(ctx):
    """SIGINT while the host waits for the GPU raises KeyboardInterrupt within a
    second, long before the work is done, and the buffer still works after."""
    n = max(ctx.sizes())
    g = ctx.group(n)
    if g is None:
        return
    with ctx.buffer(g, num_nvl_bytes=1 << 20, timeout_s=30.0) as buf:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            stream = buf.get_comm_stream()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(8_000_000_000)  # seconds of GPU time at any clock this chip runs
                busy = torch.cuda.Event()
                busy.record(stream)
            timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
            start = time.monotonic()
            timer.start()
            try:
                assert_raises(KeyboardInterrupt, lambda: buf._native.synchronize(stream.cuda_stream, "the test's wait"))
            finally:
                timer.cancel()
            elapsed = time.monotonic() - start
            assert not busy.query(), "the GPU work was already done: the wait was not cut short"
            assert elapsed < 0.3 + 1.0, f"KeyboardInterrupt came {elapsed:.2f} s after the wait began (SIGINT at 0.3 s)"
            torch.cuda.synchronize()
            topk_idx = routing.uniform(256, 8 * n, 4, generator("after ctrl-c", n, ctx.rank), ctx.device)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, 8 * n)
            ref = turnout_reference.get_dispatch_layout(topk_idx.cpu().numpy(), n, 8 * n, n)
            assert_equal(per_rank, ref[0], f"n={n}: num_tokens_per_rank after Ctrl-C")
            assert_equal(in_rank, ref[3].astype(bool), f"n={n}: is_token_in_rank after Ctrl-C")
        finally:
            signal.signal(signal.SIGINT, previous)


test_ctrl_c_ends_a_host_wait.timeout = 120
