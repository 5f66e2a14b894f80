"""The bench looks for other processes on its GPUs (a foreign workload makes
every figure too slow) through nvidia-smi: here a fake nvidia-smi, first on
PATH, prints given lines. Quiet GPUs give no warning; a foreign process is
named in the header's warning and in the JSON; the bench's own processes and
other GPUs' are left out; an MPS server alone is a labelled note; a missing,
failing, hanging or garbled nvidia-smi gives "unknown", never an exception."""
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from turnout.bench import __main__ as bench_main
from turnout.bench import gpu_processes, report
from turnout.gpu_sharing import process_alive

GPU0 = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
GPU1 = "GPU-9f8e7d6c-0000-1111-2222-333344445555"
# Far above any pid this test's process tree can have.
FOREIGN_PID = 4100001
OTHER_PID = 4100002
MPS_PID = 4100003


def fake_nvidia_smi(tmp_path, monkeypatch, body):
    """An ``nvidia-smi`` running the shell ``body``, first on PATH; it logs its
    arguments to ``args.txt``."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/args.txt"\n{body}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "args.txt"


def printing(tmp_path, monkeypatch, *lines):
    """A fake nvidia-smi that prints ``lines``, exit status 0."""
    (tmp_path / "answer.txt").write_text("".join(line + "\n" for line in lines))
    return fake_nvidia_smi(tmp_path, monkeypatch, f'cat "{tmp_path}/answer.txt"')


def line(gpu, pid, mib, name):
    return f"{gpu}, {pid}, {mib}, {name}"


def test_quiet_gpus_give_no_warning(tmp_path, monkeypatch):
    args = printing(tmp_path, monkeypatch)
    seen = gpu_processes.query({os.getpid()})
    assert seen == []
    assert gpu_processes.report_lines(seen, "start") == []
    assert "--query-compute-apps=gpu_uuid,pid,used_memory,process_name" in args.read_text()


def test_some_nvidia_smi_say_no_running_processes_found(tmp_path, monkeypatch):
    printing(tmp_path, monkeypatch, "No running processes found")
    assert gpu_processes.query({os.getpid()}) == []


def test_foreign_process_is_named_in_the_warning(tmp_path, monkeypatch):
    printing(tmp_path, monkeypatch, line(GPU0, FOREIGN_PID, 1200, "/usr/bin/python3"))
    seen = gpu_processes.query({os.getpid()})
    assert seen == [{"pid": FOREIGN_PID, "name": "/usr/bin/python3", "used_mib": 1200, "gpu": GPU0,
                     "mps_server": False}]
    [warning] = gpu_processes.report_lines(seen, "start")
    assert warning.startswith("WARNING: other processes ran on these GPUs during the benchmark: ")
    assert f"{FOREIGN_PID} /usr/bin/python3 1200 MiB" in warning
    assert "the figures may be too slow" in warning and "start" in warning


def test_own_processes_are_left_out(tmp_path, monkeypatch):
    # A child with a child of its own: a rank and, say, a compile worker of it.
    child = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    try:
        own = gpu_processes.own_pids()
        assert {os.getpid(), child.pid, grandchild} <= own and os.getppid() not in own
        printing(tmp_path, monkeypatch, line(GPU0, os.getpid(), 500, "python"), line(GPU0, child.pid, 900, "sh"),
                 line(GPU1, grandchild, 900, "sleep"), line(GPU0, FOREIGN_PID, 1200, "python"))
        seen = gpu_processes.query(own)
    finally:
        os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()
        child.stdout.close()
    assert [p["pid"] for p in seen] == [FOREIGN_PID]


def test_only_the_bench_gpus_count(tmp_path, monkeypatch):
    printing(tmp_path, monkeypatch, line(GPU0, FOREIGN_PID, 1200, "python"), line(GPU1, OTHER_PID, 800, "python"))
    # torch gives the UUID without nvidia-smi's "GPU-" prefix.
    assert [p["pid"] for p in gpu_processes.query(set(), [GPU1[4:].upper()])] == [OTHER_PID]
    assert [p["pid"] for p in gpu_processes.query(set(), None)] == [FOREIGN_PID, OTHER_PID]


def test_mps_server_alone_is_a_labelled_note_not_the_warning(tmp_path, monkeypatch):
    printing(tmp_path, monkeypatch, line(GPU0, MPS_PID, 30, "nvidia-cuda-mps-server"))
    seen = gpu_processes.query(set())
    assert seen[0]["mps_server"] is True
    [note] = gpu_processes.report_lines(seen, "start")
    assert "WARNING" not in note and f"{MPS_PID} nvidia-cuda-mps-server 30 MiB (MPS server)" in note


def test_mps_server_beside_a_workload_is_labelled_in_the_warning(tmp_path, monkeypatch):
    printing(tmp_path, monkeypatch, line(GPU0, MPS_PID, 30, "/usr/bin/nvidia-cuda-mps-server"),
             line(GPU0, FOREIGN_PID, "[N/A]", "python, the job"))
    seen = gpu_processes.query(set())
    [warning] = gpu_processes.report_lines(seen, "start")
    assert warning.startswith("WARNING:")
    assert f"{MPS_PID} /usr/bin/nvidia-cuda-mps-server 30 MiB (MPS server)" in warning
    # Memory nvidia-smi does not know, and a name holding a comma.
    assert f"{FOREIGN_PID} python, the job ? MiB" in warning


@pytest.mark.parametrize("body, why", [
    ("echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9",
     "exited with code 9: NVIDIA-SMI has failed"),
    ("echo 'Field \"gpu_uuid\" is not a valid field to query.'", "unexpected nvidia-smi output"),
])
def test_failing_or_unreadable_nvidia_smi_is_unknown(tmp_path, monkeypatch, body, why):
    fake_nvidia_smi(tmp_path, monkeypatch, body)
    seen = gpu_processes.query(set())
    assert isinstance(seen, str) and seen.startswith("unknown (") and why in seen
    assert gpu_processes.report_lines(seen, "end") == [f"other processes on these GPUs at the end: {seen}"]
    assert gpu_processes.foreign_workloads(seen) == []


def test_missing_nvidia_smi_is_unknown(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_processes.query(set()) == "unknown (nvidia-smi not found)"


def test_hanging_nvidia_smi_is_unknown_within_its_timeout(tmp_path, monkeypatch):
    # Not exec'd: the sleep, a child, holds the output pipe after the shell is killed.
    fake_nvidia_smi(tmp_path, monkeypatch, f'sleep 30 & echo $! > "{tmp_path}/sleep.pid"; wait')
    start = time.monotonic()
    seen = gpu_processes.query(set(), timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert seen == "unknown (nvidia-smi did not answer within 0.5 s)"
    # Its whole process group went, the sleep too.
    sleeper = int((tmp_path / "sleep.pid").read_text())
    deadline = time.monotonic() + 5
    while process_alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(sleeper)


def fake_subcommand(tmp_path):
    """A subcommand of one row that, while it runs, lets the fake nvidia-smi
    list a second foreign process."""
    def run(num_ranks, quick):
        printing_more = (tmp_path / "answer.txt").read_text() + line(GPU1, OTHER_PID, 700, "stray") + "\n"
        (tmp_path / "answer.txt").write_text(printing_more)
        return [{"figure": "pair", "time_us": 68.0}]
    return types.SimpleNamespace(TITLE="fake", COLUMNS=[report.column("figure", "figure")], run=run)


def test_bench_header_and_json_name_the_foreign_process(tmp_path, monkeypatch, capsys):
    printing(tmp_path, monkeypatch, line(GPU0, os.getpid(), 500, "python"), line(GPU0, FOREIGN_PID, 1200, "python"))
    machine = {"gpus": ["H100"] * 2, "count": 2, "torch": "x", "cuda": "x", "ranks": 2, "ranks_share_gpus": False,
               "gpus_label": "H100"}
    monkeypatch.setattr(report, "machine_info", lambda ranks: machine)
    monkeypatch.setattr(gpu_processes, "bench_gpus", lambda ranks, count: [GPU0, GPU1])
    monkeypatch.setitem(sys.modules, "turnout.bench.ceiling", fake_subcommand(tmp_path))
    out = tmp_path / "bench.json"
    assert bench_main.main(["ceiling", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    # The header, above the table: the process seen at the start only.
    assert printed[0].startswith("WARNING: other processes ran on these GPUs")
    assert printed[0].endswith("(seen at the start)")
    assert f"{FOREIGN_PID} python 1200 MiB" in printed[0] and str(OTHER_PID) not in printed[0]
    assert printed.index("fake") > 0
    # After the tables: both.
    [end] = [text for text in printed if text.endswith("(seen at the end)")]
    assert printed.index(end) > printed.index("fake") and f"{OTHER_PID} stray 700 MiB" in end
    doc = json.loads(out.read_text())["other_gpu_processes"]
    assert doc["gpus"] == [GPU0, GPU1]
    assert [p["pid"] for p in doc["start"]] == [FOREIGN_PID]
    assert [(p["pid"], p["name"], p["used_mib"]) for p in doc["end"]] == [(FOREIGN_PID, "python", 1200),
                                                                         (OTHER_PID, "stray", 700)]


def test_bench_without_nvidia_smi_says_unknown_and_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    machine = {"gpus": ["H100"], "count": 1, "torch": "x", "cuda": None, "ranks": 4, "ranks_share_gpus": True,
               "gpus_label": "H100"}
    monkeypatch.setattr(report, "machine_info", lambda ranks: machine)
    monkeypatch.setitem(sys.modules, "turnout.bench.ceiling", types.SimpleNamespace(
        TITLE="fake", COLUMNS=[report.column("figure", "figure")], run=lambda num_ranks, quick: []))
    out = tmp_path / "bench.json"
    assert bench_main.main(["ceiling", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "other processes on these GPUs at the start: unknown (nvidia-smi not found)" in printed
    assert "WARNING" not in printed
    doc = json.loads(out.read_text())["other_gpu_processes"]
    assert doc == {"gpus": "all", "start": "unknown (nvidia-smi not found)", "end": "unknown (nvidia-smi not found)"}


def test_bench_without_a_gpu_says_so_once_and_runs_nothing(tmp_path, monkeypatch, capsys):
    machine = {"gpus": [], "count": 0, "torch": "x", "cuda": None, "ranks": 4, "ranks_share_gpus": True,
               "gpus_label": ""}
    monkeypatch.setattr(report, "machine_info", lambda ranks: machine)

    def run(num_ranks, quick):
        raise AssertionError("a subcommand ran without a GPU")
    monkeypatch.setitem(sys.modules, "turnout.bench.ceiling", types.SimpleNamespace(
        TITLE="fake", COLUMNS=[report.column("figure", "figure")], run=run))
    out = tmp_path / "bench.json"
    assert bench_main.main(["ceiling", "--json", str(out)]) == 2
    printed = capsys.readouterr()
    assert printed.err.count("no CUDA device is visible") == 1 and "Traceback" not in printed.err
    assert printed.out == ""
    assert not out.exists()
