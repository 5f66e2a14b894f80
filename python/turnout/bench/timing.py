"""CUDA-event timing and the merge of every rank's figures, shared by the
subcommands."""
import statistics
from typing import Callable, Dict, List, Optional, Sequence


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


def time_back_to_back(fn: Callable[[], object], calls: int, warmup: int) -> float:
    """Microseconds per call of ``calls`` eager calls of ``fn`` issued back to
    back between two CUDA events, nothing flushed or synced in between: where
    the host is slower than the GPU, this is the host's time per call (how
    DeepEP's tests time get_dispatch_layout)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def time_parts(parts: Sequence[Callable[[], object]], iters: int, warmup: int,
               before: Optional[Callable[[], object]] = None,
               between: Optional[Callable[[], object]] = None) -> List[List[float]]:
    """Runs ``parts`` in order ``iters`` times and times each part on its own
    with CUDA events on the current stream (a send, then its receive hook,
    each with its own figure); microseconds, one list per part. ``before``
    runs ahead of every round and ``between`` between two parts of a round,
    both outside the timed regions (warm-ups too)."""
    import torch

    def one_round(events) -> None:
        if before is not None:
            before()
        for i, part in enumerate(parts):
            if i and between is not None:
                between()
            if events:
                events[i][0].record()
            part()
            if events:
                events[i][1].record()

    for _ in range(warmup):
        one_round(None)
    rounds = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in parts]
              for _ in range(iters)]
    for events in rounds:
        one_round(events)
    torch.cuda.synchronize()
    return [[events[i][0].elapsed_time(events[i][1]) * 1e3 for events in rounds] for i in range(len(parts))]


def merge_ranks(per_rank: List[List[Dict]], *keys: str, listed: Sequence[str] = ()) -> List[Dict]:
    """Every rank returns the same rows in the same order; one row per
    measurement comes back, with each of ``keys`` the median over ranks,
    ``<key>_min`` / ``<key>_max`` beside it and every rank's value in rank
    order in ``<key>_by_rank`` (a key a row lacks or holds as None is left as
    it is). A key of ``listed`` present in a row becomes ``<key>_by_rank``
    only."""
    merged = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        for key in keys:
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                row.update({key: statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values),
                            f"{key}_by_rank": [r.get(key) for r in rows]})
        for key in listed:
            if key in row:
                row[f"{key}_by_rank"] = [r.get(key) for r in rows]
                del row[key]
        row["ranks"] = len(rows)
        merged.append(row)
    return merged
