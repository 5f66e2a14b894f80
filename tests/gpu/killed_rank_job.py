"""A job whose rank 1 is killed (SIGKILL) while the others are in the middle of
a dispatch, with ranks sharing a GPU; run by test_killed_rank.py as its own
process, through turnout.launch, so the job starts and stops an MPS daemon of
its own. The victim dies before it launches its own kernels: under MPS a
killed client's kernels already in flight run on to the end, so a rank killed
after launching still completes its part.

    python killed_rank_job.py OUT_FOLDER TIMEOUT_S

Every rank writes OUT_FOLDER/rank<R>.json: the victim before it dies, the
others after their dispatch raised (or not) and their GPU was tried again."""
import json
import os
import signal
import sys
import time

VICTIM = 1
TOKENS, HIDDEN, TOPK, EXPERTS_PER_RANK = 256, 1024, 4, 8


def write(folder: str, rank: int, record) -> None:
    with open(os.path.join(folder, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(folder, f"rank{rank}.json.tmp"), os.path.join(folder, f"rank{rank}.json"))


def daemon_pid():
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if not pipe:
        return None
    with open(os.path.join(pipe, "nvidia-cuda-mps-control.pid")) as f:
        return int(f.read().strip())


def job(rank: int, world_size: int, folder: str, timeout_s: float):
    import torch
    import torch.distributed as dist

    import turnout

    experts = EXPERTS_PER_RANK * world_size
    config = turnout.Buffer.get_dispatch_config(world_size)
    buf = turnout.Buffer(dist.group.WORLD, num_nvl_bytes=config.get_nvl_buffer_size_hint(HIDDEN * 2, world_size),
                         explicitly_destroy=True, timeout_s=timeout_s)
    gen = torch.Generator().manual_seed(rank)
    topk_idx = (torch.rand(TOKENS, experts, generator=gen).topk(TOPK, dim=-1).indices).cuda()
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16().cuda()
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, experts)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    torch.cuda.synchronize()
    record = {"rank": rank, "mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), "daemon_pid": daemon_pid(),
              "ranks_on_gpu": buf._native.ranks_on_gpu}
    dist.barrier()
    if rank == VICTIM:
        write(folder, rank, dict(record, killed=True))
        time.sleep(0.5)  # the others are in their dispatch by now, waiting for this rank
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        buf.dispatch(x, **args)
        record["error"] = None
    except Exception as e:  # the test checks the kind and the words
        record["error"] = f"{type(e).__name__}: {e}"
    record["seconds"] = time.monotonic() - start
    # The CUDA context survived: new work runs and gives the right answer.
    record["gpu_works"] = float(torch.arange(1000, device="cuda", dtype=torch.float32).sum()) == 499500.0
    start = time.monotonic()
    buf.destroy()
    record["destroy_seconds"] = time.monotonic() - start
    write(folder, rank, record)
    return record


def main() -> int:
    import torch

    from turnout.launch import run_on_local_gpus

    folder, timeout_s = sys.argv[1], float(sys.argv[2])
    # More ranks than GPUs, so some share one; at least 3 (a victim and two who wait for it).
    num_ranks = max(3, torch.cuda.device_count() + 1)
    try:
        run_on_local_gpus(job, (folder, timeout_s), num_ranks, "gloo", timeout_s=120)
    except RuntimeError as e:
        print(e)
        return 3
    print("every rank finished: the victim was not killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
