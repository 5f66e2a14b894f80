"""Host time of the ops' Python layer, without a GPU.

Drives ``Buffer.get_dispatch_layout``, ``dispatch`` (BF16: with
``num_worst_tokens``, waiting for the counts, cached; FP8) and ``combine``
(normal mode, without async_finish: its torch.cuda.Event needs a GPU) and
``low_latency_dispatch`` / ``low_latency_combine`` (every mode the bench
times for host time: FP8, BF16, with stats, ``async_finish``, the send of
``return_recv_hook`` and its ``hook()``) over CPU tensors and a stand-in
native buffer whose calls do nothing, so what it times is the Python layer
alone: checks, allocations, output sets, handles, events, the pending queue.
On a GPU host the native call (the kernel launch), the caching allocator and
the CUDA stream and event calls come on top. Where turnout._torch_ext is in
use, the "one call" modes time its one-call ops (checks, outputs and a call
into a ctypes entry that queues nothing: tests/python/intranode_entry_mirror.py,
low_latency_entry_mirror.py); the modes they stand beside keep to the Python
layer's own path.

Per mode: the mean us per call of the best of ``--repeats`` runs of
``--calls`` calls back to back, in the thread's CPU time (this machine's
other processes do not count; a hook's send and its ``hook()`` are timed
apart). ``--profile`` adds, per mode, where the time goes: cProfile's
own time per function and call (the profiler inflates every function call,
so read it for where, not how much).

Run from the repository root, with turnout importable (installed, or the
tree's ``python/`` beside a built ``_C``)::

    python3 scripts/host_profile.py [--profile]
"""
import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))

import intranode_entry_mirror  # noqa: E402
import low_latency_entry_mirror  # noqa: E402
import low_latency_standin as standin  # noqa: E402
from turnout import _C, Buffer, torch_ext  # noqa: E402
from turnout.ops import intranode, streams  # noqa: E402
from turnout.ops import low_latency as ll  # noqa: E402

# The bench's shape at EP2: 128 tokens, hidden 7168, top-8 of 288 experts.
RANKS, TOKENS, HIDDEN, EXPERTS, TOPK = 2, 128, 7168, 288, 8


class IdleNative:
    """A native buffer whose launches do nothing; one given a ring records
    and returns the ring's next event, as the module does."""

    destroyed = False

    def low_latency_dispatch(self, *args):
        return None if args[-1] is None else args[-1].record(args[-4])

    def low_latency_combine(self, *args):
        return None if args[-1] is None else args[-1].record(args[-4])

    def join(self, waiter, waited):
        pass

    def follow(self, waiter, waited):
        return True

    def get_dispatch_layout(self, *args):
        pass

    def dispatch_counts(self, *args):
        # A dispatch without num_worst_tokens receives what this rank sends
        # (args: is_token_in_rank, num_tokens, num_tokens_per_expert, num_experts, ...).
        return args[1], [0] * args[3], 0, args[1]

    def dispatch(self, *args):
        pass

    def dispatch_known_rows(self, *args):
        pass

    def combine(self, *args):
        pass


def make_buffer() -> Buffer:
    """A Buffer over the stand-in context; CPU tensors count as on its GPU."""
    context = standin.make_context(num_ranks=RANKS, device_index=-1)
    context.native = IdleNative()
    ll.current_raw_stream = lambda device_index: standin.CALLER_STREAM
    torch.cuda.is_current_stream_capturing = lambda: False
    buffer = Buffer.__new__(Buffer)
    buffer._context, buffer._native, buffer.group_size = context, context.native, RANKS
    streams.current_raw_stream = ll.current_raw_stream
    return buffer


