"""The low-latency bench's targets and verdicts on made-up merged rows (no GPU):
each target is judged only where TARGETS.md sets it, and GPU times of ranks
sharing a GPU are labelled."""
from turnout.bench.low_latency import PROTOCOL, SHARED_LABEL, finish, make_row, plot_series, title

GPU = make_row("gpu", "dispatch FP8", "graph x20", time_us=14.0)
HOOK = make_row("gpu", "dispatch FP8, hook: send", "graph x1", time_us=3.0)
HOST = make_row("host", "dispatch FP8", "perf_counter_ns", time_us=16.0)
WIRE = make_row("wire", "dispatch FP8", "from topk_idx", ours_bytes=660, ref_bytes=1000, ratio=0.66)


def judged(num_ranks, shared=False, **shape):
    rows = [dict(r, **dict(PROTOCOL, **shape)) for r in (GPU, HOOK, HOST, WIRE)]
    return {r["figure"]: r for r in finish(rows, num_ranks, shared)}


def test_targets_at_their_rank_counts():
    at4 = judged(4)
    assert (at4["dispatch FP8"]["target"], at4["dispatch FP8"]["verdict"]) == ("<= 15 us (EP4)", "met")
    assert (at4["host: dispatch FP8"]["target"], at4["host: dispatch FP8"]["verdict"]) == ("<= 15 us", "not met")
    assert (at4["wire: dispatch FP8"]["target"], at4["wire: dispatch FP8"]["verdict"]) == ("<= 0.5 (EP4, EP8)",
                                                                                           "not met")
    assert (at4["dispatch FP8, hook: send"]["target"], at4["dispatch FP8, hook: send"]["verdict"]) == (None, "-")
    at8 = judged(8)
    assert at8["dispatch FP8"]["verdict"] == "n/a at EP8"
    assert at8["wire: dispatch FP8"]["verdict"] == "not met"
    at2 = judged(2)
    assert at2["wire: dispatch FP8"]["verdict"] == "n/a at EP2"
    assert at2["host: dispatch FP8"]["verdict"] == "not met"


def test_shared_gpu_labels_gpu_times_only():
    rows = judged(4, shared=True)
    assert rows["dispatch FP8"]["verdict"] == "met (shared GPU)"
    assert rows["dispatch FP8"]["label"] == SHARED_LABEL
    assert "label" not in rows["wire: dispatch FP8"] and rows["wire: dispatch FP8"]["verdict"] == "not met"
    merged = list(rows.values())
    assert title(merged).endswith(SHARED_LABEL)
    times, wire = plot_series(merged)
    assert SHARED_LABEL in times["title"] and SHARED_LABEL not in wire["title"]
    assert not title(list(judged(4).values())).endswith(SHARED_LABEL)


def test_other_shapes_judge_host_time_only():
    rows = judged(4, tokens=64)
    assert rows["dispatch FP8"]["verdict"] == rows["wire: dispatch FP8"]["verdict"] == "n/a: not the protocol's shape"
    assert rows["host: dispatch FP8"]["verdict"] == "not met"
