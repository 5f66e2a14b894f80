"""The ceiling bench's table and plot keep its copy methods apart: a line per
method, each with its own SM counts and figures; the plain store kernel's
warp splits are lines of their own, by warps a GPU, and the rows with eight
words a lane in flight one more for each of stores and loads, the loads'
rows with sixteen one more again."""
from turnout.bench import report
from turnout.bench.ceiling import COLUMNS, DEEP_WORDS, DEEPEST_LOAD_WORDS, METHODS, WARPS, WORDS, plot_series


def row(method, num_sms, warps, gbps, shared, split=False, words=WORDS):
    return {"bench": "ceiling", "method": method, "num_sms": num_sms, "warps_per_block": warps,
            "words_in_flight": words if warps else None, "warp_split": split,
            "bytes_per_gpu": 3 << 28, "time_us": 1.0, "gbps": gbps, "gbps_min": gbps, "gbps_max": gbps,
            "gbps_gpu": 4 * gbps, "ranks_on_gpu": 4 if shared else 1, "pct_of_raw": None, "ranks_share_gpus": shared}


def rows_of(shared: bool, splits=()):
    rows = []
    for m, method in enumerate(METHODS):
        for num_sms in (12, 24):
            rows.append(row(method, num_sms, None if method == "bulk copies" else WARPS, 100.0 * (m + 1) + num_sms,
                            shared))
    rows += [row(METHODS[0], num_sms, warps, 300.0 + num_sms, shared, True) for num_sms, warps in splits]
    return rows


def test_a_line_per_copy_method():
    panel = plot_series(rows_of(shared=False))
    assert [label for label, _, _ in panel["series"]] == list(METHODS)
    (_, sms_x, stores), (_, bulk_x, bulk), (_, loads_x, loads) = panel["series"]
    assert sms_x == bulk_x == loads_x == [12, 24] == panel["x"]
    assert stores == [112.0, 124.0] and bulk == [212.0, 224.0] and loads == [312.0, 324.0]
    assert panel["ref"][1] == "NVLink raw"


def test_ranks_sharing_a_gpu_plot_the_gpu_figure():
    panel = plot_series(rows_of(shared=True))
    assert panel["series"][1][2] == [4 * 212.0, 4 * 224.0]
    assert "ref" not in panel


def test_the_table_names_the_method():
    table = report.format_table(rows_of(shared=False), COLUMNS)
    lines = table.splitlines()
    assert "copy" in lines[0]
    assert sum("bulk copies" in line for line in lines) == 2 and sum("sm stores" in line for line in lines) == 2
    assert sum("sm loads" in line for line in lines) == 2


def test_warp_splits_are_lines_by_warps_a_gpu_not_the_methods_points():
    panel = plot_series(rows_of(shared=False, splits=((6, 32), (24, 8), (6, 16), (24, 4))))
    lines = {label: (x, y) for label, x, y in panel["series"]}
    assert lines[METHODS[0]] == ([12, 24], [112.0, 124.0]), "the method's line keeps its own warps a block"
    # 192 warps: 6 x 32, the method's own 12 x 16, 24 x 8; 96 warps: 6 x 16 and 24 x 4.
    assert lines["sm stores, 192 warps a GPU"] == ([6, 12, 24], [306.0, 112.0, 324.0])
    assert lines["sm stores, 96 warps a GPU"] == ([6, 24], [306.0, 324.0])
    table = report.format_table(rows_of(shared=False, splits=((6, 32),)), COLUMNS)
    assert "warps/SM" in table.splitlines()[0] and any(" 32 " in line for line in table.splitlines())


def test_deep_rows_are_a_line_of_their_own_not_the_methods_or_a_splits_points():
    # The deep row at 12 SMs has 192 warps a GPU too: it must not join that line.
    deep = [row(METHODS[0], num_sms, WARPS, 500.0 + num_sms, False, words=DEEP_WORDS) for num_sms in (12, 24)]
    panel = plot_series(rows_of(shared=False, splits=((6, 32), (24, 8))) + deep)
    lines = {label: (x, y) for label, x, y in panel["series"]}
    assert lines[METHODS[0]] == ([12, 24], [112.0, 124.0])
    assert lines["sm stores, 192 warps a GPU"] == ([6, 12, 24], [306.0, 112.0, 324.0])
    assert lines[f"sm stores, {DEEP_WORDS} words a lane in flight"] == ([12, 24], [512.0, 524.0])
    assert f"sm loads, {DEEP_WORDS} words a lane in flight" not in lines
    table = report.format_table(rows_of(shared=False) + deep, COLUMNS)
    assert "words/lane" in table.splitlines()[0]
    assert sum(f" {DEEP_WORDS} " in line for line in table.splitlines()) == 2


def test_loads_are_lines_of_their_own_never_a_stores_split_or_deep_line():
    # 12 SMs x 16 warps is 192 warps a GPU, as the stores' split line counts them.
    deep = [row(method, num_sms, WARPS, base + num_sms, False, words=DEEP_WORDS)
            for method, base in ((METHODS[0], 500.0), (METHODS[2], 700.0)) for num_sms in (12, 24)]
    panel = plot_series(rows_of(shared=False, splits=((6, 32), (24, 8))) + deep)
    lines = {label: (x, y) for label, x, y in panel["series"]}
    assert lines[METHODS[2]] == ([12, 24], [312.0, 324.0])
    assert lines["sm stores, 192 warps a GPU"] == ([6, 12, 24], [306.0, 112.0, 324.0])
    assert lines[f"sm stores, {DEEP_WORDS} words a lane in flight"] == ([12, 24], [512.0, 524.0])
    assert lines[f"sm loads, {DEEP_WORDS} words a lane in flight"] == ([12, 24], [712.0, 724.0])


def test_the_loads_deepest_rows_are_a_line_of_their_own():
    rows = rows_of(shared=False)
    rows += [row(METHODS[2], num_sms, WARPS, 700.0 + num_sms, False, words=DEEP_WORDS) for num_sms in (12, 24)]
    rows += [row(METHODS[2], num_sms, WARPS, 900.0 + num_sms, False, words=DEEPEST_LOAD_WORDS) for num_sms in (12, 24)]
    lines = {label: (x, y) for label, x, y in plot_series(rows)["series"]}
    assert lines[METHODS[2]] == ([12, 24], [312.0, 324.0])
    assert lines[f"sm loads, {DEEP_WORDS} words a lane in flight"] == ([12, 24], [712.0, 724.0])
    assert lines[f"sm loads, {DEEPEST_LOAD_WORDS} words a lane in flight"] == ([12, 24], [912.0, 924.0])
