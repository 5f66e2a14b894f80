"""layout: get_dispatch_layout for 4096 tokens x top-8 of 256 experts, as a CUDA
graph (the GPU time), call by call as a training step sees it (CUDA events
around each eager call, L2 flushed before), eager calls back to back between
two events (host-bound: the host's time per call, as DeepEP's tests time it),
plus a sweep over the token count.

The op is local to a rank, so ranks that share a GPU take turns: otherwise a
rank's timed call would also time the other ranks' 256 MB flushes and calls
running beside it, which a rank with a GPU of its own never sees."""
import statistics
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..launch import gpus_shared, run_on_local_gpus
from .progress import Progress
from .report import column, range_column
from .timing import merge_ranks, time_back_to_back, time_each, time_graph

TITLE = "layout: get_dispatch_layout, top-8 of 256 experts (median over ranks; target 15 us at 4096 tokens)"

COLUMNS = [
    column("tokens", "tokens"),
    column("topk", "topk"),
    column("experts", "experts"),
    column("mode", "mode"),
    column("time us", "time_us", "{:.2f}"),
    range_column("us over ranks", "time_us", "{:.2f}"),
    column("target us", "target_us", "{:.0f}"),
]

NUM_EXPERTS, NUM_TOPK = 256, 8
MAIN_TOKENS = 4096
SWEEP_TOKENS = (128, 1024, 4096, 8192)
TARGET_US = 15.0
# An eager call may cost at most this much over the kernel-only (graph) figure.
PER_CALL_SLACK_US = 10.0
# DeepEP's get_dispatch_layout back to back on 4x H200 (2026-11-26): the figure to stay under.
DEEPEP_BACK_TO_BACK_US = 38.0
BACK_TO_BACK_CALLS = 200
CALLS_PER_GRAPH = 100
FLUSH_BYTES = 256 << 20  # well past the 50 MB L2


def routing(num_tokens: int) -> torch.Tensor:
    """Uniform load, as in docs/PERFORMANCE.md: the top-k of ``randn().abs() + 1`` scores."""
    scores = torch.randn(num_tokens, NUM_EXPERTS, device="cuda").abs() + 1
    return scores.topk(NUM_TOPK, dim=-1).indices


def row(num_tokens: int, mode: str, time_us: float, target_us: Optional[float] = None) -> Dict:
    if target_us is None and num_tokens == MAIN_TOKENS:
        target_us = TARGET_US
    return {"bench": "layout", "tokens": num_tokens, "topk": NUM_TOPK, "experts": NUM_EXPERTS, "mode": mode,
            "time_us": time_us, "target_us": target_us}


def measure(rank: int, world_size: int, quick: bool, take_turns: bool) -> List[Dict]:
    """One rank's layout times (run in every rank's process)."""
    buffer = Buffer(dist.group.WORLD)
    if not take_turns:
        return measure_alone(rank, buffer, quick)
    rows = []
    for turn in range(world_size):
        dist.barrier()
        if turn == rank:
            rows = measure_alone(rank, buffer, quick)
            torch.cuda.synchronize()
    dist.barrier()
    return rows


def measure_alone(rank: int, buffer: Buffer, quick: bool) -> List[Dict]:
    replays = 3 if quick else 10
    warmup, iters = (10, 50) if quick else (50, 200)
    torch.manual_seed(rank)
    progress = Progress(len(SWEEP_TOKENS) + 2, "layout", enabled=rank == 0)
    rows = []
    for num_tokens in SWEEP_TOKENS:
        progress.step(f"{num_tokens} tokens, graph")
        topk_idx = routing(num_tokens)
        per_call = time_graph(lambda: buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS), CALLS_PER_GRAPH, replays)
        rows.append(row(num_tokens, "graph", per_call))
    graph_us = next(r["time_us"] for r in rows if r["tokens"] == MAIN_TOKENS)

    # Each eager call between CUDA events, the L2 flushed before it: the GPU
    # time a training step loses to the call, host syncs included.
    progress.step(f"{MAIN_TOKENS} tokens, per call")
    topk_idx = routing(MAIN_TOKENS)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    times = time_each(lambda: buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS), iters, warmup, before=flush.zero_)
    rows.append(row(MAIN_TOKENS, "per call", statistics.median(times), graph_us + PER_CALL_SLACK_US))

    progress.step(f"{MAIN_TOKENS} tokens, back to back")
    calls = BACK_TO_BACK_CALLS // 4 if quick else BACK_TO_BACK_CALLS
    per_call = time_back_to_back(lambda: buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS), calls, warmup)
    rows.append(row(MAIN_TOKENS, "back to back", per_call, DEEPEP_BACK_TO_BACK_US))
    progress.close()
    return rows


def run(num_ranks: Optional[int], quick: bool) -> List[Dict]:
    shared = gpus_shared(num_ranks or torch.cuda.device_count())
    return merge_ranks(run_on_local_gpus(measure, (quick, shared), num_ranks, "nccl"), "time_us")


def plot_series(rows: List[Dict]) -> Dict:
    graph = [r for r in rows if r["mode"] == "graph"]
    return {"x": [r["tokens"] for r in graph], "y": [r["time_us"] for r in graph], "xlabel": "tokens per rank",
            "ylabel": "us per call (CUDA graph)", "ref": (TARGET_US, "target at 4096 tokens")}
