"""The GPU suite's runner (tests/gpu/run.py) reads its ranks' reports through
one thread per rank, so the reports of different ranks arrive in any order.
Driven here with made-up reports, no GPU or worker process. Then its
processes: signaled or killed, the run leaves no worker or test job behind
(driven with stand-in workers, still no GPU)."""
import os
import queue
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from turnout.gpu_sharing import process_alive

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ROOT / "tests" / "gpu"
sys.path.insert(0, str(GPU_TESTS))
import run  # noqa: E402  (tests/gpu/run.py)

TESTS = [("mod", "test_a", 5.0), ("mod", "test_b", 5.0), ("mod", "test_c", 5.0)]
WAIT_S = 20.0
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal (prctl) and /proc are Linux's")


class Placement:
    daemon = None


def start(rank, test):
    return rank, {"event": "start", "test": test}


def end(rank, test, **extra):
    return rank, dict({"event": "end", "test": test, "ok": True, "seconds": 0.0, "checks": 1}, **extra)


def exit_(rank, code=0):
    return rank, {"event": "exit", "code": code}


def results(monkeypatch, reports, tests=TESTS, world_size=2):
    def launch(world_size, tests_arg, start_index, placement):
        events = queue.Queue()
        for item in reports:
            events.put(item)
        return [], events

    monkeypatch.setattr(run, "launch", launch)
    return [(name, status, message) for name, status, _, message in run.run_tests(tests, world_size, Placement())]


def test_a_rank_ahead_by_two_tests_is_held_back_not_lost(monkeypatch):
    # Rank 1's reader lags: rank 0's reports of tests b and c arrive before
    # rank 1's report of test a ends.
    reports = [start(0, 0), end(0, 0), start(0, 1), end(0, 1), start(0, 2), end(0, 2),
               start(1, 0), end(1, 0), start(1, 1), end(1, 1), start(1, 2), end(1, 2), exit_(0), exit_(1)]
    got = results(monkeypatch, reports)
    assert [(name, status) for name, status, _ in got] == [
        ("mod::test_a", "PASS"), ("mod::test_b", "PASS"), ("mod::test_c", "PASS")], got


def test_a_skip_reported_early_still_counts(monkeypatch):
    reports = [start(1, 0), end(1, 0), start(1, 1), end(1, 1, skipped="no second GPU"), start(0, 0), end(0, 0),
               start(0, 1), end(0, 1, skipped="no second GPU"), start(0, 2), end(0, 2), start(1, 2), end(1, 2)]
    got = results(monkeypatch, reports)
    assert [status for _, status, _ in got] == ["PASS", "SKIP", "PASS"], got
    assert got[1][2] == "no second GPU"


def test_an_exit_names_the_rank_and_its_last_report(monkeypatch):
    reports = [start(0, 0), start(1, 0), end(0, 0), exit_(1, code=0)]
    got = results(monkeypatch, reports, tests=TESTS[:1])
    (name, status, message), = got
    assert status == "FAIL"
    assert "rank 1 exited with code 0" in message and "start of test 0" in message, message


@pytest.mark.parametrize("checks, status", [(0, "FAIL"), (3, "PASS")])
def test_a_test_whose_ranks_checked_nothing_fails(monkeypatch, checks, status):
    reports = [start(0, 0), start(1, 0), end(0, 0, checks=0), end(1, 0, checks=checks)]
    (_, got, message), = results(monkeypatch, reports, tests=TESTS[:1])
    assert got == status, message


def run_with_workers(monkeypatch, reports, argv):
    """run_tests over TESTS[:1] with two ranks, each worker a process of ``argv``; the workers."""
    workers = []

    def launch(world_size, tests_arg, start_index, placement):
        workers.extend(run.start_worker(argv) for _ in range(world_size))
        events = queue.Queue()
        for item in reports:
            events.put(item)
        return workers, events

    monkeypatch.setattr(run, "launch", launch)
    got = [status for _, status, _, _ in run.run_tests(TESTS[:1], 2, Placement())]
    return got, workers


@linux_only
def test_workers_that_ran_every_test_leave_on_their_own(monkeypatch):
    # Killing them at once would cut their last barrier and teardown short.
    reports = [start(0, 0), start(1, 0), end(0, 0), end(1, 0)]
    got, workers = run_with_workers(monkeypatch, reports, ["sleep", "0.5"])
    assert got == ["PASS"] and [w.returncode for w in workers] == [0, 0]


@linux_only
def test_workers_of_a_failed_run_are_killed_at_once(monkeypatch):
    reports = [start(0, 0), start(1, 0), end(0, 0), end(1, 0, ok=False, error="boom")]
    started = time.monotonic()
    got, workers = run_with_workers(monkeypatch, reports, ["sleep", "60"])
    assert got == ["FAIL"] and [w.returncode for w in workers] == [-signal.SIGKILL] * 2
    assert time.monotonic() - started < WAIT_S


# The run's process, as far as its workers see it: it starts one worker the
# way run.py does, says the worker's pid, and waits to be killed.
PARENT = """
import sys, time
sys.path.insert(0, sys.argv[1])
import run
worker = run.start_worker([sys.executable, "-c", sys.argv[2], sys.argv[1]])
time.sleep(60)
"""

