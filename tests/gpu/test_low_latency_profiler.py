"""What profiler-based timing sees of low-latency calls: the PyTorch
profiler's kernel table has exactly one row whose name holds "dispatch" and
one whose name holds "combine", with one launch per call where a rank has its
GPU to itself and two (the send and the receive: the same kernel, the phase
an argument) where ranks share a GPU or the call returns a receive hook. The
Chrome trace's kernel events match "::dispatch" and "::combine" as many times.
DeepEP's benchmarking helper, which serving teams copy, asserts exactly this
before it reads the times. Both combine formats (bf16 and use_logfmt) run."""
import json
import os
import tempfile

import torch
import torch.distributed as dist

from harness import assert_equal
from low_latency_cases import world

CALLS = 6
TOKENS, HIDDEN, EXPERTS, TOPK = 32, 2048, 64, 8
NAMES = ("dispatch", "combine")


def table_rows(prof, name: str):
    """The kernel table's lines that hold ``name``, as DeepEP's helper reads them."""
    lines = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
    return [line for line in lines if name in line]


def trace_kernels(prof) -> list:
    """The names of the Chrome trace's kernel events (a trace is saved once)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return [e.get("name", "") for e in events if e.get("cat") == "kernel"]


def test_one_profiler_row_per_op(ctx):
    n, group = world(ctx)
    import turnout

    dev = ctx.device
    torch.manual_seed(ctx.rank)
    x = torch.randn(TOKENS, HIDDEN, device=dev).bfloat16()
    topk_idx = (torch.randn(TOKENS, EXPERTS, device=dev).abs() + 1).topk(TOPK, dim=-1).indices
    topk_idx[3, 2] = -1
    weights = torch.rand(TOKENS, TOPK, device=dev)
    hint = turnout.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, n, EXPERTS)
    dummy = torch.ones(1, device=dev)
    with ctx.buffer(group, num_rdma_bytes=hint, low_latency_mode=True) as buf:
        alone = buf._native.ranks_on_gpu == 1
        for hook in (False, True):
            for logfmt in (False, True):
                what = f"n={n} hook={hook} logfmt={logfmt}"

                def step():
                    recv_x, _, handle, _, recv_hook = buf.low_latency_dispatch(
                        x, topk_idx, TOKENS, EXPERTS, use_fp8=True, return_recv_hook=hook)
                    if hook:
                        recv_hook()
                    expert_out = recv_x[0].float().bfloat16()
                    _, _, recv_hook = buf.low_latency_combine(expert_out, topk_idx, weights, handle,
                                                              use_logfmt=logfmt, return_recv_hook=hook)
                    if hook:
                        recv_hook()

                step()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(CALLS):
                        dist.all_reduce(dummy, group=group)
                        step()
                    torch.cuda.synchronize()
                launches = CALLS * (1 if alone and not hook else 2)
                kernels = trace_kernels(prof)
                for name in NAMES:
                    rows = table_rows(prof, name)
                    assert len(rows) == 1, f"{what}: {len(rows)} kernel-table rows hold {name!r}: {rows}"
                    assert_equal(int(rows[0].split()[-1]), launches, f"{what}: launches in the {name!r} row")
                    matching = sum(f"::{name}" in k for k in kernels)
                    assert_equal(matching, launches, f"{what}: trace kernels matching ::{name}")
                buf.check_errors()
