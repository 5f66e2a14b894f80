"""Low-latency combine with use_logfmt=True (LogFMT-10) by DeepEP's own
accuracy check, over every rank of the run: BF16 dispatch of x, combine of
the received rows as they are (identity experts), and

    calc_diff(x * sum_k w_k, combined) < 1e-5,
    calc_diff(a, b) = 1 - 2 sum (a+1)(b+1) / sum ((a+1)^2 + (b+1)^2)  (float64),

slots with topk_idx = -1 left out of the sum. Inputs: rows N(0, s) for s in
0.01 .. 4, rows constant per rank (rank - 128, the last 128 channels the
token index, as DeepEP's test makes them), rows N(0, 0.1) with four channels
at +-50; top-8 of 288 experts with about 5% of the slots -1.

Each case also counts the bytes on the wire on the host with the reference:
ours over the bf16 partial row each expert rank sends per (token, rank) (the
sum over the token's slots on that rank of w_k * x_t, fp32, k ascending),
DeepEP's over one row x_t per (token, valid slot), and asserts ours <= DeepEP's
for every token. A token's weights are drawn to sum to 1 (a softmax's top-k
does): then no partial is larger than x_t, so a group DeepEP casts we cast
too. combine with use_logfmt is also bitwise repeatable. The same check
holds bf16 combine (use_logfmt=False), whose expert ranks send bf16 sums, to
DeepEP's bound on the same inputs."""
import numpy as np
import torch

import routing
import turnout
import turnout_reference
from harness import assert_equal, generator
from low_latency_cases import bits, world

EXPERTS = 288
TOPK = 8
MAX_DIFF = 1e-5
KINDS = [("normal", s) for s in (0.01, 0.03, 0.1, 0.3, 1.0, 2.0, 4.0)] + [("rank_constant", 0.0), ("outliers", 0.1)]


def shape(ctx):
    """(tokens, hidden): DeepEP's 128 x 7168; where ranks share a GPU, 64 x 2560
    (not a multiple of 1024: DeepEP's 512-channel chunks)."""
    return (64, 2560) if ctx.shares_gpu else (128, 7168)


def inputs(kind: str, scale: float, n: int, rank: int, tokens: int, hidden: int):
    """(x bf16 [T, H], topk_idx int64 [T, K], weights float32 [T, K]) of `rank`, on the CPU.
    The weights of a token's valid slots sum to 1; its -1 slots get weights too,
    which combine must not use."""
    gen = generator("ll logfmt", kind, scale, n, rank, tokens, hidden)
    if kind == "rank_constant":
        x = torch.full((tokens, hidden), float(rank - 128))
        x[:, -128:] = torch.arange(tokens, dtype=torch.float32)[:, None]
    else:
        x = torch.randn(tokens, hidden, generator=gen) * scale
        if kind == "outliers":
            where = torch.rand(tokens, hidden, generator=gen).argsort(-1)[:, :4]
            x.scatter_(1, where, torch.tensor([50.0, -50.0, 50.0, -50.0]).expand(tokens, 4).contiguous())
    topk_idx = routing.holes(tokens, EXPERTS, TOPK, gen, "cpu", fraction=0.05)
    valid = topk_idx >= 0
    w = torch.rand(tokens, TOPK, generator=gen) * valid
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-6)
    return x.bfloat16(), topk_idx, torch.where(valid, w, torch.rand(tokens, TOPK, generator=gen) + 1)


def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() + 1, b.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def wire_bytes(x: torch.Tensor, topk_idx: torch.Tensor, w: torch.Tensor, n: int):
    """Per token, (ours, DeepEP's) bytes on the wire of its combine (numpy int64 [T] each)."""
    per_rank = EXPERTS // n
    xs = x.double().numpy()
    ours, deepep = np.zeros(len(x), np.int64), np.zeros(len(x), np.int64)
    for t in range(len(x)):
        valid = topk_idx[t] >= 0
        deepep[t] = int(valid.sum()) * turnout_reference.logfmt_row_bytes_deepep(bits(x[t]))
        for d in sorted({int(e) // per_rank for e in topk_idx[t][valid]}):
            acc = np.zeros(x.shape[1], np.float32)
            for k in range(TOPK):
                if valid[k] and int(topk_idx[t, k]) // per_rank == d:
                    # One fused multiply-add in fp32: exact in fp64, then one rounding.
                    acc = (float(w[t, k]) * xs[t] + acc).astype(np.float32)
            ours[t] += turnout_reference.logfmt_row_bytes_ours(bits(torch.from_numpy(acc).bfloat16()))
    return ours, deepep


def combine_logfmt(buf, x, topk_idx, w, device, use_logfmt=True):
    """BF16 dispatch of x, then combine of the received rows as they are."""
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x.to(device), topk_idx.to(device), len(x), EXPERTS,
                                                       use_fp8=False)
    combined, _, _ = buf.low_latency_combine(recv_x, topk_idx.to(device), w.to(device), handle,
                                             use_logfmt=use_logfmt)
    torch.cuda.synchronize()
    return combined


def logfmt_buffer(ctx):
    """(n, group, tokens, hidden, a Buffer for them): the cases' group and buffer."""
    n, g = world(ctx)
    if EXPERTS % n:
        ctx.skip(f"{EXPERTS} experts is not a multiple of {n} ranks")
    tokens, hidden = shape(ctx)
    hint = turnout.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, n, EXPERTS)
    return n, g, tokens, hidden, ctx.buffer(g, num_rdma_bytes=hint, low_latency_mode=True)


