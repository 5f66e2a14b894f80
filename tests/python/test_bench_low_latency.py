"""The low-latency bench's targets and verdicts on made-up merged rows (no GPU):
each target is judged only where TARGETS.md sets it, the long-running pair
against the fresh pair of the same run, and GPU times of ranks sharing a GPU
are labelled."""
from turnout.bench.low_latency import (
    EMULATED_LABEL,
    FORMATS,
    FRESH_PAIR,
    HOST_ONLY_FIGURES,
    LONG_PAIR,
    MIXED_CALLS,
    PROTOCOL,
    SHARED_LABEL,
    finish,
    make_row,
    plot_series,
    title,
)

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


def loop_rows(fresh_us, long_us, **shape):
    rows = [make_row("gpu", FRESH_PAIR, "events", time_us=fresh_us), make_row("gpu", LONG_PAIR, "events",
                                                                            time_us=long_us)]
    return [dict(r, **dict(PROTOCOL, **shape)) for r in rows]


def test_long_running_pair_is_judged_against_the_fresh_pair_of_the_same_run():
    fresh, within = finish(loop_rows(90.0, 99.5), 4, False)
    assert (fresh["target"], fresh["verdict"]) == (None, "-")
    assert within["target"] == f"<= {FRESH_PAIR} + 10 us"
    assert (within["target_value"], within["verdict"]) == (100.0, "met")
    _, beyond = finish(loop_rows(90.0, 100.5), 4, False)
    assert beyond["verdict"] == "not met"
    # Any rank count and shape: both figures come from the same run.
    _, at8 = finish(loop_rows(90.0, 120.0, tokens=64), 8, False)
    assert at8["verdict"] == "not met"
    _, shared = finish(loop_rows(300.0, 305.0), 8, True)
    assert shared["verdict"] == "met (shared GPU)" and shared["label"] == SHARED_LABEL
    alone, = finish(loop_rows(90.0, 95.0)[1:], 4, False)
    assert (alone["target_value"], alone["verdict"]) == (None, "-"), "without the fresh row there is no target"


def test_async_finish_host_rows_have_the_host_target():
    rows = [dict(make_row("host", op, "perf_counter_ns", time_us=us), **PROTOCOL)
            for (op, _, _), us in zip(HOST_ONLY_FIGURES, (12.0, 16.0))]
    judged_rows = finish(rows, 4, False)
    assert [r["figure"] for r in judged_rows] == ["host: dispatch FP8, async_finish",
                                                  "host: combine BF16, async_finish"]
    assert [(r["target"], r["verdict"]) for r in judged_rows] == [("<= 15 us", "met"), ("<= 15 us", "not met")]


def test_mixed_calls_make_every_format_and_kind():
    assert {fmt for fmt, _ in MIXED_CALLS} == set(FORMATS)
    assert {kind for _, kind in MIXED_CALLS} == {"plain", "hook", "async", "twice", "weights"}
    calls = sum({"hook": 4, "twice": 4}.get(kind, 2) for _, kind in MIXED_CALLS)
    assert calls == 32, calls


def test_declared_domains_label_gpu_times_and_judge_only_host_and_wire():
    wire = dict(WIRE, nvl_domain_size=2)
    rows = {r["figure"]: r for r in finish([dict(r, **PROTOCOL) for r in (GPU, HOST, wire)], 4, False)}
    assert rows["dispatch FP8"]["verdict"] == "n/a across domains"
    assert rows["dispatch FP8"]["label"] == EMULATED_LABEL
    assert rows["host: dispatch FP8"]["verdict"] == "not met" and "label" not in rows["host: dispatch FP8"]
    assert rows["wire: dispatch FP8"]["verdict"] == "not met"
    merged = list(rows.values())
    assert title(merged).endswith(f"2 domains of 2 ranks, {EMULATED_LABEL}")
    times, _ = plot_series(merged)
    assert EMULATED_LABEL in times["title"]
    # One domain holding every rank is no split: nothing changes.
    whole = [dict(r, **PROTOCOL) for r in (GPU, dict(WIRE, nvl_domain_size=4))]
    assert {r["figure"]: r for r in finish(whole, 4, False)}["dispatch FP8"]["verdict"] == "met"


def test_pair_loop_notes_the_spread_the_host_and_the_collections(monkeypatch):
    """pair_loop over stand-in events: the mean and the spread come from the
    events, and a collection made while the timed pairs are issued is counted
    (one made while warming up is not)."""
    import gc
    import types

    import turnout.bench.low_latency as bench

    times = iter([10.0, 30.0] + [20.0] * (bench.PAIR_LOOP - 2))

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            return next(times) / 1e3

    calls = []

    def pair_part(*args, **kwargs):
        calls.append(1)
        if len(calls) in (3, bench.PAIR_LOOP + 7):  # once warming up, once timed
            gc.collect()
        return (None, None, None)

    monkeypatch.setattr(bench.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "FLUSH_BYTES", 16)
    real_empty = bench.torch.empty
    monkeypatch.setattr(bench.torch, "empty", lambda n, dtype, device: real_empty(n, dtype=dtype))
    s = types.SimpleNamespace(dispatch=pair_part, combine=lambda handle: None)
    out = bench.pair_loop(s)
    assert len(calls) == 2 * bench.PAIR_LOOP
    assert (out["min_pair_us"], out["max_pair_us"]) == (10.0, 30.0)
    assert abs(out["time_us"] - 20.0) < 1e-9
    assert out["gc_collections"] == 1 and out["gc_us"] > 0
    assert out["host_us_per_pair"] > 0
    assert set(out) == {"time_us", *bench.PAIR_LOOP_DETAILS}
