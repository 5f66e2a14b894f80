"""Binding a rank to its GPU's CPUs (turnout.cpu_binding) and the bench's
per-rank record of it, without a GPU: a stand-in sysfs tree and affinity."""
import os

import pytest

from turnout import cpu_binding
from turnout.bench.__main__ import parse_args
from turnout.bench.timing import merge_ranks


@pytest.mark.parametrize("text, cpus", [("0-3", [0, 1, 2, 3]), ("0-1,8,10-11\n", [0, 1, 8, 10, 11]),
                                        ("5", [5]), ("2,0-1", [0, 1, 2])])
def test_cpu_lists_parse_and_format_back(text, cpus):
    assert cpu_binding.parse_cpu_list(text) == cpus
    assert cpu_binding.parse_cpu_list(cpu_binding.format_cpu_list(cpus)) == cpus


def test_format_joins_runs():
    assert cpu_binding.format_cpu_list([5, 0, 1, 2, 9, 10]) == "0-2,5,9-10"
    assert cpu_binding.format_cpu_list([]) == ""
    assert cpu_binding.allowed_cpus() == cpu_binding.format_cpu_list(os.sched_getaffinity(0))


def test_a_backward_range_is_refused():
    with pytest.raises(ValueError, match="runs backwards"):
        cpu_binding.parse_cpu_list("4-2")


def test_local_cpus_read_sysfs(tmp_path):
    device = tmp_path / "0000:1b:00.0"
    device.mkdir()
    (device / "local_cpulist").write_text("0-3,64-67\n")
    assert cpu_binding.local_cpus("0000:1b:00.0", str(tmp_path)) == [0, 1, 2, 3, 64, 65, 66, 67]
    assert cpu_binding.local_cpus("0000:2c:00.0", str(tmp_path)) is None
    (device / "local_cpulist").write_text("garbage")
    assert cpu_binding.local_cpus("0000:1b:00.0", str(tmp_path)) is None


def test_bind_keeps_to_the_allowed_local_cpus(monkeypatch):
    before = os.sched_getaffinity(0)
    allowed = sorted(before)
    # A GPU whose local CPUs are the first allowed one and one that does not exist.
    monkeypatch.setattr(cpu_binding, "gpu_local_cpus", lambda device: [allowed[0], max(allowed) + 1000])
    try:
        assert cpu_binding.bind_to_gpu(0) == [allowed[0]]
        assert os.sched_getaffinity(0) == {allowed[0]}
    finally:
        os.sched_setaffinity(0, before)
    # Unknown, or none of them allowed: nothing changes.
    for local in (None, [max(allowed) + 1000]):
        monkeypatch.setattr(cpu_binding, "gpu_local_cpus", lambda device, local=local: local)
        assert cpu_binding.bind_to_gpu(0) is None
        assert os.sched_getaffinity(0) == before


def test_merged_rows_keep_every_rank():
    per_rank = [[{"op": "a", "time_us": t, "cpus": c}] for t, c in ((3.0, "0-3"), (9.0, "4-7"), (4.0, "0-3"))]
    row, = merge_ranks(per_rank, "time_us", listed=("cpus",))
    assert row["time_us"] == 4.0 and row["time_us_min"] == 3.0 and row["time_us_max"] == 9.0
    assert row["time_us_by_rank"] == [3.0, 9.0, 4.0]
    assert row["cpus_by_rank"] == ["0-3", "4-7", "0-3"] and "cpus" not in row
    assert row["ranks"] == 3


def test_bench_flag():
    assert parse_args(["low_latency", "--bind-cpus"]).bind_cpus
    assert not parse_args(["low_latency"]).bind_cpus
