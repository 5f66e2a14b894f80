"""Where a low-latency call's host time goes, on a GPU host: the whole call
beside its parts timed alone (the native launch with the arguments the call
passed it, the combine's output allocation, the stream lookup, the async
form's ring event), each the way the bench times host rows (perf_counter_ns
around the call, bursts issued back to back after a sync and a barrier,
median). What the parts leave of the whole is the Python layer.

    python scripts/low_latency_host_split.py [--ranks N] [--iters 400]
"""
import argparse
import statistics

import torch

from turnout.bench import low_latency as bench
from turnout.event import current_raw_stream
from turnout.launch import run_on_local_gpus


class Recorder:
    """Stands in for the native buffer: forwards every call, and keeps the
    positional arguments of the last call of each low-latency launch."""

    def __init__(self, native) -> None:
        self._native = native
        self.calls = {}

    def __getattr__(self, name):
        target = getattr(self._native, name)
        if not name.startswith("low_latency_"):
            return target

        def recorded(*args):
            self.calls[name] = args
            return target(*args)

        return recorded


def measure(rank: int, world_size: int, iters: int) -> dict:
    torch.manual_seed(rank)
    s = bench.Setup(world_size, tokens=128, hidden=7168, experts=288, topk=8)
    context = s.buffer._context
    native = context.native
    recorder = Recorder(native)
    index = context.device_index
    # One call of each kind through the recorder: its arguments are the native launch's.
    context.native = recorder
    handle = s.dispatch()[2]
    dispatch_args = recorder.calls["low_latency_dispatch"][:-4]
    s.combine(handle)
    combine_args = recorder.calls["low_latency_combine"][:-4]
    s.combine(handle, async_finish=True)
    async_tail = recorder.calls["low_latency_combine"][-4:]
    context.native = native
    torch.cuda.synchronize()
    stream = current_raw_stream(index)
    launch_dispatch, launch_combine = native.low_latency_dispatch, native.low_latency_combine
    x, topk_idx, topk_weights, expert_out = s.x, s.topk_idx, s.topk_weights, s.expert_out
    buffer = s.buffer
    parts = {
        "combine BF16: whole call (positional)": lambda: buffer.low_latency_combine(expert_out, topk_idx, topk_weights,
                                                                                   handle),
        "combine BF16, async_finish: whole call": lambda: buffer.low_latency_combine(
            expert_out, topk_idx, topk_weights, handle, False, False, True),
        "combine BF16: native launch": lambda: launch_combine(*combine_args, 0, stream, None, None),
        "combine BF16, async_finish: native launch and ring event": lambda: launch_combine(*combine_args, *async_tail),
        "combine BF16: output allocation (new_empty)": lambda: expert_out.new_empty(128, 7168),
        "current stream lookup": lambda: current_raw_stream(index),
        # Last: a dispatch makes the combines' handle stale.
        "dispatch FP8: whole call (positional)": lambda: buffer.low_latency_dispatch(x, topk_idx, 128, 288),
        "dispatch FP8: native launch": lambda: launch_dispatch(*dispatch_args, 0, stream, None, None),
    }
    out = {}
    for name, part in parts.items():
        out[name] = bench.host_times([part], iters)[0][0]
        torch.cuda.synchronize()
    s.buffer.check_errors()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--iters", type=int, default=400)
    args = parser.parse_args()
    per_rank = run_on_local_gpus(measure, (args.iters,), args.ranks, "nccl")
    print("host us per call, median of ranks (min..max); 128 tokens, hidden 7168, top-8 of 288")
    for name in per_rank[0]:
        values = [r[name] for r in per_rank]
        print(f"  {name:60s} {statistics.median(values):7.2f}  ({min(values):.2f}..{max(values):.2f})")


if __name__ == "__main__":
    main()
