"""scripts/intranode_stamps.py: the reading of the intranode warps' stamp
lines (src/kernels/intranode/warp_stamps.cuh's format) and their summary, on
made-up lines whose times are known."""
import re

import pytest
from script_modules import load_script


@pytest.fixture(scope="module")
def stamps():
    return load_script("intranode_stamps")


def line(role, warp, rows, start_ns, end_ns, cycles, op="dispatch", peer=1):
    return (f"turnout-intranode-stamps {op} {role} 0 3 {warp} {peer} {rows} {start_ns} {end_ns} "
            + " ".join(str(c) for c in cycles))


def test_parts_in_microseconds_from_each_lines_own_clock(stamps):
    # Warp 0 runs 2 cycles a ns for 10 us; warp 1 runs 1 cycle a ns for 4 us.
    lines = [line("send", 0, 5, 1000, 11000, [2000, 4000, 8000, 2000, 4000]),
             line("send", 1, 2, 0, 4000, [400, 0, 3000, 100, 500]),
             "some other output", line("send", 2, 1, 0, 10, [1, 2, 3])]
    warps = stamps.parse(lines)
    assert [w["warp"] for w in warps] == [0, 1]
    assert warps[0]["parts_us"] == pytest.approx([1.0, 2.0, 4.0, 1.0, 2.0])
    assert warps[0]["total_us"] == pytest.approx(10.0)
    assert warps[1]["parts_us"] == pytest.approx([0.4, 0.0, 3.0, 0.1, 0.5])
    assert (warps[1]["rows"], warps[1]["peer"], warps[1]["channel"]) == (2, 1, 3)


def test_a_span_too_short_to_time_takes_the_others_rate(stamps):
    lines = [line("send", 0, 1, 0, 10000, [20000, 0, 0, 0, 0]), line("send", 1, 1, 0, 20000, [40000, 0, 0, 0, 0]),
             line("receive", 0, 1, 500, 1500, [600, 0, 600, 0, 0])]
    warps = stamps.parse(lines)
    assert warps[2]["parts_us"] == pytest.approx([0.3, 0.0, 0.3, 0.0, 0.0])


def test_summary_per_role(stamps):
    # At 1 cycle a ns: two send warps (10 and 20 us, 4 and 5 rows), a receive warp.
    lines = [line("send", 0, 4, 0, 10000, [1000, 1000, 6000, 1000, 1000]),
             line("send", 1, 5, 0, 20000, [2000, 6000, 8000, 2000, 2000]),
             line("receive", 2, 0, 0, 8000, [0, 8000, 0, 0, 0])]
    out = stamps.summarize(stamps.parse(lines))
    assert sorted(out) == ["receive", "send"]
    send = out["send"]
    assert send["warps"] == 2
    assert send["total_us"] == pytest.approx(15.0)
    assert send["share"] == pytest.approx([0.1, 7 / 30, 14 / 30, 0.1, 0.1])
    assert send["part_us"][2] == pytest.approx(7.0)
    assert send["us_per_row"] == pytest.approx((2.5 + 4.0) / 2)
    assert out["receive"]["us_per_row"] is None
    assert out["receive"]["share"][1] == pytest.approx(1.0)


def test_report_names_each_roles_parts(stamps, capsys):
    lines = [line("send", 0, 4, 0, 10000, [1000, 1000, 6000, 1000, 1000]),
             line("own", 1, 2, 0, 4000, [1000, 0, 3000, 0, 0], peer=0)]
    per_rank = [{(12, "dispatch bf16"): stamps.summarize(stamps.parse(lines))}, {(12, "dispatch bf16"): {}}]
    stamps.report(per_rank, 3)
    out = capsys.readouterr().out
    assert "== dispatch bf16, 12 SMs: 3 calls a rank, 2 ranks" in out
    assert "row loads and stores issued" in out and "60.0%" in out
    assert "own: 1 warps, median 2 rows and 4.0 us a warp, 2.00 us a row" in out
    assert "waiting for ring room" in out and "rows copied " in out


def test_report_names_the_reducers_parts(stamps, capsys):
    # At 1 cycle a ns: a reducer of 10 tokens in 5 us, 1 us of it waiting for tails.
    lines = [line("reduce", 0, 10, 0, 5000, [500, 1000, 3000, 250, 250], op="combine", peer=-1)]
    stamps.report([{(12, "combine bf16"): stamps.summarize(stamps.parse(lines))}], 3)
    out = capsys.readouterr().out
    assert "reduce: 1 warps, median 10 rows and 5.0 us a warp, 0.50 us a row" in out
    assert re.search(r"waiting for the rows' tails +20\.0%", out)
    assert re.search(r"rows loaded, summed and stored +60\.0%", out)
    assert "progress posted" in out and "part 4" not in out


def test_report_says_how_to_build_when_no_line_came(stamps, capsys):
    stamps.report([{(24, "combine bf16"): {}}], 3)
    assert "TURNOUT_INTRANODE_STAMPS=ON" in capsys.readouterr().out
