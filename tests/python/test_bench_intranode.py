"""The intranode bench's chunk sweep: the best chunk of each op and SM count is
the fastest of its rows, named as such, and the plot over tokens keeps to the
bench's own chunk."""
from turnout.bench import report
from turnout.bench.intranode import CHUNK, CHUNK_SMS, COLUMNS, MAIN_SMS, MAIN_TOKENS, OPS, merge, plot_series


def row(op, tokens, num_sms, chunk, gbps):
    return {"bench": "intranode", "op": op, "tokens": tokens, "num_sms": num_sms, "sms_used": num_sms, "chunk": chunk,
            "time_us": 1e3 / gbps, "recv_tokens": 1000, "gbps": gbps}


def per_rank_rows(rank):
    rows = []
    for num_sms in CHUNK_SMS:
        for i, op in enumerate(OPS):
            # Op i is fastest at the chunk of index i + 1 (never the bench's own for op 0).
            for j, chunk in enumerate((4, 8, 16, 32)):
                rows.append(row(op, MAIN_TOKENS, num_sms, chunk, 200.0 + num_sms + (50.0 if j == i + 1 else j) + rank))
    for tokens in (1024, 2048):
        rows += [row(op, tokens, MAIN_SMS, CHUNK, 100.0 + tokens / 100) for op in OPS]
    # Host rows have no bandwidth and must not be picked.
    rows.append({"bench": "intranode", "op": "dispatch bf16 (host)", "tokens": MAIN_TOKENS, "num_sms": MAIN_SMS,
                 "sms_used": MAIN_SMS, "host_us": 9.0, "host_us_after_sync": 12.0})
    return rows


def test_best_chunk_is_the_fastest_row_of_each_op_and_sm_count():
    merged = merge([per_rank_rows(0), per_rank_rows(2)], shared=False)
    best = [r for r in merged if r["op"].endswith(", best chunk")]
    assert len(best) == len(OPS) * len(CHUNK_SMS)
    for r in best:
        op = r["op"].removesuffix(", best chunk")
        assert r["chunk"] == (4, 8, 16, 32)[OPS.index(op) + 1]
        assert r["gbps"] == 200.0 + r["num_sms"] + 50.0 + 1  # the median over the two ranks
        assert r["pct_of_raw"] is not None


def test_plot_over_tokens_keeps_to_the_bench_chunk():
    panel = plot_series(merge([per_rank_rows(0)], shared=False))
    for label, tokens, _ in panel["series"]:
        assert tokens == [1024, 2048, MAIN_TOKENS], label


def test_the_table_shows_the_chunk():
    table = report.format_table(merge([per_rank_rows(0)], shared=False), COLUMNS)
    assert "chunk" in table.splitlines()[0]
    assert sum("best chunk" in line for line in table.splitlines()) == len(OPS) * len(CHUNK_SMS)
