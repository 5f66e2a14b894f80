"""Runs a function in N processes, one per rank, each with torch.distributed
initialized (the way a user's job runs), and collects what the function
returns. Ranks go round-robin over the visible GPUs, so N may exceed the GPU
count: ranks that share a GPU run under an MPS daemon of the run's own
(``gpu_sharing``) and talk through Gloo, since NCCL refuses two ranks of one
group on one GPU. With ``TURNOUT_BIND_CPUS=1`` each rank's main thread runs
on the CPUs local to its GPU (``cpu_binding``)."""
import multiprocessing as mp
import os
import queue
import random
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .cpu_binding import bind_to_gpu
from .gpu_sharing import shared_gpus

_LOWEST_PORT = 10000


def _outgoing_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> Tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's default where it cannot be read)."""
    try:
        with open(path) as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(tries: int = 64) -> int:
    """A port free now, below the range of outgoing connections' local ports:
    a port the kernel hands out (bind to 0) can be taken by any connection the
    starting ranks make before rank 0 listens on it (EADDRINUSE)."""
    lo, _ = _outgoing_port_range()
    if lo - _LOWEST_PORT >= tries:
        for port in random.sample(range(_LOWEST_PORT, lo), tries):
            if _binds(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process(rank: int, world_size: int, port: int, backend: str, device: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(device)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", device) if backend == "nccl" else None)


def _worker(rank: int, world_size: int, port: int, backend: str, device: int, env: Dict[str, str], fn: Callable,
            args: Sequence[Any], results) -> None:
    # Before CUDA starts in this process: the MPS client settings.
    os.environ.update(env)
    import torch.distributed as dist

    try:
        init_process(rank, world_size, port, backend, device)
        if os.environ.get("TURNOUT_BIND_CPUS") == "1":
            bind_to_gpu(device)
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def gpus_shared(num_ranks: int) -> bool:
    """True when ``num_ranks`` ranks would not each have a GPU of their own."""
    import torch

    return num_ranks > torch.cuda.device_count()


def run_on_local_gpus(fn: Callable, args: Sequence[Any] = (), num_ranks: Optional[int] = None,
                      backend: str = "nccl", timeout_s: float = 1800.0) -> List[Any]:
    """Calls ``fn(rank, world_size, *args)`` in one process per rank (default:
    one per visible GPU); returns the results in rank order, or raises with the
    first failing rank's traceback, or naming a rank whose process died. The
    NCCL backend becomes Gloo where ranks share a GPU."""
    import torch

    num_devices = torch.cuda.device_count()
    if num_devices < 1:
        raise RuntimeError("run_on_local_gpus: no CUDA device is visible")
    world_size = num_ranks or num_devices
    if backend == "nccl" and gpus_shared(world_size):
        backend = "gloo"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    outs: List[Any] = [None] * world_size
    errors = []
    with shared_gpus(world_size, num_devices) as placement:
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, placement.device(r),
                                                   placement.env(r), fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        finished = False
        try:
            reported = set()
            deadline = time.monotonic() + timeout_s
            while len(reported) < world_size and not errors:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        errors.append(f"ranks {sorted(set(range(world_size)) - reported)} did not finish within "
                                      f"{timeout_s:.0f} s")
                    # A rank that died without a word (killed, crashed) would be waited for forever.
                    dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
                    if dead and results.empty():
                        errors += [f"rank {r}: its process exited with code {procs[r].exitcode} before it reported"
                                   for r in dead]
                    continue
                reported.add(rank)
                if status == "ok":
                    outs[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
            finished = True
        finally:
            # Interrupted (Ctrl-C, SIGTERM): no grace, so the daemon goes promptly.
            grace = (5 if errors else 60) if finished else 0
            for p in procs:
                p.join(timeout=grace)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise RuntimeError("a rank failed\n" + "\n".join(errors))
    return outs
