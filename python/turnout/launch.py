"""Runs a function on every local GPU, one process per GPU, each with
torch.distributed initialized (the way a user's job runs), and collects what
the function returns."""
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable, List, Optional, Sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process(rank: int, world_size: int, port: int, backend: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank) if backend == "nccl" else None)


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: Sequence[Any], results) -> None:
    import torch.distributed as dist

    try:
        init_process(rank, world_size, port, backend)
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_local_gpus(fn: Callable, args: Sequence[Any] = (), num_ranks: Optional[int] = None,
                      backend: str = "nccl", timeout_s: float = 1800.0) -> List[Any]:
    """Calls ``fn(rank, world_size, *args)`` in one process per GPU; returns the
    results in rank order, or raises with the first failing rank's traceback."""
    import torch

    world_size = num_ranks or torch.cuda.device_count()
    if world_size < 1:
        raise RuntimeError("run_on_local_gpus: no CUDA device is visible")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs: List[Any] = [None] * world_size
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout_s)
            if status == "ok":
                outs[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a rank failed\n" + "\n".join(errors))
    return outs