# A worker that starts a test job (in the worker's process group, as rank 0's
# subprocess.run does) and says both pids.
WORKER = """
import os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import run
run.die_with_parent(int(os.environ[run.PARENT_ENV]))
job = subprocess.Popen(["sleep", "60"])
print(os.getpid(), job.pid, flush=True)
time.sleep(60)
"""

# A worker that forks a child and sends it SIGTERM (as a test's own job may do
# to its processes): the child must die alone; the worker says how it did.
# The child says it runs first: a signal that lands in the fork itself is lost.
FORKING_WORKER = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import run
run.die_with_parent(int(os.environ[run.PARENT_ENV]))
ready_r, ready_w = os.pipe()
child = os.fork()
if child == 0:
    os.write(ready_w, b"!")
    time.sleep(60)
    os._exit(0)
os.read(ready_r, 1)
os.kill(child, signal.SIGTERM)
_, status = os.waitpid(child, 0)
print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}", flush=True)
"""

# run.py's main() with stand-ins for torch, the test discovery and the workers
# (a `sleep` started as run.py starts a worker, which never reports), so it
# waits on its first test until signaled; it says so once it waits, within
# run_tests' cleanup. The package is the checkout's gpu_sharing, not an
# installed wheel's: no GPU or build needed.
SIGNALED_RUN = """
import os, queue, sys, types
root = sys.argv[1]
turnout = types.ModuleType("turnout")
turnout.__path__ = [os.path.join(root, "python", "turnout")]
sys.modules["turnout"] = turnout
torch = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace(device_count=lambda: 1)
sys.modules["torch"] = torch
sys.path.insert(0, os.path.join(root, "tests", "gpu"))
import run


class Events(queue.Queue):
    def get(self, *args, **kwargs):
        print("waiting on worker", worker.pid, flush=True)
        return super().get(*args, **kwargs)


def launch(world_size, tests_arg, start, placement):
    global worker
    worker = run.start_worker(["sleep", "60"])
    return [worker], Events()


run.discover = lambda pattern, exclude="": [("mod", "test_a", 60.0)]
run.launch = launch
sys.argv = ["run.py", "--ranks", "1"]
sys.exit(run.main())
"""


def gone_soon(pid: int) -> bool:
    """Dying takes a moment after the signal; a zombie counts as gone."""
    deadline = time.monotonic() + WAIT_S
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not process_alive(pid)


def read_line(proc) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
    assert ready, f"no word from the process within {WAIT_S:.0f} s"
    return proc.stdout.readline()


def leave_nothing(proc, *pids) -> None:
    """A failed test's leftovers: the process (reaped) and any pid still alive."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=WAIT_S)
    for pid in pids:
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


@linux_only
def test_a_killed_run_takes_its_workers_and_their_jobs_along():
    """SIGKILL (a harness's limit) runs none of the run's cleanup: the kernel's
    parent-death signal must still end the worker and the job it started."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(GPU_TESTS), WORKER], stdout=subprocess.PIPE,
                              text=True)
    pids = []
    try:
        pids = [int(pid) for pid in read_line(parent).split()]
        assert len(pids) == 2 and all(process_alive(pid) for pid in pids), pids
        parent.kill()
        parent.wait(timeout=WAIT_S)
        worker, job = pids
        assert gone_soon(worker), "the worker outlived the run"
        assert gone_soon(job), "the worker's test job outlived the run"
    finally:
        leave_nothing(parent, *pids)


@linux_only
def test_a_worker_whose_parent_is_gone_exits_at_once():
    """A parent that died before the worker's prctl sends no signal: the worker
    must see that its parent is not the run's and leave."""
    script = f"import sys; sys.path.insert(0, {str(GPU_TESTS)!r}); import run; run.die_with_parent(-1); print('ran on')"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 1 and "ran on" not in out.stdout, out


@linux_only
def test_a_child_forked_from_a_worker_dies_alone_on_sigterm():
    """The worker's handler kills its whole group; a forked child inherits it
    and must not take the worker down with it."""
    worker = run.start_worker([sys.executable, "-c", FORKING_WORKER, str(GPU_TESTS)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        out, err = worker.communicate(timeout=WAIT_S)
        assert worker.returncode == 0, f"the worker died ({worker.returncode}); stderr: {err}"
        assert out.strip() == str(int(signal.SIGTERM)), out
    finally:
        leave_nothing(worker)


@linux_only
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signaled_run_kills_its_workers_and_says_so(signum):
    """`timeout` (SIGTERM) or a closed terminal (SIGHUP) ends run.py: its
    cleanup must still kill the workers' process groups, also in a run with
    no GPU shared, hence no MPS daemon (whose SIGTERM handler the run had)."""
    run_proc = subprocess.Popen([sys.executable, "-c", SIGNALED_RUN, str(ROOT)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        while True:
            line = read_line(run_proc)
            assert line, f"the run ended early; stderr: {run_proc.stderr.read()}"
            if line.startswith("waiting on worker "):
                worker = int(line.split()[-1])
                break
        assert process_alive(worker)
        run_proc.send_signal(signum)
        out, err = run_proc.communicate(timeout=WAIT_S)
        assert run_proc.returncode == 128 + signum, f"exit {run_proc.returncode}; stderr: {err}"
        assert f"GPU suite: ended by {signal.Signals(signum).name}" in out, out
        assert gone_soon(worker), "the worker outlived the run"
    finally:
        leave_nothing(run_proc, *([worker] if worker else []))