def test_logfmt_accuracy_and_bytes_against_deepep(ctx):
    n, g, tokens, hidden, buffer = logfmt_buffer(ctx)
    with buffer as buf:
        for kind, scale in KINDS:
            x, topk_idx, w = inputs(kind, scale, n, ctx.rank, tokens, hidden)
            combined = combine_logfmt(buf, x, topk_idx, w, ctx.device)
            want = x.double() * (w.double() * (topk_idx >= 0)).sum(-1, keepdim=True)
            diff = calc_diff(want, combined.cpu())
            ours, deepep = wire_bytes(x, topk_idx, w, n)
            # Every rank reports before any asserts: a rank that failed alone would leave the others waiting here.
            seen = ctx.all_gather((diff, int(ours.sum()), int(deepep.sum())), g)
            if ctx.rank == 0:
                worst = max(d for d, _, _ in seen)
                o, e = sum(s[1] for s in seen), sum(s[2] for s in seen)
                print(f"n={n} {kind} s={scale}: calc_diff {worst:.3g} (largest of the ranks), wire bytes ours {o} "
                      f"vs DeepEP's {e} ({o / e:.3f}x)", flush=True)
            what = f"n={n} rank {ctx.rank} {kind} {scale}"
            assert diff < MAX_DIFF, f"{what}: calc_diff {diff:.3g} >= {MAX_DIFF}"
            worse = np.flatnonzero(ours > deepep)
            assert not len(worse), f"{what}: token {worse[0]} takes {ours[worse[0]]} bytes, DeepEP's {deepep[worse[0]]}"


test_logfmt_accuracy_and_bytes_against_deepep.timeout = 400


def test_logfmt_combine_is_bitwise_repeatable(ctx):
    """The same inputs through dispatch and combine twice give the same bits
    (rows in many cast groups, and groups cast beside bf16 ones)."""
    n, g, tokens, hidden, buffer = logfmt_buffer(ctx)
    with buffer as buf:
        for kind, scale in (("normal", 0.3), ("outliers", 0.1)):
            x, topk_idx, w = inputs(kind, scale, n, ctx.rank, tokens, hidden)
            first = combine_logfmt(buf, x, topk_idx, w, ctx.device).clone()
            again = combine_logfmt(buf, x, topk_idx, w, ctx.device)
            assert_equal(again.view(torch.int16), first.view(torch.int16),
                         f"n={n} rank {ctx.rank} {kind} {scale}: combined_x of two runs")


def test_bf16_combine_accuracy_against_deepep(ctx):
    """calc_diff(x * sum_k w_k, combined) < 1e-5 for bf16 combine on the same inputs."""
    n, g, tokens, hidden, buffer = logfmt_buffer(ctx)
    with buffer as buf:
        for kind, scale in KINDS:
            x, topk_idx, w = inputs(kind, scale, n, ctx.rank, tokens, hidden)
            combined = combine_logfmt(buf, x, topk_idx, w, ctx.device, use_logfmt=False)
            want = x.double() * (w.double() * (topk_idx >= 0)).sum(-1, keepdim=True)
            diff = calc_diff(want, combined.cpu())
            seen = ctx.all_gather(diff, g)
            if ctx.rank == 0:
                print(f"n={n} bf16 {kind} s={scale}: calc_diff {max(seen):.3g} (largest of the ranks)", flush=True)
            assert diff < MAX_DIFF, f"n={n} rank {ctx.rank} bf16 {kind} {scale}: calc_diff {diff:.3g} >= {MAX_DIFF}"
