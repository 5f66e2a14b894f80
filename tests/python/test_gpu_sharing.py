"""Ranks sharing GPUs: round-robin placement, and the private MPS daemon's
start and stop, driven through a fake control binary (no GPU or driver here)."""
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import time

import pytest

from turnout import gpu_sharing

WAIT_S = 20.0

# Stands in for nvidia-cuda-mps-control: `-d` starts a detached "daemon" and
# writes its pid where the real one does; without arguments it reads one
# command from stdin, and `quit` stops the daemon. Every call is recorded.
FAKE_CONTROL = '''
import json, os, signal, subprocess, sys

MODE = {mode!r}
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
entry = {{"args": sys.argv[1:], "pipe": pipe, "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY"),
          "percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
          "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}}


def record():
    with open(os.environ["FAKE_MPS_RECORD"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


if sys.argv[1:] == ["-d"]:
    if MODE == "fail":
        record()
        sys.stderr.write("fake control: cannot start\\n")
        sys.exit(1)
    daemon = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    entry["pid"] = daemon.pid
    record()
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(daemon.pid))
    os.rename(pid_file + ".tmp", pid_file)
else:
    entry["command"] = sys.stdin.readline().strip()
    record()
    if entry["command"] == "quit" and MODE != "ignore_quit":
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGTERM)
'''

# Enters shared_gpus in a process of its own, which the test then signals.
# The module is loaded from its file so that the child need not import torch.
SIGNALED_CHILD = '''
import importlib.util, signal, sys, time

signal.signal(signal.SIGINT, signal.default_int_handler)
spec = importlib.util.spec_from_file_location("gpu_sharing", sys.argv[1])
gpu_sharing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_sharing)
with gpu_sharing.shared_gpus(2, 1) as placement:
    print(placement.daemon.pid, placement.daemon.folder, flush=True)
    time.sleep(60)
'''


