"""Kernel timeline of the low-latency calls at the bench's shape: each call
captured 20 times in a CUDA graph, a few replays recorded by the PyTorch
profiler on every rank. Prints, per figure, each kernel's median duration and
the median gap before it (from the end of the kernel before it), and the time
per call; writes rank 0's Chrome trace of the last figure beside --trace.

With --stamps (a build with the CMake option TURNOUT_LL_STAMPS, e.g.
``pip install . -Ccmake.define.TURNOUT_LL_STAMPS=ON``): eager FP8 dispatches,
each after the ranks meet on the GPU, and per step of the kernel the time
from its block's start and from the kernel's first block's start, the median
and the slowest block (medians over calls and ranks), read from the lines the
kernels print (src/kernels/low_latency/stamps.cuh); then the same for BF16
combines of one dispatch's handle.

    python scripts/low_latency_timeline.py [--ranks N] [--tokens T] [--hidden H] [--trace PATH]
    python scripts/low_latency_timeline.py --stamps [--calls C] [--ranks N] [--tokens T] [--hidden H]
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Callable

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


# Each kernel's steps, in stamps.cuh's numbering (None: a number it does not use).
STEPS = {
    "dispatch": ["start", "call numbers read", "live set built", "first token's top-k and row in",
                 "first token's stores issued", "every token's stores issued", "arrivals added at peers",
                 "every source arrived", "counts scanned and written", None, "rows placed", "end"],
    "combine": ["start", "call numbers read", "live set and plan read", "weights published", "rows sent",
                "arrivals added at peers", "every expert rank arrived", "tokens reduced", None, None, None, "end"],
}
NUM_STEPS = 12
PHASES = {1: "send launch", 2: "receive launch", 3: "launch of both phases"}


def printed_by(fn: Callable) -> str:
    """What the GPU printed while ``fn`` ran: this process's stdout (fd 1) goes
    to a file until the device is synchronized and C's streams flushed."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            fn()
            torch.cuda.synchronize()
            ctypes.CDLL(None).fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read().decode(errors="replace")


def block_steps(lines: list, op: str = "dispatch") -> dict:
    """Per (call, phases) of kernel ``op``: per step, each block's
    microseconds from its own start and from the kernel's first block's start
    (the blocks that reached it)."""
    launches = defaultdict(list)
    for line in lines:
        f = line.split()
        if len(f) != 8 + NUM_STEPS - 1 or f[1] != op:
            continue
        call, block, phases, start, end = int(f[3]), int(f[4]), int(f[5]), int(f[6]), int(f[7])
        launches[(call, phases)].append((block, start, end, [0] + [int(c) for c in f[8:]]))
    out = {}
    for key, blocks in launches.items():
        t0 = min(b[1] for b in blocks)
        # SM cycles a nanosecond: the blocks' clocks against the global timer.
        rates = [b[3][-1] / (b[2] - b[1]) for b in blocks if b[2] - b[1] > 2000 and b[3][-1] > 0]
        if not rates:
            continue
        rate = statistics.median(rates)
        steps = []
        for k in range(NUM_STEPS):
            own = [b[3][k] / rate / 1e3 for b in blocks if b[3][k] >= 0]
            kernel = [(b[1] - t0) / 1e3 + b[3][k] / rate / 1e3 for b in blocks if b[3][k] >= 0]
            steps.append((own, kernel))
        out[key] = {"steps": steps, "span_us": (max(b[2] for b in blocks) - t0) / 1e3, "blocks": len(blocks)}
    return out


# (figure, kernel, the bench's builder of the figure's call: run when the
# figure starts, as a combine's handle must come from a recent dispatch)
STAMPED = [
    ("dispatch FP8", "dispatch", lambda s: bench.dispatch_parts(s, True)[0]),
    ("combine BF16", "combine", lambda s: bench.combine_parts(s, False)[0]),
]


def measure_stamps(rank: int, world_size: int, tokens: int, hidden: int, calls: int) -> dict:
    torch.manual_seed(rank)
    s = bench.Setup(world_size, tokens=tokens, hidden=hidden, experts=288, topk=8)
    results = {}
    for figure, op, build in STAMPED:
        built = []

        def warm_up():
            built.append(build(s))
            for _ in range(3):
                built[0]()

        def run():
            for _ in range(calls):
                s.aligned_start()
                built[0]()

        printed_by(warm_up)  # its kernels' lines, apart from the timed calls'
        text = printed_by(run)
        s.buffer.check_errors()
        results[figure] = block_steps([line for line in text.splitlines() if line.startswith("turnout-stamps ")], op)
    return results


def report_stamps(per_rank: list) -> None:
    for figure, op, _ in STAMPED:
        report_figure(figure, STEPS[op], [r[figure] for r in per_rank])


def report_figure(figure: str, steps: list, per_rank: list) -> None:
    phases = sorted({key[1] for r in per_rank for key in r})
    if not phases:
        print(f"{figure}: no stamps: build with -Ccmake.define.TURNOUT_LL_STAMPS=ON")
        return
    for ph in phases:
        launches = [v for r in per_rank for key, v in r.items() if key[1] == ph]
        spans = [v["span_us"] for v in launches]
        print(f"== {figure}, {PHASES.get(ph, ph)}: {len(launches)} launches over {len(per_rank)} ranks, "
              f"{launches[0]['blocks']} blocks; kernel span (first block's start to last block's end) "
              f"median {statistics.median(spans):.2f} us, max {max(spans):.2f}")
        print(f"  {'step':34s} {'from the block start':>24s} {'from the kernel start':>24s}   (median / slowest block)")
        for k, name in enumerate(steps):
            if name is None:
                continue
            own = [(statistics.median(v["steps"][k][0]), max(v["steps"][k][0])) for v in launches if v["steps"][k][0]]
            ker = [(statistics.median(v["steps"][k][1]), max(v["steps"][k][1])) for v in launches if v["steps"][k][1]]
            if not own:
                continue
            a = f"{statistics.median(o[0] for o in own):7.2f} / {statistics.median(o[1] for o in own):7.2f} us"
            b = f"{statistics.median(o[0] for o in ker):7.2f} / {statistics.median(o[1] for o in ker):7.2f} us"
            print(f"  {name:34s} {a:>24s} {b:>24s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--trace", default="")
    parser.add_argument("--stamps", action="store_true", help="step times from a TURNOUT_LL_STAMPS build")
    parser.add_argument("--calls", type=int, default=10, help="with --stamps: dispatches to stamp")
    args = parser.parse_args()
    print(f"tokens {args.tokens}, hidden {args.hidden}, top-8 of 288 experts")
    if args.stamps:
        report_stamps(run_on_local_gpus(measure_stamps, (args.tokens, args.hidden, args.calls), args.ranks, "nccl"))
        return
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
