"""CUDA-event timing and the merge of every rank's figures, shared by the
subcommands."""
import statistics
from typing import Callable, Dict, List, Optional


def time_each(fn: Callable[[], object], iters: int, warmup: int,
              before: Optional[Callable[[], object]] = None) -> List[float]:
    """Times each of ``iters`` calls of ``fn`` on its own with CUDA events on the
    current stream, in microseconds. ``before`` runs ahead of every call
    (warm-ups too), outside the timed region."""
    import torch

    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def time_graph(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Microseconds per call of ``fn``, from a CUDA graph of ``calls``
    back-to-back calls replayed ``replays`` times: the GPU time without the
    host's launch cost between calls."""
    import torch

    # Eager calls first: lazy initialization must not happen during capture.
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on a side stream of its own
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def merge_ranks(per_rank: List[List[Dict]], key: str) -> List[Dict]:
    """Every rank returns the same rows in the same order; one row per
    measurement comes back, with ``key`` the median over ranks and
    ``<key>_min`` / ``<key>_max`` beside it."""
    merged = []
    for rows in zip(*per_rank):
        values = [row[key] for row in rows]
        row = dict(rows[0])
        row.update({key: statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values),
                    "ranks": len(values)})
        merged.append(row)
    return merged
