"""Kernel timeline of the low-latency calls at the bench's shape: each call
captured 20 times in a CUDA graph, a few replays recorded by the PyTorch
profiler on every rank. Prints, per figure, each kernel's median duration and
the median gap before it (from the end of the kernel before it), and the time
per call; writes rank 0's Chrome trace of the last figure beside --trace.

    python scripts/low_latency_timeline.py [--ranks N] [--tokens T] [--hidden H] [--trace PATH]
"""
import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict

import torch

from turnout.bench import low_latency as bench
from turnout.launch import run_on_local_gpus

CALLS, REPLAYS = 20, 5
FIGURES = [
    ("dispatch FP8", lambda s: bench.dispatch_parts(s, True)),
    ("combine BF16", lambda s: bench.combine_parts(s, False)),
    ("combine BF16, weights at dispatch", lambda s: bench.combine_parts(s, True)),
    ("dispatch FP8 + combine BF16", bench.pair_parts),
]


def kernels(prof, keep: str) -> list:
    """(name, start us, duration us) of every GPU kernel the profiler saw, in
    start order; the trace is kept at ``keep`` if given."""
    path = keep
    if not keep:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    if not keep:
        os.unlink(path)
    out = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") == "kernel"]
    return sorted(out, key=lambda k: k[1])


def summarize(ks: list) -> dict:
    """Per kernel name: median duration and median gap from the previous kernel's end."""
    durs, gaps = defaultdict(list), defaultdict(list)
    for i, (name, start, dur) in enumerate(ks):
        if "low_latency" not in name:
            continue
        durs[name].append(dur)
        if i and "low_latency" in ks[i - 1][0]:
            gaps[name].append(start - ks[i - 1][1] - ks[i - 1][2])
    return {name: {"dur_us": statistics.median(durs[name]),
                   "gap_us": statistics.median(gaps[name]) if gaps[name] else None,
                   "count": len(durs[name])} for name in durs}


def measure(rank: int, world_size: int, tokens: int, hidden: int, trace: str) -> dict:
    torch.manual_seed(rank)
    s = bench.Setup(world_size, tokens=tokens, hidden=hidden, experts=288, topk=8)
    results = {}
    for op, build in FIGURES:
        parts = build(s)
        for _ in range(3):
            parts[0]()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                parts[0]()
        for _ in range(5):
            s.aligned_start()
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                s.aligned_start()
                start.record()
                graph.replay()
                end.record()
            torch.cuda.synchronize()
        ks = kernels(prof, trace if rank == 0 and trace else "")
        results[op] = {"kernels": summarize(ks), "per_call_us": start.elapsed_time(end) * 1e3 / CALLS}
        del graph
        s.buffer.check_errors()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--trace", default="")
    args = parser.parse_args()
    print(f"tokens {args.tokens}, hidden {args.hidden}, top-8 of 288 experts")
    per_rank = run_on_local_gpus(measure, (args.tokens, args.hidden, args.trace), args.ranks, "nccl")
    for op in per_rank[0]:
        calls = [r[op]["per_call_us"] for r in per_rank]
        print(f"== {op}: per call (last replay) {statistics.median(calls):.2f} us, "
              f"ranks {min(calls):.2f}..{max(calls):.2f}")
        for name in per_rank[0][op]["kernels"]:
            durs = [r[op]["kernels"][name]["dur_us"] for r in per_rank if name in r[op]["kernels"]]
            gaps = [r[op]["kernels"][name]["gap_us"] for r in per_rank
                    if name in r[op]["kernels"] and r[op]["kernels"][name]["gap_us"] is not None]
            gap = f"{statistics.median(gaps):6.2f}" if gaps else "     -"
            short = name.split("(")[0].split("::")[-1]
            print(f"  {short:40s} dur {statistics.median(durs):6.2f} us (ranks {min(durs):.2f}..{max(durs):.2f})"
                  f"  gap before {gap} us")


if __name__ == "__main__":
    main()
