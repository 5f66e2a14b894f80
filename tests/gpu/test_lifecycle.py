"""Buffers come and go without leaking GPU memory, whether destroyed
explicitly or collected, and bootstrap over an NCCL group too."""
import os

import torch
import torch.distributed as dist

import routing
import turnout
from harness import assert_layout_matches, generator, memory_in_use, memory_kept

NVL_BYTES = 64 << 20
CYCLES = 200
LAYOUT_EVERY = 20
SLACK_BYTES = 2 << 20


def layout_works(buf, n: int, ctx, *key) -> None:
    num_experts = 8 * n
    topk_idx = routing.uniform(512, num_experts, 4, generator(*key), ctx.device)
    assert_layout_matches(buf.get_dispatch_layout(topk_idx, num_experts), topk_idx, n, num_experts, f"n={n} {key}")


def one_cycle(ctx, g, n: int, cycle: int) -> None:
    with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
        if cycle % LAYOUT_EVERY == 0:
            layout_works(buf, n, ctx, "cycle", n, ctx.rank, cycle)
            buf._barrier()


def test_create_destroy_cycles_do_not_leak(ctx):
    pids = set(ctx.all_gather(os.getpid()))
    for n, g in ctx.each_group():
        # The first cycle creates the CUDA context's lazy state and torch's caches.
        one_cycle(ctx, g, n, 0)

        def cycles():
            for cycle in range(CYCLES):
                one_cycle(ctx, g, n, cycle)

        window = memory_kept(ctx, g, pids, cycles)
        assert window.kept <= SLACK_BYTES, \
            f"n={n}: {window.kept / 2**20:.1f} MiB more in use after {CYCLES} create/destroy cycles ({window.note})"

        # Without explicitly_destroy the memory goes when the object is collected.
        held = []

        def collected_buffer():
            buf = turnout.Buffer(g, num_nvl_bytes=NVL_BYTES)
            layout_works(buf, n, ctx, "collected", n, ctx.rank)
            torch.cuda.synchronize()
            held.append(memory_in_use(torch.cuda.current_device(), pids)[0])

        window = memory_kept(ctx, g, pids, collected_buffer)
        assert held[-1] - window.before > NVL_BYTES // 2, f"n={n}: a live buffer should hold its memory"
        assert window.kept <= SLACK_BYTES, \
            f"n={n}: {window.kept / 2**20:.1f} MiB more in use after a collected buffer ({window.note})"


test_create_destroy_cycles_do_not_leak.timeout = 600


def test_buffer_over_nccl_group(ctx):
    if ctx.shares_gpu:
        ctx.skip("NCCL refuses two ranks of one group on one GPU, and ranks share GPUs in this run")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    for n in ctx.sizes():
        # new_group is collective over WORLD: every rank makes every group.
        nccl_group = dist.new_group(list(range(n)), backend="nccl")
        if ctx.rank >= n:
            continue
        with ctx.buffer(nccl_group, num_nvl_bytes=1 << 20) as buf:
            assert (buf.rank, buf.group_size) == (ctx.rank, n), f"rank/size {buf.rank}/{buf.group_size}"
            layout_works(buf, n, ctx, "nccl", n, ctx.rank)
            buf._barrier()
