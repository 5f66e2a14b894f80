"""The ceiling bench's table and plot keep its two copy methods apart: a line
per method, each with its own SM counts and figures."""
from turnout.bench import report
from turnout.bench.ceiling import COLUMNS, METHODS, plot_series


def rows_of(shared: bool):
    rows = []
    for m, method in enumerate(METHODS):
        for num_sms in (12, 24):
            gbps = 100.0 * (m + 1) + num_sms
            rows.append({"bench": "ceiling", "method": method, "num_sms": num_sms, "bytes_per_gpu": 3 << 28,
                         "time_us": 1.0, "gbps": gbps, "gbps_min": gbps, "gbps_max": gbps, "gbps_gpu": 4 * gbps,
                         "ranks_on_gpu": 4 if shared else 1, "pct_of_raw": None, "ranks_share_gpus": shared})
    return rows


def test_a_line_per_copy_method():
    panel = plot_series(rows_of(shared=False))
    assert [label for label, _, _ in panel["series"]] == list(METHODS)
    (_, sms_x, stores), (_, bulk_x, bulk) = panel["series"]
    assert sms_x == bulk_x == [12, 24] == panel["x"]
    assert stores == [112.0, 124.0] and bulk == [212.0, 224.0]
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
