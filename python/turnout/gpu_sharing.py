"""Ranks that share a GPU: where each rank runs, and a private MPS daemon so
that their kernels run side by side.

Ranks go round-robin over the visible GPUs (rank ``r`` on GPU ``r % count``),
so a group of any size runs on any number of GPUs, down to one. When several
ranks share a GPU and the MPS control binary exists, ``shared_gpus`` starts an
MPS control daemon of its own (private pipe and log folders, never the
system's), gives each rank an equal share of its GPU's SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``), and stops the daemon when the block
ends, also on an exception, Ctrl-C or SIGTERM. Without the binary the ranks
time-slice the GPU: still correct, slower.

The binary is ``$TURNOUT_MPS_CONTROL`` if set (empty: never use MPS), else
``nvidia-cuda-mps-control`` on ``PATH``, else the driver's usual folder.
"""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional

MPS_CONTROL_ENV = "TURNOUT_MPS_CONTROL"
MPS_CONTROL_NAME = "nvidia-cuda-mps-control"
DRIVER_MPS_CONTROL = "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 20.0


def device_for_rank(rank: int, num_devices: int) -> int:
    """The GPU of ``rank``: round-robin over ``num_devices``."""
    if num_devices < 1:
        raise ValueError(f"device_for_rank: num_devices must be >= 1, got {num_devices}")
    return rank % num_devices


def ranks_per_device(num_ranks: int, num_devices: int) -> List[int]:
    """How many of ``num_ranks`` ranks land on each of ``num_devices`` GPUs."""
    counts = [0] * num_devices
    for rank in range(num_ranks):
        counts[device_for_rank(rank, num_devices)] += 1
    return counts


def find_mps_control() -> Optional[str]:
    """The MPS control binary, or None where there is none (or MPS is turned off)."""
    forced = os.environ.get(MPS_CONTROL_ENV)
    if forced is not None:
        return forced or None
    found = shutil.which(MPS_CONTROL_NAME)
    if found:
        return found
    return DRIVER_MPS_CONTROL if os.access(DRIVER_MPS_CONTROL, os.X_OK) else None


def sm_percentage(ranks_on_gpu: int) -> str:
    """Each rank's equal share of its GPU, as MPS reads it (two decimals, rounded down)."""
    return f"{int(10000 / ranks_on_gpu) / 100:g}"