def alive(pid: int) -> bool:
    """A zombie counts as gone: the fake daemon's reaper may be slow or absent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_soon(pid: int) -> bool:
    """A SIGKILLed process needs a moment to die after kill() returns."""
    deadline = time.monotonic() + WAIT_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def read_record(path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """Puts a fake control binary of the given mode first on PATH; returns its
    record file. Kills any daemon it started that a failing test left behind."""
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    monkeypatch.delenv(gpu_sharing.MPS_CONTROL_ENV, raising=False)

    def install(mode: str = "normal"):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        script = tmp_path / "fake_control.py"
        script.write_text(FAKE_CONTROL.format(mode=mode))
        control = bin_dir / gpu_sharing.MPS_CONTROL_NAME
        control.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(script))} "$@"\n')
        control.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        return record

    yield install
    for entry in read_record(record):
        if "pid" in entry and alive(entry["pid"]):
            os.kill(entry["pid"], signal.SIGKILL)


def test_device_for_rank_is_round_robin():
    assert [gpu_sharing.device_for_rank(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [gpu_sharing.device_for_rank(r, 1) for r in range(4)] == [0, 0, 0, 0]


@pytest.mark.parametrize("num_devices", [0, -1])
def test_device_for_rank_needs_a_device(num_devices):
    with pytest.raises(ValueError, match="num_devices"):
        gpu_sharing.device_for_rank(0, num_devices)


@pytest.mark.parametrize("num_ranks, num_devices, counts", [
    (5, 2, [3, 2]),
    (8, 1, [8]),
    (4, 4, [1, 1, 1, 1]),
    (2, 4, [1, 1, 0, 0]),
])
def test_ranks_per_device(num_ranks, num_devices, counts):
    assert gpu_sharing.ranks_per_device(num_ranks, num_devices) == counts


@pytest.mark.parametrize("ranks_on_gpu, share", [(1, "100"), (2, "50"), (3, "33.33"), (6, "16.66"), (8, "12.5")])
def test_sm_percentage_rounds_down_to_two_decimals(ranks_on_gpu, share):
    """MPS reads the share as a number: it must never add up to more than 100."""
    assert gpu_sharing.sm_percentage(ranks_on_gpu) == share


def test_placement_without_daemon_adds_no_environment():
    assert not gpu_sharing.SharedGpus(4, 4, None).shared
    placement = gpu_sharing.SharedGpus(5, 2, None)
    assert placement.shared
    assert placement.counts == [3, 2]
    assert [placement.device(r) for r in range(5)] == [0, 1, 0, 1, 0]
    assert all(placement.env(r) == {} for r in range(5))


def test_shared_gpus_needs_a_rank():
    with pytest.raises(ValueError, match="num_ranks"):
        with gpu_sharing.shared_gpus(0, 1):
            pass


def test_find_mps_control_env_wins(fake_mps, monkeypatch):
    """The variable beats PATH, and set empty it turns MPS off."""
    fake_mps()
    monkeypatch.setenv(gpu_sharing.MPS_CONTROL_ENV, "/opt/custom/mps-control")
    assert gpu_sharing.find_mps_control() == "/opt/custom/mps-control"
    monkeypatch.setenv(gpu_sharing.MPS_CONTROL_ENV, "")
    assert gpu_sharing.find_mps_control() is None


def test_find_mps_control_on_path(fake_mps, tmp_path):
    fake_mps()
    assert gpu_sharing.find_mps_control() == str(tmp_path / "bin" / gpu_sharing.MPS_CONTROL_NAME)


def test_find_mps_control_falls_back_to_driver_folder(tmp_path, monkeypatch):
    """Off PATH, the driver's folder is used only if an executable is there."""
    monkeypatch.delenv(gpu_sharing.MPS_CONTROL_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    driver = tmp_path / gpu_sharing.MPS_CONTROL_NAME
    monkeypatch.setattr(gpu_sharing, "DRIVER_MPS_CONTROL", str(driver))
    assert gpu_sharing.find_mps_control() is None
    driver.write_text("#!/bin/sh\n")
    driver.chmod(0o755)
    assert gpu_sharing.find_mps_control() == str(driver)


def test_daemon_serves_the_block_and_stops_after(fake_mps, monkeypatch):
    record = fake_mps()
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "70")
    with gpu_sharing.shared_gpus(4, 1) as placement:
        daemon = placement.daemon
        assert daemon is not None and daemon.running()
        pid, folder = daemon.pid, daemon.folder
        assert alive(pid)
        (start,) = read_record(record)
        assert start["args"] == ["-d"] and start["pid"] == pid
        assert start["percentage"] is None, "the daemon itself must not inherit a client's SM share"
        for directory in (daemon.pipe_directory, daemon.log_directory):
            assert os.path.isdir(directory)
            assert os.path.commonpath([folder, directory]) == folder
            assert not directory.startswith("/tmp/nvidia-mps")
        assert (start["pipe"], start["log"]) == (daemon.pipe_directory, daemon.log_directory)
        for r in range(4):
            assert placement.device(r) == 0
            assert placement.env(r) == {"CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_directory,
                                        "CUDA_MPS_LOG_DIRECTORY": daemon.log_directory,
                                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    assert not alive(pid)
    assert not os.path.exists(folder)
    assert not daemon.running()
    quit_call = read_record(record)[1]
    assert quit_call["command"] == "quit" and quit_call["pipe"] == start["pipe"]
    daemon.stop()
    assert len(read_record(record)) == 2, "a second stop() must not ask the control binary again"


def test_uneven_sharing_gives_each_gpu_its_own_share(fake_mps):
    """5 ranks on 2 GPUs: three share GPU 0, two share GPU 1."""
    fake_mps()
    with gpu_sharing.shared_gpus(5, 2) as placement:
        shares = [placement.env(r)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for r in range(5)]
    assert shares == ["33.33", "50", "33.33", "50", "33.33"]


@pytest.mark.parametrize("visible, renumbers", [
    (None, False), ("0", False), ("0,1,2", False), (" 0, 1", False), ("1", True), ("2,3", True), ("1,0", True),
    ("0,2", True), ("GPU-8f6b1c2d", False), ("MIG-1a2b3c4d", False), ("0,GPU-8f6b1c2d", False),
])
def test_server_renumbers_index_lists_other_than_the_first_gpus_in_order(visible, renumbers):
    assert gpu_sharing.server_renumbers(visible) is renumbers


@pytest.mark.parametrize("visible, daemon_sees",
                         [("1", None), ("2,3", None), ("0", "0"), ("GPU-8f6b1c2d", "GPU-8f6b1c2d")])
def test_daemon_sees_every_gpu_where_a_server_would_renumber_them(fake_mps, monkeypatch, visible, daemon_sees):
    """Ranks confined to GPU 1 by CUDA_VISIBLE_DEVICES: the MPS server would
    number that GPU 0 if the daemon inherited the list, and the ranks, which
    keep it, would find no GPU. Such a daemon starts without it; one given the
    first GPUs in order, or UUIDs, keeps it. The ranks' environment leaves the
    list as the caller set it."""
    record = fake_mps()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with gpu_sharing.shared_gpus(2, 1) as placement:
        (start,) = read_record(record)
        assert start["args"] == ["-d"]
        assert start["visible"] == daemon_sees
        assert all("CUDA_VISIBLE_DEVICES" not in placement.env(r) for r in range(2))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible


def test_daemon_stops_when_the_block_raises(fake_mps):
    record = fake_mps()
    with pytest.raises(RuntimeError, match="in the block"):
        with gpu_sharing.shared_gpus(4, 1) as placement:
            pid, folder = placement.daemon.pid, placement.daemon.folder
            raise RuntimeError("in the block")
    assert not alive(pid)
    assert not os.path.exists(folder)
    assert [e.get("command") for e in read_record(record)] == [None, "quit"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_daemon_stops_when_the_process_is_signaled(fake_mps, signum):
    """A job killed by its scheduler (SIGTERM) or by Ctrl-C (SIGINT) must not
    leave a daemon running on the GPU."""
    record = fake_mps()
    child = subprocess.Popen([sys.executable, "-c", SIGNALED_CHILD, gpu_sharing.__file__],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = folder = None
    try:
        ready, _, _ = select.select([child.stdout], [], [], WAIT_S)
        assert ready, f"the child did not enter the block within {WAIT_S:.0f} s"
        line = child.stdout.readline().split()
        assert len(line) == 2, f"unexpected child output {line}; stderr: {child.stderr.read()}"
        pid, folder = int(line[0]), line[1]
        assert alive(pid) and os.path.isdir(folder)
        child.send_signal(signum)
        _, err = child.communicate(timeout=WAIT_S)
        if signum == signal.SIGTERM:
            assert child.returncode == 128 + signal.SIGTERM, err
        assert not alive(pid), err
        assert not os.path.exists(folder), err
        assert read_record(record)[-1]["command"] == "quit"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=WAIT_S)
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_no_daemon_when_no_gpu_is_shared(fake_mps):
    record = fake_mps()
    with gpu_sharing.shared_gpus(2, 2) as placement:
        assert placement.daemon is None
        assert placement.env(0) == {} and placement.env(1) == {}
    assert not record.exists()


def test_without_binary_ranks_time_slice_and_say_so_once(monkeypatch):
    monkeypatch.setenv(gpu_sharing.MPS_CONTROL_ENV, "")
    said = []
    with gpu_sharing.shared_gpus(4, 1, say=said.append) as placement:
        assert placement.daemon is None
        assert placement.counts == [4]
        assert placement.env(3) == {}
    assert len(said) == 1
    assert "no MPS control binary" in said[0] and "time-slice" in said[0]


def test_failed_start_still_runs_the_block(fake_mps):
    """A daemon that does not start costs speed, not the run."""
    record = fake_mps("fail")
    said = []
    ran = False
    with gpu_sharing.shared_gpus(4, 1, say=said.append) as placement:
        ran = True
        assert placement.daemon is None
        assert placement.env(0) == {}
    assert ran
    assert len(said) == 1
    assert "did not start" in said[0] and "exited with 1" in said[0] and "cannot start" in said[0]
    (start,) = read_record(record)
    assert not os.path.exists(os.path.dirname(start["pipe"])), "the failed daemon's folder was left behind"


def test_missing_binary_still_runs_the_block(tmp_path, monkeypatch):
    monkeypatch.setenv(gpu_sharing.MPS_CONTROL_ENV, str(tmp_path / "no-such-control"))
    said = []
    with gpu_sharing.shared_gpus(2, 1, say=said.append) as placement:
        assert placement.daemon is None
    assert len(said) == 1 and "did not start" in said[0]


def test_daemon_that_ignores_quit_is_killed(fake_mps, monkeypatch):
    record = fake_mps("ignore_quit")
    monkeypatch.setattr(gpu_sharing, "STOP_TIMEOUT_S", 1.0)
    with gpu_sharing.shared_gpus(2, 1) as placement:
        pid, folder = placement.daemon.pid, placement.daemon.folder
        began = time.monotonic()
    took = time.monotonic() - began
    assert gone_soon(pid)
    assert not os.path.exists(folder)
    assert read_record(record)[-1]["command"] == "quit"
    assert took < 10.0, f"stop() took {took:.1f} s with a 1 s timeout"
