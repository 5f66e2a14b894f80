"""scripts/gpu_check.sh driven through a fake nvidia-smi and python3 (no GPU
here): its shared-GPU runs side by side, one GPU each, where the host has a
GPU for each rank count, else in turns on GPU 0; GRAPHS_OFF's second bench
with the calls one by one; and BASELINE's bench of an earlier tree, with this
tree's bench or its own."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_S = 1.0

FAKE_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu*) i=0; while [ $i -lt {gpus} ]; do echo "$i, Fake GPU, 80 GiB"; i=$((i + 1)); done ;;
  *) echo "fake topology" ;;
esac
"""

# Records each GPU-suite run: its ranks, CUDA_VISIBLE_DEVICES, start and end.
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = tests/gpu/run.py ]; then
  start=$(date +%s.%N)
  sleep {run_s}
  echo "$3 $CUDA_VISIBLE_DEVICES $start $(date +%s.%N)" >> "{record}"
  echo "GPU suite: $3 ranks"
  echo "5 passed, 0 failed, 0 skipped"
fi
exit 0
"""


def run_script(tmp_path: Path, gpus: int, shared_ranks: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "runs.txt"
    for name, text in (("nvidia-smi", FAKE_SMI.format(gpus=gpus)),
                       ("python3", FAKE_PYTHON.format(run_s=RUN_S, record=record))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out), SKIP_TEST_SH="1",
               SUITE_RANKS="", SHARED_RANKS=shared_ranks, BENCH_ARGS="none")
    env.pop("SUITE_ARGS", None)
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    runs = {}
    for line in record.read_text().splitlines():
        ranks, visible, start, end = line.split()
        runs[int(ranks)] = (visible, float(start), float(end))
    return runs, done.stdout


def overlap(a, b) -> bool:
    return a[1] < b[2] and b[1] < a[2]


@pytest.mark.parametrize("gpus", [3, 4])
def test_shared_runs_side_by_side_with_a_gpu_each(tmp_path, gpus):
    runs, stdout = run_script(tmp_path, gpus, "2 4 8")
    assert sorted(runs) == [2, 4, 8]
    assert [runs[n][0] for n in (2, 4, 8)] == ["0", "1", "2"]
    assert overlap(runs[2], runs[4]) and overlap(runs[4], runs[8]) and overlap(runs[2], runs[8])
    for gpu, n in enumerate((2, 4, 8)):
        assert f"GPU suite --ranks {n}, all on GPU {gpu}: exit 0 after" in stdout
    assert stdout.count("5 passed, 0 failed, 0 skipped") == 3


def test_shared_runs_in_turns_on_gpu_0_without_a_gpu_each(tmp_path):
    runs, stdout = run_script(tmp_path, 2, "2 4 8")
    assert sorted(runs) == [2, 4, 8]
    assert all(runs[n][0] == "0" for n in runs)
    assert not overlap(runs[2], runs[4]) and not overlap(runs[4], runs[8]) and not overlap(runs[2], runs[8])
    for n in (2, 4, 8):
        assert f"GPU suite --ranks {n}, all on GPU 0: exit 0" in stdout


# Records each bench run: TURNOUT_OP_GRAPHS (or "-") and its arguments.
FAKE_BENCH_PYTHON = """#!/bin/sh
if [ "$1" = -m ] && [ "$2" = turnout.bench ]; then
  echo "${{TURNOUT_OP_GRAPHS:--}} $*" >> "{record}"
fi
exit 0
"""


def bench_runs(tmp_path: Path, graphs_off: bool):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "bench.txt"
    for name, text in (("nvidia-smi", FAKE_SMI.format(gpus=1)), ("python3", FAKE_BENCH_PYTHON.format(record=record))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               SKIP_TEST_SH="1", SUITE_RANKS="", SHARED_RANKS="", BENCH_ARGS="host")
    env.pop("GRAPHS_OFF", None)
    if graphs_off:
        env["GRAPHS_OFF"] = "1"
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return record.read_text().splitlines(), done.stdout


def test_graphs_off_adds_a_bench_with_the_calls_one_by_one(tmp_path):
    runs, stdout = bench_runs(tmp_path, graphs_off=True)
    assert len(runs) == 2, runs
    assert runs[0].startswith("- -m turnout.bench host --json ") and runs[0].endswith("/bench.json")
    assert runs[1].startswith("0 -m turnout.bench host --json ") and runs[1].endswith("/bench-graphs-off.json")
    assert "graphs-off bench: 0" in stdout


def test_without_graphs_off_one_bench(tmp_path):
    runs, stdout = bench_runs(tmp_path, graphs_off=False)
    assert len(runs) == 1 and runs[0].startswith("- -m turnout.bench host"), runs
    assert "graphs-off bench: skipped" in stdout


# Installs a fake tree (`pip install --target`): its bench marked as its own. Records each bench run:
# whose bench ran ("own" or "this") and its arguments.
FAKE_BASELINE_PYTHON = """#!/bin/sh
if [ "$1" = -m ] && [ "$2" = pip ]; then
  while [ $# -gt 0 ]; do [ "$1" = --target ] && target=$2; shift; done
  mkdir -p "$target/turnout/bench" && touch "$target/turnout/bench/own"
elif [ "$1" = -m ] && [ "$2" = turnout.bench ]; then
  whose=this; [ -n "$PYTHONPATH" ] && [ -f "$PYTHONPATH/turnout/bench/own" ] && whose=own
  echo "${{PYTHONPATH:--}} $whose $*" >> "{record}"
fi
exit 0
"""


def baseline_runs(tmp_path: Path, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "bench.txt"
    for name, text in (("nvidia-smi", FAKE_SMI.format(gpus=1)),
                       ("python3", FAKE_BASELINE_PYTHON.format(record=record))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               SKIP_TEST_SH="1", SUITE_RANKS="", SHARED_RANKS="", BENCH_ARGS="intranode host --bind-cpus",
               BASELINE=str(earlier), **extra)
    for name in ("GRAPHS_OFF", "RINGS", "BASELINE_OWN_BENCH", "BASELINE_BENCH_ARGS"):
        if name not in extra:
            env.pop(name, None)
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [line.split(" ", 2) for line in record.read_text().splitlines()], done.stdout


def test_baseline_runs_this_trees_bench_over_the_earlier_library(tmp_path):
    runs, stdout = baseline_runs(tmp_path)
    assert len(runs) == 2, runs
    site, whose, args = runs[0]
    assert site != "-" and whose == "this", runs[0]
    assert args.startswith("-m turnout.bench intranode host --bind-cpus --json "), args
    assert args.endswith("/bench-baseline.json"), args
    assert runs[1][0] == "-" and runs[1][2].endswith("/bench.json"), runs[1]
    assert "baseline bench: exit 0" in stdout


def test_baseline_with_its_own_bench_and_arguments(tmp_path):
    runs, stdout = baseline_runs(tmp_path, BASELINE_OWN_BENCH="1", BASELINE_BENCH_ARGS="intranode layout")
    assert len(runs) == 2, runs
    site, whose, args = runs[0]
    assert site != "-" and whose == "own", runs[0]
    assert args.startswith("-m turnout.bench intranode layout --json ") and args.endswith("/bench-baseline.json")
    assert runs[1][0] == "-" and runs[1][2].startswith("-m turnout.bench intranode host --bind-cpus --json ")
    assert "baseline bench: exit 0" in stdout
