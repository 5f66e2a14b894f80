"""Buffers come and go without leaking GPU memory, whether destroyed
explicitly or collected, and bootstrap over an NCCL group too."""
import gc
import os
import zlib

import torch
import torch.distributed as dist

import routing
import turnout
import turnout_reference
from harness import assert_equal

NVL_BYTES = 64 << 20
CYCLES = 200
LAYOUT_EVERY = 20
SLACK_BYTES = 2 << 20


def generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def layout_works(buf, n: int, ctx, *key) -> None:
    num_experts = 8 * n
    topk_idx = routing.uniform(512, num_experts, 4, generator(*key), ctx.device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    ref = turnout_reference.get_dispatch_layout(topk_idx.cpu().numpy(), n, num_experts, n)
    assert_equal(per_rank, ref[0], f"n={n} {key}: num_tokens_per_rank")
    assert_equal(per_expert, ref[2], f"n={n} {key}: num_tokens_per_expert")
    assert_equal(in_rank, ref[3].astype(bool), f"n={n} {key}: is_token_in_rank")


def free_bytes(ctx, g) -> int:
    """Free memory of this GPU once every rank of g is idle and torch's cache is empty."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    ctx.all_gather(None, group=g)
    return torch.cuda.mem_get_info()[0]


def one_cycle(ctx, g, n: int, cycle: int) -> None:
    buf = turnout.Buffer(g, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
    try:
        if cycle % LAYOUT_EVERY == 0:
            layout_works(buf, n, ctx, "cycle", n, ctx.rank, cycle)
            buf._barrier()
    finally:
        buf.destroy()


def test_create_destroy_cycles_do_not_leak(ctx):
    for n in ctx.sizes():
        g = ctx.group(n)
        if g is None:
            continue
        # The first cycle creates the CUDA context's lazy state and torch's caches.
        one_cycle(ctx, g, n, 0)
        baseline = free_bytes(ctx, g)
        for cycle in range(CYCLES):
            one_cycle(ctx, g, n, cycle)
        after = free_bytes(ctx, g)
        assert baseline - after <= SLACK_BYTES, \
            f"n={n}: {(baseline - after) / 2**20:.1f} MiB less free after {CYCLES} create/destroy cycles"

        # Without explicitly_destroy the memory goes when the object is collected.
        buf = turnout.Buffer(g, num_nvl_bytes=NVL_BYTES)
        layout_works(buf, n, ctx, "collected", n, ctx.rank)
        assert free_bytes(ctx, g) < baseline - NVL_BYTES // 2, f"n={n}: a live buffer should hold its memory"
        del buf
        after = free_bytes(ctx, g)
        assert baseline - after <= SLACK_BYTES, \
            f"n={n}: {(baseline - after) / 2**20:.1f} MiB less free after a collected buffer"


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
        buf = turnout.Buffer(nccl_group, num_nvl_bytes=1 << 20, explicitly_destroy=True)
        try:
            assert (buf.rank, buf.group_size) == (ctx.rank, n), f"rank/size {buf.rank}/{buf.group_size}"
            layout_works(buf, n, ctx, "nccl", n, ctx.rank)
            buf._barrier()
        finally:
            buf.destroy()
