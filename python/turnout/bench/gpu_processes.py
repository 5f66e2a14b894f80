"""The compute processes on the bench's GPUs that are not the bench's own.

Why: a bench run that shares its GPUs with another workload (ranks left over
from a killed test run, someone else's job) time-slices with it, and its
figures come out several times to a hundred times too slow, with nothing in
the tables to say so. So the bench looks before it runs and again after it
finishes, warns in its header when another process is there, and records what
it saw in its JSON.

What is seen comes from ``nvidia-smi --query-compute-apps``, run with a short
timeout. Where nvidia-smi is missing, fails, hangs or prints what this module
cannot read, the answer is "unknown (why)", never an exception: the check must
not cost a run. The bench's own processes (this one and its descendants: the
ranks while they live) are left out. An MPS server (``nvidia-cuda-mps-server``)
runs its clients' kernels, which nvidia-smi lists as processes of their own,
so a server alone is no workload: it is listed, labelled, without the warning.

Limits: nvidia-smi gives host pids; in a container with a PID namespace of its
own they may not match this process tree's, so a process of the bench's own
could be listed as another's (at the two moments of the check the ranks have
exited, so only the bench's main process could be). Processes that start and
end between the two checks are not seen.
"""
import contextlib
import os
import shutil
import signal
import subprocess
from typing import Dict, List, Optional, Set, Union

NVIDIA_SMI = "nvidia-smi"
# Process name last: a name may hold a comma, and nvidia-smi does not quote.
FIELDS = ("gpu_uuid", "pid", "used_memory", "process_name")
QUERY = [f"--query-compute-apps={','.join(FIELDS)}", "--format=csv,noheader,nounits"]
TIMEOUT_S = 10.0
MPS_SERVER = "nvidia-cuda-mps-server"
#: What some nvidia-smi versions print instead of no line at all.
NO_PROCESSES = "no running processes found"

#: The processes seen (each a dict: pid, name, used_mib or None, gpu, mps_server),
#: or "unknown (why)".
Snapshot = Union[List[Dict], str]


def own_pids() -> Set[int]:
    """This process and all its descendants, from /proc (this process alone
    where there is no /proc)."""
    me = os.getpid()
    children: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {me}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # The name, in parentheses, may hold spaces and parentheses: the state and the parent come after
                # the last ")".
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or unreadable
        children.setdefault(ppid, []).append(int(entry))
    found, todo = {me}, [me]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def normalize_uuid(uuid: str) -> str:
    """A GPU UUID as nvidia-smi (``GPU-8f6b...``) and torch (``8f6b...``) both give it."""
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def bench_gpus(num_ranks: int, num_devices: int) -> Optional[List[str]]:
    """The UUIDs of the GPUs the ranks run on (round-robin over the visible
    ones), or None where they cannot be told: then every GPU counts. MIG
    instances are not told apart from their GPU by nvidia-smi's listing, so
    under MIG every GPU counts too."""
    if num_devices < 1 or "MIG" in os.environ.get("CUDA_VISIBLE_DEVICES", ""):
        return None
    try:
        import torch

        return [normalize_uuid(str(torch.cuda.get_device_properties(i).uuid))
                for i in range(min(num_ranks, num_devices))]
    except Exception:  # an old torch without .uuid, a driver that will not say
        return None


def parse_memory(text: str) -> Optional[int]:
    """MiB from ``1200`` or ``1200 MiB``; None for ``[N/A]`` (MIG, some containers)."""
    text = text.strip()
    if text.endswith("MiB"):
        text = text[:-3].strip()
    return int(text) if text.isdigit() else None


def parse(output: str) -> Optional[List[Dict]]:
    """The processes of nvidia-smi's answer to ``QUERY``; None where a line
    is not one of them (another nvidia-smi's format, an error message)."""
    processes = []
    for line in output.splitlines():
        if not line.strip() or line.strip().lower().rstrip(".") == NO_PROCESSES:
            continue
        fields = [field.strip() for field in line.split(",", len(FIELDS) - 1)]
        if len(fields) != len(FIELDS) or not fields[1].isdigit():
            return None
        gpu, pid, memory, name = fields
        processes.append({"pid": int(pid), "name": name, "used_mib": parse_memory(memory), "gpu": gpu,
                          "mps_server": os.path.basename(name) == MPS_SERVER})
    return processes


def run_nvidia_smi(timeout_s: float) -> Union[str, Exception]:
    """nvidia-smi's output to ``QUERY``, or why there is none (as an exception,
    not raised). On a timeout its whole process group is killed, so a child
    holding the pipe does not keep this waiting."""
    path = shutil.which(NVIDIA_SMI)
    if path is None:
        return FileNotFoundError(f"{NVIDIA_SMI} not found")
    try:
        proc = subprocess.Popen([path] + QUERY, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except OSError as e:
        return e
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        # One stuck in the driver may not die at once: not waited for beyond this.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)
        return TimeoutError(f"{NVIDIA_SMI} did not answer within {timeout_s:g} s")
    if proc.returncode != 0:
        said = (out.strip() or err.strip()).splitlines()
        return RuntimeError(f"{NVIDIA_SMI} exited with code {proc.returncode}" + (f": {said[0]}" if said else ""))
    return out


def query(own: Set[int], gpus: Optional[List[str]] = None, timeout_s: float = TIMEOUT_S) -> Snapshot:
    """The compute processes on ``gpus`` (UUIDs; None: every GPU) whose pid is
    not in ``own``, or "unknown (why)"."""
    output = run_nvidia_smi(timeout_s)
    if isinstance(output, Exception):
        return f"unknown ({output})"
    processes = parse(output)
    if processes is None:
        first = output.strip().splitlines()[0]
        return f"unknown (unexpected {NVIDIA_SMI} output: {first[:120]!r})"
    wanted = None if gpus is None else {normalize_uuid(uuid) for uuid in gpus}
    return [p for p in processes
            if p["pid"] not in own and (wanted is None or normalize_uuid(p["gpu"]) in wanted)]


def describe(process: Dict) -> str:
    """``pid name MiB``, an MPS server labelled as one."""
    mib = "?" if process["used_mib"] is None else process["used_mib"]
    return f"{process['pid']} {process['name']} {mib} MiB" + (" (MPS server)" if process["mps_server"] else "")


def foreign_workloads(snapshot: Snapshot) -> List[Dict]:
    """The processes of ``snapshot`` that run work of their own: all but MPS servers."""
    return [] if isinstance(snapshot, str) else [p for p in snapshot if not p["mps_server"]]


def report_lines(snapshot: Snapshot, when: str) -> List[str]:
    """What the bench prints about ``snapshot``, taken at ``when`` ("start",
    "end"): nothing on quiet GPUs; the warning when another workload is there
    (MPS servers named with it); a note for MPS servers alone; "unknown" where
    nvidia-smi could not tell."""
    if isinstance(snapshot, str):
        return [f"other processes on these GPUs at the {when}: {snapshot}"]
    if not snapshot:
        return []
    listed = ", ".join(describe(p) for p in snapshot)
    if foreign_workloads(snapshot):
        return [f"WARNING: other processes ran on these GPUs during the benchmark: {listed}; "
                f"the figures may be too slow (seen at the {when})"]
    return [f"note: an MPS server not of this run is on these GPUs, no workload by itself (seen at the {when}): "
            f"{listed}"]