def server_renumbers(visible: Optional[str]) -> bool:
    """Whether an MPS server given this ``CUDA_VISIBLE_DEVICES`` would number
    its GPUs other than the host does: a list of indices other than 0, 1, ...
    in order. Its clients' indices count in the server's numbering, so ranks
    that keep such a list would find other GPUs, or none. UUIDs (``GPU-...``,
    ``MIG-...``) name the same devices either way."""
    if visible is None:
        return False
    parts = [part.strip() for part in visible.split(",")]
    return all(part.isdigit() for part in parts) and [int(part) for part in parts] != list(range(len(parts)))


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class MpsDaemon:
    """An MPS control daemon of this run's own: its pipe and log folders are a
    fresh temporary folder, so it never touches a system-wide daemon."""

    def __init__(self, control: str) -> None:
        self.control = control
        self.folder: Optional[str] = None
        self.pid: Optional[int] = None
        self.started = False  # `-d` succeeded: a daemon may run even before its pid is known

    @property
    def pipe_directory(self) -> str:
        return os.path.join(self.folder, "pipe")

    @property
    def log_directory(self) -> str:
        return os.path.join(self.folder, "log")

    def _env(self) -> Dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_directory, "CUDA_MPS_LOG_DIRECTORY": self.log_directory}

    def start(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="turnout-mps-")
        os.makedirs(self.pipe_directory)
        os.makedirs(self.log_directory)
        env = dict(os.environ, **self._env())
        env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
        # A server limited to GPU 1 shows it to its clients as GPU 0, so ranks
        # that keep CUDA_VISIBLE_DEVICES=1 would find none. Such a server sees
        # every GPU instead (it holds a small context, about 66 MiB, on each)
        # and each rank keeps the list it was given, which then names the same
        # GPUs whether or not the rank reaches the server.
        if server_renumbers(env.get("CUDA_VISIBLE_DEVICES")):
            del env["CUDA_VISIBLE_DEVICES"]
        try:
            done = subprocess.run([self.control, "-d"], env=env, capture_output=True, text=True,
                                  timeout=START_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{self.control} -d exited with {done.returncode}: {done.stderr.strip()}")
            self.started = True
            pid_file = os.path.join(self.pipe_directory, PID_FILE)
            deadline = time.monotonic() + START_TIMEOUT_S
            while not os.path.exists(pid_file):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.control} -d started no daemon within {START_TIMEOUT_S:.0f} s "
                                       f"(no {pid_file})")
                time.sleep(0.02)
            self.pid = self._read_pid(pid_file, deadline)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _read_pid(pid_file: str, deadline: float) -> int:
        while True:
            with open(pid_file) as f:
                text = f.read().strip()
            if text:
                try:
                    return int(text)
                except ValueError:
                    raise RuntimeError(f"{pid_file} holds {text!r}, not a process id") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{pid_file} stayed empty")
            time.sleep(0.02)

    def client_env(self, ranks_on_gpu: int) -> Dict[str, str]:
        """The environment of a rank that shares its GPU with ``ranks_on_gpu - 1`` others."""
        return dict(self._env(), CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=sm_percentage(ranks_on_gpu))

    def stop(self) -> None:
        """Asks the daemon to quit (it stops its server first), waits for it, and
        removes the folders; kills it if it does not go. Safe to call twice."""
        if self.folder is None:
            return
        try:
            if self.started:
                # `quit` goes through the pipe folder: it reaches a daemon whose pid was never read.
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run([self.control], input="quit\n", env=dict(os.environ, **self._env()),
                                   capture_output=True, text=True, timeout=STOP_TIMEOUT_S)
            if self.pid is not None:
                deadline = time.monotonic() + STOP_TIMEOUT_S
                while process_alive(self.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if process_alive(self.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGKILL)
                    deadline = time.monotonic() + 5.0
                    while process_alive(self.pid) and time.monotonic() < deadline:
                        time.sleep(0.02)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
            self.started = False

    def running(self) -> bool:
        return self.pid is not None and self.folder is not None and process_alive(self.pid)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals_raise(*signums: int) -> Iterator[None]:
    """Each of ``signums`` ends the block through SystemExit(128 + signum), so
    its cleanup runs (main thread only). tests/gpu/run.py's too."""
    if not _main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in signums}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def _stop_undisturbed(daemon: MpsDaemon) -> None:
    """Stops the daemon with SIGINT and SIGTERM held off, so a second Ctrl-C
    cannot leave it running; a signal that came meanwhile is raised after."""
    if not _main_thread():
        daemon.stop()
        return
    caught = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        daemon.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        raise KeyboardInterrupt if caught[0] == signal.SIGINT else SystemExit(128 + caught[0])


class SharedGpus:
    """What ``shared_gpus`` yields: each rank's GPU and extra environment."""

    def __init__(self, num_ranks: int, num_devices: int, daemon: Optional[MpsDaemon]) -> None:
        self.num_ranks = num_ranks
        self.num_devices = num_devices
        self.counts = ranks_per_device(num_ranks, num_devices)
        self.daemon = daemon

    @property
    def shared(self) -> bool:
        """True when some GPU holds more than one rank."""
        return max(self.counts) > 1

    def device(self, rank: int) -> int:
        return device_for_rank(rank, self.num_devices)

    def env(self, rank: int) -> Dict[str, str]:
        """Variables to set in rank's process before it touches CUDA."""
        if self.daemon is None:
            return {}
        return self.daemon.client_env(self.counts[self.device(rank)])


@contextlib.contextmanager
def shared_gpus(num_ranks: int, num_devices: int,
                say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)
                ) -> Iterator[SharedGpus]:
    """Places ``num_ranks`` ranks on ``num_devices`` GPUs; while the block runs,
    an MPS daemon of its own serves them if any GPU holds several ranks."""
    if num_ranks < 1:
        raise ValueError(f"shared_gpus: num_ranks must be >= 1, got {num_ranks}")
    placement = SharedGpus(num_ranks, num_devices, None)
    if not placement.shared:
        yield placement
        return
    most = max(placement.counts)
    control = find_mps_control()
    if control is None:
        say(f"turnout: up to {most} ranks share a GPU and no MPS control binary was found "
            f"({MPS_CONTROL_NAME}; set {MPS_CONTROL_ENV}): the ranks time-slice the GPU, which is slower")
        yield placement
        return
    daemon: Optional[MpsDaemon] = MpsDaemon(control)
    with signals_raise(signal.SIGTERM):
        try:
            daemon.start()
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            say(f"turnout: up to {most} ranks share a GPU; the MPS daemon did not start ({e}): "
                f"the ranks time-slice the GPU, which is slower")
            daemon = None
        if daemon is None:
            yield placement
            return
        try:
            yield SharedGpus(num_ranks, num_devices, daemon)
        finally:
            _stop_undisturbed(daemon)