def modes(buffer: Buffer):
    """(name, make) of each mode: ``make(n)`` returns a callable that makes n
    such calls (whatever they need, made before: a handle, n hooks)."""
    x = torch.randn(TOKENS, HIDDEN).bfloat16()
    topk_idx = torch.randint(0, EXPERTS, (TOKENS, TOPK))
    weights = torch.rand(TOKENS, TOPK)
    rows = torch.zeros(EXPERTS // RANKS, TOKENS * RANKS, HIDDEN, dtype=torch.bfloat16)
    stats = torch.zeros(EXPERTS // RANKS, dtype=torch.int32)

    def dispatch(**kwargs):
        return buffer.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS, **kwargs)

    def combine(handle, **kwargs):
        return buffer.low_latency_combine(rows, topk_idx, weights, handle, **kwargs)

    def loop(call):
        def make(n):
            def run():
                for _ in range(n):
                    call()
            return run
        return make

    def combine_loop(**kwargs):
        def make(n):
            handle = dispatch()[2]
            return loop(lambda: combine(handle, **kwargs))(n)
        return make

    def async_loop(call):
        # The stand-in's event completes when told: as a GPU that keeps up.
        def completed():
            call().event.done = True
        return loop(completed)

    def async_combine(n):
        handle = dispatch()[2]
        return async_loop(lambda: combine(handle, async_finish=True)[1])(n)

    def hooks(send):
        def make(n):
            made = [send() for _ in range(n)]

            def run():
                for hook in made:
                    hook()
            return run
        return make

    def combine_send(handle_holder):
        return lambda: combine(handle_holder[0], return_recv_hook=True)[2]

    def combine_hooks(n):
        return hooks(combine_send([dispatch()[2]]))(n)

    def combine_sends(n):
        return loop(combine_send([dispatch()[2]]))(n)

    # Normal mode: a layout, then dispatches from it and combines of their rows.
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, EXPERTS)

    # FP8 rows with float scales, one per 128 channels, column-major as DeepEP's callers pass them.
    x_fp8 = (x.to(torch.float8_e4m3fn), torch.ones(HIDDEN // 128, TOKENS).t())

    def normal_dispatch(rows=x, **kwargs):
        return buffer.dispatch(rows, None, num_tokens_per_rank, None, is_token_in_rank, num_tokens_per_expert,
                               topk_idx, weights, **kwargs)

    def normal_combine(n):
        recv_x, _, recv_weights, _, handle, _ = normal_dispatch()
        return loop(lambda: buffer.combine(recv_x, handle, recv_weights))(n)

    def python_path(make):
        # The Python layer's own path: the one-call ops turned off (the
        # stand-in buffer is not _C's, so _C's entries would decline them
        # after their checks and allocations).
        def made(n):
            run = make(n)

            def in_python():
                saved = (intranode._dispatch_worst, intranode._dispatch_waited, intranode._combine_plain,
                         ll._dispatch_in_one_call, ll._combine_in_one_call)
                intranode._dispatch_worst = intranode._dispatch_waited = intranode._combine_plain = None
                ll._dispatch_in_one_call = ll._combine_in_one_call = None
                try:
                    run()
                finally:
                    (intranode._dispatch_worst, intranode._dispatch_waited, intranode._combine_plain,
                     ll._dispatch_in_one_call, ll._combine_in_one_call) = saved
            return in_python
        return made

    def one_call(make, mirror=intranode_entry_mirror, calls_per_op=1):
        # turnout._torch_ext's one-call path with a ctypes entry (mirror's)
        # that queues nothing (its callback from C into Python is part of the
        # figure), from the calls `make` makes first (a hook's send) to the
        # end of the timed run.
        def made(n):
            entry = mirror.Recorder(keep=False)
            alive = mirror.install(torch_ext.MODULE, entry)
            try:
                run = make(n)
            except BaseException:
                restore_entries()
                raise
            before = entry.count

            def through_entry():
                nonlocal alive
                try:
                    run()
                finally:
                    restore_entries()
                    alive = None
                if entry.count - before != n * calls_per_op:
                    raise RuntimeError(f"the one-call path took {entry.count - before} of {n} calls")
            return through_entry
        return made

    def restore_entries():
        torch_ext.MODULE.set_intranode_entry(_C.Buffer.intranode_entry)
        torch_ext.MODULE.set_low_latency_entry(_C.Buffer.low_latency_entry)

    def cached_dispatch(n):
        handle = normal_dispatch()[4]
        return loop(lambda: buffer.dispatch(x, handle))(n)

    worst_bf16 = loop(lambda: normal_dispatch(num_worst_tokens=TOKENS * RANKS))
    worst_fp8 = loop(lambda: normal_dispatch(x_fp8, num_worst_tokens=TOKENS * RANKS))
    one_call_modes = [] if torch_ext.MODULE is None else [
        ("dispatch BF16, num_worst_tokens, one call", one_call(worst_bf16)),
        ("dispatch FP8, num_worst_tokens, one call", one_call(worst_fp8)),
        # Its counts step, then its data step: two calls into the entry.
        ("dispatch BF16, counts from the host, one call", one_call(loop(normal_dispatch), calls_per_op=2)),
        ("combine BF16, with weights, one call", one_call(normal_combine))]
    ll_dispatch = loop(dispatch)
    ll_dispatch_stats = loop(lambda: dispatch(cumulative_local_expert_recv_stats=stats))
    ll_dispatch_bf16 = loop(lambda: dispatch(use_fp8=False))
    ll_dispatch_async = async_loop(lambda: dispatch(async_finish=True)[3])
    ll_dispatch_sends = loop(lambda: dispatch(return_recv_hook=True))
    ll_dispatch_hooks = hooks(lambda: dispatch(return_recv_hook=True)[4])
    low_latency_one_call_modes = [] if torch_ext.MODULE is None else [
        ("low_latency_dispatch FP8, one call", one_call(ll_dispatch, low_latency_entry_mirror)),
        ("low_latency_dispatch FP8, cumulative stats, one call", one_call(ll_dispatch_stats, low_latency_entry_mirror)),
        ("low_latency_dispatch BF16, one call", one_call(ll_dispatch_bf16, low_latency_entry_mirror)),
        ("low_latency_dispatch FP8, async_finish, one call", one_call(ll_dispatch_async, low_latency_entry_mirror)),
        ("low_latency_dispatch FP8, hook send, one call", one_call(ll_dispatch_sends, low_latency_entry_mirror)),
        ("low_latency_dispatch FP8, hook(), one call", one_call(ll_dispatch_hooks, low_latency_entry_mirror)),
        ("low_latency_combine BF16, one call", one_call(combine_loop(), low_latency_entry_mirror)),
        ("low_latency_combine BF16, async_finish, one call", one_call(async_combine, low_latency_entry_mirror)),
        ("low_latency_combine BF16, hook send, one call", one_call(combine_sends, low_latency_entry_mirror)),
        ("low_latency_combine BF16, hook(), one call", one_call(combine_hooks, low_latency_entry_mirror))]
    return [
        ("get_dispatch_layout", loop(lambda: buffer.get_dispatch_layout(topk_idx, EXPERTS))),
        ("dispatch BF16, num_worst_tokens", python_path(worst_bf16)),
        ("dispatch BF16, counts from the host", python_path(loop(normal_dispatch))),
        ("dispatch BF16, cached", cached_dispatch),
        ("dispatch FP8, num_worst_tokens", python_path(worst_fp8)),
        ("combine BF16, with weights", python_path(normal_combine)),
        *one_call_modes,
        ("low_latency_dispatch FP8", python_path(ll_dispatch)),
        ("low_latency_dispatch FP8, cumulative stats", python_path(ll_dispatch_stats)),
        ("low_latency_dispatch BF16", python_path(ll_dispatch_bf16)),
        ("low_latency_dispatch FP8, async_finish", python_path(ll_dispatch_async)),
        ("low_latency_dispatch FP8, hook send", python_path(ll_dispatch_sends)),
        ("low_latency_dispatch FP8, hook()", python_path(ll_dispatch_hooks)),
        ("low_latency_combine BF16", python_path(combine_loop())),
        ("low_latency_combine BF16, async_finish", python_path(async_combine)),
        ("low_latency_combine BF16, hook send", python_path(combine_sends)),
        ("low_latency_combine BF16, hook()", python_path(combine_hooks)),
        *low_latency_one_call_modes,
    ]


def time_mode(make, calls: int, repeats: int) -> float:
    """The best over ``repeats`` runs of the mean us per call, in this
    thread's CPU time (other processes' turns on a shared core do not count),
    with the cyclic garbage collector off, as timeit has it: a collection
    falls on whichever call passes its threshold and scans every object of
    the process, so it made a mode's figure vary 2x from run to run."""
    best = float("inf")
    for _ in range(repeats):
        run = make(calls)
        gc.collect()
        gc.disable()
        try:
            start = time.thread_time_ns()
            run()
            elapsed = time.thread_time_ns() - start
        finally:
            gc.enable()
        best = min(best, elapsed / calls / 1e3)
    return best


def profile(run, calls: int, top: int) -> None:
    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (path, line, name), (_, ncalls, own, _, _) in rows:
        where = f"{Path(path).name}:{line}" if line else ""
        print(f"    {own / calls * 1e6:6.3f} us  {ncalls / calls:4.1f}x  {name} {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="add cProfile's own time per function")
    parser.add_argument("--top", type=int, default=12, help="functions shown per mode with --profile")
    args = parser.parse_args()
    buffer = make_buffer()
    print(f"host time per call, Python layer over a stand-in native buffer (us, thread CPU time; best of "
          f"{args.repeats} x {args.calls} calls); {TOKENS} tokens, hidden {HIDDEN}, top-{TOPK} of {EXPERTS} "
          f"experts, {RANKS} ranks")
    for name, make in modes(buffer):
        make(min(1000, args.calls))()
        print(f"  {name:40s} {time_mode(make, args.calls, args.repeats):6.2f}")
        if args.profile:
            profile(make(args.calls), args.calls, args.top)


if __name__ == "__main__":
    main()
