"""A rank's calls made from the CPUs nearest its GPU. The host's part of a call
(argument checks, allocations, launches, the driver's doorbell writes) runs
slower from a core on another NUMA node than the GPU's, and an unbound process
may move between nodes; binding each rank to its GPU's node makes host times
comparable between ranks and runs. Affinity is a thread's on Linux: what is
bound is the calling thread (a rank's main thread, which makes the calls) and
the threads it starts afterwards. Linux only (sysfs, sched_setaffinity)."""
import os
from typing import Iterable, List, Optional


def parse_cpu_list(text: str) -> List[int]:
    """The CPUs of a kernel CPU list such as ``0-15,32-47`` (sysfs's
    ``local_cpulist``), ascending."""
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"CPU list {text.strip()!r}: range {part!r} runs backwards")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The kernel's CPU list form of ``cpus``: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: List[List[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def local_cpus(pci_address: str, sysfs: str = "/sys/bus/pci/devices") -> Optional[List[int]]:
    """The CPUs local to the PCI device at ``pci_address`` (``0000:1b:00.0``)
    as the kernel lists them, or None where the list cannot be read."""
    try:
        with open(os.path.join(sysfs, pci_address, "local_cpulist")) as f:
            return parse_cpu_list(f.read())
    except (OSError, ValueError):
        return None


def gpu_local_cpus(device: int) -> Optional[List[int]]:
    """The CPUs local to CUDA device ``device``, or None where unknown."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return local_cpus(f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0")


def allowed_cpus() -> Optional[str]:
    """The CPUs the calling thread may run on, as a CPU list (None off Linux)."""
    return format_cpu_list(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def bind_to_gpu(device: int) -> Optional[List[int]]:
    """Restricts the calling thread (and the threads it starts afterwards) to
    the CPUs local to ``device`` that it may already use; returns them, or
    None (and changes nothing) where they are unknown or none is allowed."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    local = gpu_local_cpus(device)
    if not local:
        return None
    allowed = sorted(set(local) & os.sched_getaffinity(0))
    if not allowed:
        return None
    os.sched_setaffinity(0, allowed)
    return allowed
