"""Low-latency dispatch and combine as the tests drive them: inputs that every
rank can rebuild for every other rank (seeded per rank), the host reference
over all ranks, one rank's dispatch results put in canonical order and
checked bitwise against it, the expert outputs that combine sends back, and
combine checked against the fp64 reference within a stated tolerance.

Expert outputs: the row of (expert e, source rank s, token t) is
``bf16(x_s[t] * expert_scale(e))``, made from the GPU's own src_info and
layout_range, so that any rank knows every row its tokens come back from; rows
past recv_count are NaN, so a combine that reads one shows it.

Combine's tolerance, |got - fp64 reference| per value, the sum of:
- half a bf16 ulp of the result (the final rounding);
- 2^-18 * S, S = sum_k |w_k * row_k| (fp32 accumulation: each of at most
  2K + R roundings is within 2^-24 of S);
- 2^-8 * |p_d| per expert rank d, p_d the partial sum that rank sends (one
  bf16 rounding per rank partial: every expert rank pre-reduces);
- use_logfmt: each expert rank d sends the token one partial row p_d (the sum
  of w_k * row_k over the token's slots on d) as bf16 cast to LogFMT-10, so per
  value (1 + 2^-6) times the bound turnout_reference.logfmt_error_bound gives on
  bf16(p_d) (the one src/kernels/low_latency/logfmt.cuh proves), plus
  2^-15 |p_d|: the GPU's fp32 partial may round a bf16 ulp off the reference's,
  which moves |v|, amax and amin by up to 2^-7 and so s by up to 2^-5.4 / 510.
"""
import dataclasses
import time
from typing import List, Optional

import numpy as np
import torch

import routing
import turnout
import turnout_reference
from harness import assert_equal, count_check, generator

# mode: (use_fp8, round_scale, use_ue8m0)
MODES = {
    "bf16": (False, False, False),
    "fp8": (True, False, False),
    "fp8_round": (True, True, False),
    "ue8m0": (True, True, True),
}


@dataclasses.dataclass(frozen=True)
class LLCase:
    kind: str = "uniform"  # a routing of routing.py, or "duplicates" (a token names one expert twice)
    tokens: int = 64       # T of every rank but the empty one
    max_tokens: int = 64   # M = num_max_dispatch_tokens_per_rank
    hidden: int = 2048
    topk: int = 8
    experts: int = 64
    mode: str = "bf16"     # a key of MODES
    empty_rank: int = -1   # >= 0: rank (empty_rank % R) dispatches no token
    seed: int = 0

    @property
    def use_fp8(self) -> bool:
        return MODES[self.mode][0]

    @property
    def round_scale(self) -> bool:
        return MODES[self.mode][1]

    @property
    def use_ue8m0(self) -> bool:
        return MODES[self.mode][2]

    def empty_of(self, n: int) -> int:
        return -1 if self.empty_rank < 0 else self.empty_rank % n

    def tokens_of(self, rank: int, n: int) -> int:
        return 0 if rank == self.empty_of(n) else self.tokens

    def unfit(self, n: int) -> Optional[str]:
        """Why this case cannot run on n ranks, or None."""
        assert self.tokens <= self.max_tokens, f"{self}: T > M is a bad-input test, not a case"
        if self.experts % n:
            return f"{self.experts} experts is not a multiple of {n} ranks"
        distinct = {"uniform": self.experts, "holes": self.experts, "duplicates": self.experts,
                    "skip_rank": self.experts - self.experts // n}.get(self.kind)
        if distinct is not None and self.topk > distinct:
            return f"{self.kind} routing: top-{self.topk} of {distinct} experts"
        if self.use_fp8 and self.hidden % 128:
            return f"hidden {self.hidden} with FP8 (needs a multiple of 128)"
        return None

    def __str__(self) -> str:
        empty = f" empty_rank={self.empty_rank}" if self.empty_rank >= 0 else ""
        return (f"{self.kind} T={self.tokens} M={self.max_tokens} H={self.hidden} top-{self.topk} E={self.experts} "
                f"{self.mode}{empty} seed={self.seed}")


def fit_cases(cases, n: int):
    """(the cases that run on n ranks, a line naming those that cannot and why)."""
    fit = [c for c in cases if c.unfit(n) is None]
    left = [f"{c}: {c.unfit(n)}" for c in cases if c.unfit(n) is not None]
    return fit, ("; ".join(left) if left else "")


@dataclasses.dataclass
class LLInputs:
    x: torch.Tensor             # [T, H] bf16, CPU
    topk_idx: torch.Tensor      # [T, K] int64
    topk_weights: torch.Tensor  # [T, K] float32
    other_weights: torch.Tensor  # [T, K] float32, a second draw (combine's, when dispatch had weights)


def routing_of(case: LLCase, n: int, rank: int, gen) -> torch.Tensor:
    t, e, k = case.tokens_of(rank, n), case.experts, case.topk
    if case.kind in ("skip_rank", "one_rank"):
        return getattr(routing, case.kind)(t, e, k, n, gen, "cpu")
    if case.kind == "duplicates":
        idx = routing.uniform(t, e, k, gen, "cpu")
        if k > 1:
            idx[::2, k - 1] = idx[::2, 0]  # every other token names its first expert again, last
        return idx
    return getattr(routing, case.kind)(t, e, k, gen, "cpu")


def inputs_of(case: LLCase, n: int, rank: int) -> LLInputs:
    gen = generator("low_latency", case, n, rank)
    t, h = case.tokens_of(rank, n), case.hidden
    topk_idx = routing_of(case, n, rank, gen)
    # Channel groups of 32 at magnitudes 2^-8 .. 2^8 (FP8 scales see mixed
    # groups, small values go subnormal in e4m3), token 0's first 128 channels
    # zero (the amax floor).
    group = 32 if h % 32 == 0 else h
    x = torch.randn(t, h, generator=gen)
    magnitude = 2.0 ** torch.randint(-8, 9, (t, h // group, 1), generator=gen).float()
    x = (x.view(t, h // group, group) * magnitude).view(t, h)
    if t:
        x[0, :128] = 0
    weights = torch.rand(t, case.topk, generator=gen)
    other = torch.rand(t, case.topk, generator=gen)
    return LLInputs(x.bfloat16(), topk_idx, weights, other)


def bits(x: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> its uint16 bits (numpy)."""
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


def reference_dispatch(case: LLCase, n: int, all_inputs: List[LLInputs]):
    """Every rank's reference result. The reference packs UE8M0 scales in whole
    int32 words only (hidden a multiple of 512); for another hidden it runs
    without use_ue8m0 (the same e4m3 bytes and power-of-two float scales) and
    check_dispatch packs those scales itself (ue8m0_words)."""
    return turnout_reference.low_latency_dispatch([bits(i.x) for i in all_inputs],
                                                  [i.topk_idx.numpy() for i in all_inputs], case.max_tokens,
                                                  case.experts, use_fp8=case.use_fp8, round_scale=case.round_scale,
                                                  use_ue8m0=case.use_ue8m0 and case.hidden % 512 == 0)


def ue8m0_words(scales: np.ndarray) -> np.ndarray:
    """[N, G] power-of-two float32 scales -> int32 [N, ceil(G / 4)]: byte j of
    word i the biased exponent of group 4i + j, the bytes past group G - 1 zero
    (use_ue8m0's packing, as the README states it)."""
    bits32 = np.ascontiguousarray(scales, dtype=np.float32).view(np.uint32)
    assert not (bits32 & 0x807FFFFF).any(), "the reference's round_scale scales are not all positive powers of two"
    num_rows, num_groups = bits32.shape
    num_words = (num_groups + 3) // 4
    exponents = np.zeros((num_rows, 4 * num_words), np.uint32)
    exponents[:, :num_groups] = bits32 >> 23
    shifted = exponents.reshape(num_rows, num_words, 4) << np.array([0, 8, 16, 24], np.uint32)
    return np.bitwise_or.reduce(shifted, axis=-1).astype(np.uint32).view(np.int32)


def size_hint(cases, n: int) -> int:
    """num_rdma_bytes for every case of `cases` on n ranks."""
    return turnout.Buffer.get_low_latency_rdma_size_hint(max(c.max_tokens for c in cases),
                                                         max(c.hidden for c in cases), n,
                                                         max(c.experts for c in cases))


def dispatch(buf, case: LLCase, inp: LLInputs, device, **kwargs):
    """low_latency_dispatch of this rank's inputs; kwargs go to the call."""
    return buf.low_latency_dispatch(inp.x.to(device), inp.topk_idx.to(device), case.max_tokens, case.experts,
                                    use_fp8=case.use_fp8, round_scale=case.round_scale, use_ue8m0=case.use_ue8m0,
                                    **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch's results in canonical order


@dataclasses.dataclass
class Canonical:
    """One rank's received rows in canonical order (local expert, then source
    rank, then source token), as index arrays into the GPU's [L, M*R] rows."""
    recv_count: np.ndarray  # [L] int32
    layout_range: np.ndarray  # [L, R] int64
    expert: np.ndarray      # [N] local expert of each row
    row: np.ndarray         # [N] the GPU row (within its expert) holding it
    src_rank: np.ndarray    # [N]
    src_token: np.ndarray   # [N] the GPU's src_info there

    def index(self, device):
        return torch.from_numpy(self.expert).to(device), torch.from_numpy(self.row).to(device)


def canonical(handle, recv_count: torch.Tensor, what: str) -> Canonical:
    """Puts the GPU's rows in canonical order with the reference's
    low_latency_canonical_order (which also checks that layout_range's groups
    cover rows [0, recv_count) exactly once and repeat no token)."""
    src_info = handle[0].cpu().numpy()
    layout_range = handle[1].cpu().numpy()
    counts = recv_count.cpu().numpy()
    num_ranks = layout_range.shape[1]
    experts, rows, ranks, tokens = [], [], [], []
    for le in range(len(counts)):
        count_check()
        try:
            perm = turnout_reference.low_latency_canonical_order(src_info[le], layout_range[le], int(counts[le]))
        except ValueError as e:
            raise AssertionError(f"{what}: local expert {le}: src_info / layout_range / recv_count ({counts[le]}) "
                                 f"are no valid layout: {e}") from e
        experts.append(np.full(len(perm), le, np.int64))
        rows.append(perm.astype(np.int64))
        ranks.append(np.repeat(np.arange(num_ranks), layout_range[le] & 0xFFFFFFFF))
        tokens.append(src_info[le][perm])
    return Canonical(counts, layout_range, np.concatenate(experts), np.concatenate(rows),
                     np.concatenate(ranks).astype(np.int64), np.concatenate(tokens).astype(np.int64))


def reference_rows(ref, getter: str) -> np.ndarray:
    """One of the reference result's per-expert arrays, concatenated over experts."""
    return np.concatenate([getattr(ref, getter)(le) for le in range(ref.num_local_experts)])


def check_shapes(out, case: LLCase, n: int, what: str) -> None:
    recv_x, recv_count, handle, _, _ = out
    L, MR, H = case.experts // n, case.max_tokens * n, case.hidden
    if case.use_fp8:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2, f"{what}: recv_x with use_fp8 must be (fp8, scales)"
        data, scales = recv_x
        assert data.dtype == torch.float8_e4m3fn and tuple(data.shape) == (L, MR, H), \
            f"{what}: recv_x[0] is {data.dtype} {tuple(data.shape)}, expected float8_e4m3fn {(L, MR, H)}"
        g = H // 128
        if case.use_ue8m0:
            g4 = (g + 3) // 4
            assert scales.dtype == torch.int32 and tuple(scales.shape) == (L, MR, g4), \
                f"{what}: packed scales are {scales.dtype} {tuple(scales.shape)}, expected int32 {(L, MR, g4)}"
            assert scales.stride() == (MR * g4, 1, MR), f"{what}: packed scales strides {scales.stride()}"
        else:
            assert scales.dtype == torch.float32 and tuple(scales.shape) == (L, MR, g), \
                f"{what}: scales are {scales.dtype} {tuple(scales.shape)}, expected float32 {(L, MR, g)}"
            assert scales.stride() == (MR * g, 1, MR), f"{what}: scales strides {scales.stride()} (column-major)"
    else:
        assert isinstance(recv_x, torch.Tensor) and recv_x.dtype == torch.bfloat16 and \
            tuple(recv_x.shape) == (L, MR, H), f"{what}: recv_x must be bf16 {(L, MR, H)}, got {recv_x!r:.80}"
    assert recv_count.dtype == torch.int32 and tuple(recv_count.shape) == (L,), \
        f"{what}: recv_count is {recv_count.dtype} {tuple(recv_count.shape)}"
    assert isinstance(handle, tuple) and len(handle) == 5, f"{what}: the handle must be a 5-tuple"
    assert handle[0].dtype == torch.int32 and tuple(handle[0].shape) == (L, MR), f"{what}: src_info {handle[0].shape}"
    assert handle[1].dtype == torch.int64 and tuple(handle[1].shape) == (L, n), \
        f"{what}: layout_range {handle[1].dtype} {tuple(handle[1].shape)}"
    assert tuple(handle[2:]) == (case.max_tokens, H, case.experts), f"{what}: handle[2:] = {tuple(handle[2:])}"


def check_dispatch(out, ref, case: LLCase, n: int, what: str, device) -> Canonical:
    """Every valid row of this rank's dispatch result against the reference,
    bitwise, in canonical order. Returns the canonical order."""
    check_shapes(out, case, n, what)
    recv_x, recv_count, handle, _, _ = out
    assert_equal(recv_count, ref.recv_count, f"{what}: recv_count")
    # The begin of each source's group is the GPU's choice; its count is not.
    assert_equal(handle[1].cpu().numpy() & 0xFFFFFFFF, ref.layout_range & 0xFFFFFFFF, f"{what}: layout_range counts")
    canon = canonical(handle, recv_count, what)
    assert_equal(canon.src_token, reference_rows(ref, "recv_src_token").astype(np.int64), f"{what}: src_info")
    assert_equal(canon.src_rank, reference_rows(ref, "recv_src_rank").astype(np.int64), f"{what}: source ranks")
    le, row = canon.index(device)
    if case.use_fp8:
        data, scales = recv_x
        assert_equal(data.view(torch.uint8)[le, row], reference_rows(ref, "recv_x_fp8"), f"{what}: e4m3 rows")
        # Indexing reads through the column-major strides checked above.
        if case.use_ue8m0:
            want = (reference_rows(ref, "recv_packed_scales").view(np.int32) if ref.use_ue8m0 else
                    ue8m0_words(reference_rows(ref, "recv_scales")))
            assert_equal(scales[le, row], want, f"{what}: packed ue8m0 scales")
        else:
            assert_equal(scales[le, row].view(torch.int32), reference_rows(ref, "recv_scales").view(np.int32),
                         f"{what}: scales")
    else:
        assert_equal(recv_x[le, row].view(torch.int16), reference_rows(ref, "recv_x").view(np.int16),
                     f"{what}: bf16 rows")
    return canon


def dispatch_snapshot(out, case: LLCase, what: str, device):
    """(host copies of a dispatch result in canonical order, the order): what
    stays to compare once the result's memory may be reused."""
    canon = canonical(out[2], out[1], what)
    le, row = canon.index(device)
    snap = dict(recv_count=canon.recv_count.copy(), layout_counts=canon.layout_range & 0xFFFFFFFF,
                src_rank=canon.src_rank, src_token=canon.src_token)
    if case.use_fp8:
        snap["e4m3 rows"] = out[0][0].view(torch.uint8)[le, row].cpu().numpy()
        snap["scales"] = out[0][1][le, row].view(torch.int32).cpu().numpy()
    else:
        snap["bf16 rows"] = out[0][le, row].view(torch.int16).cpu().numpy()
    return snap, canon


def assert_same_snapshot(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: {sorted(got)} != {sorted(want)}"
    for key in want:
        assert_equal(got[key], want[key], f"{what}: {key}")


def same_dispatch(a, b, case: LLCase, what: str, device) -> Canonical:
    """Two dispatch results of the same inputs hold the same rows (bitwise, in
    canonical order; each may order rows inside a source group its own way)."""
    want, _ = dispatch_snapshot(a, case, what + " (first)", device)
    got, canon = dispatch_snapshot(b, case, what + " (second)", device)
    assert_same_snapshot(got, want, what)
    return canon


def check_stats(before: torch.Tensor, after: torch.Tensor, elapsed_s: float, what: str) -> None:
    """A wait-cost stats tensor ([R] int64, ns waited per rank): only grew,
    and by no more than the wall time of the calls."""
    grew = (after.cpu() - before.cpu()).numpy()
    assert after.dtype == torch.int64, f"{what}: dtype {after.dtype}"
    assert (grew >= 0).all(), f"{what}: went down: {grew}"
    assert (grew <= elapsed_s * 1e9 + 1e6).all(), f"{what}: {grew} ns waited in {elapsed_s * 1e9:.0f} ns of calls"


# ---------------------------------------------------------------------------------------------------------------
# Expert outputs and combine


def expert_scale(expert: int) -> float:
    """0.5 + (e mod 61) / 64: exact in bf16, different for neighbouring experts."""
    return 0.5 + (expert % 61) / 64


def expert_rows(x: torch.Tensor, experts: np.ndarray) -> torch.Tensor:
    """bf16(x[i] * expert_scale(experts[i])) per row, on the CPU (where both the
    GPU's rows and the reference's are made: the same bits)."""
    scale = torch.tensor([expert_scale(int(e)) for e in experts], dtype=torch.float32)
    return (x.float() * scale[:, None]).bfloat16()


def all_x(all_inputs: List[LLInputs], case: LLCase) -> torch.Tensor:
    """[R, M, H] bf16: every rank's x, padded to M rows."""
    out = torch.zeros(len(all_inputs), case.max_tokens, case.hidden, dtype=torch.bfloat16)
    for r, inp in enumerate(all_inputs):
        out[r, :inp.x.shape[0]] = inp.x
    return out


def expert_outputs(canon: Canonical, xs: torch.Tensor, case: LLCase, n: int, rank: int, device) -> torch.Tensor:
    """[L, M*R, H] bf16 on the device: the row of (e, s, t) is bf16(x_s[t] *
    expert_scale(e)); rows past recv_count NaN."""
    L = case.experts // n
    y = torch.full((L, case.max_tokens * n, case.hidden), float("nan"), dtype=torch.bfloat16, device=device)
    if len(canon.row):
        rows = expert_rows(xs[torch.from_numpy(canon.src_rank), torch.from_numpy(canon.src_token)],
                           canon.expert + rank * L)
        le, row = canon.index(device)
        y[le, row] = rows.to(device)
    return y


class MyRows:
    """The expert rows this rank's tokens come back from, per (expert rank r,
    local expert l), in canonical order: what the reference combine needs for
    one rank (turnout_reference.low_latency_combine's only_rank)."""

    def __init__(self, refs, rank: int, x: torch.Tensor) -> None:
        self.refs, self.rank = refs, rank
        self.rows = []  # [r][l] bf16 [n_rl, H]
        for r, ref in enumerate(refs):
            L = ref.num_local_experts
            per = []
            for le in range(L):
                tokens = ref.recv_src_token(le)[ref.recv_src_rank(le) == rank]
                per.append(expert_rows(x[torch.from_numpy(tokens).long()],
                                       np.full(len(tokens), r * L + le)))
            self.rows.append(per)

    def combine(self, topk_idx: np.ndarray, weights: np.ndarray, transform=None) -> np.ndarray:
        """The fp64 reference combine of this rank's tokens over these rows
        (each row through `transform` first: bf16 tensor -> bf16 tensor)."""
        t = transform or (lambda v: v)
        expert_x = [[bits(t(v)) for v in per] for per in self.rows]
        ids = [topk_idx if r == self.rank else None for r in range(len(self.refs))]
        ws = [weights if r == self.rank else None for r in range(len(self.refs))]
        return turnout_reference.low_latency_combine(expert_x, ids, ws, self.refs, only_rank=self.rank)[self.rank]


def combine_tolerance(mine: MyRows, topk_idx: np.ndarray, weights: np.ndarray, num_ranks: int, num_experts: int,
                      logfmt: bool) -> np.ndarray:
    """The tolerance of the module's docstring, less the final rounding."""
    w = np.abs(weights)
    s = mine.combine(topk_idx, w, torch.abs)
    tol = 2.0 ** -18 * s
    per_rank = num_experts // num_ranks
    for d in range(num_ranks):
        p = mine.combine(np.where(topk_idx // per_rank == d, topk_idx, -1), weights)
        tol += 2.0 ** -8 * np.abs(p)
        if logfmt and p.size:
            bound = turnout_reference.logfmt_error_bound(bits(torch.from_numpy(p).to(torch.bfloat16)))
            tol += (1 + 2.0 ** -6) * bound + 2.0 ** -15 * np.abs(p)
    return tol


def assert_combine_close(got: torch.Tensor, ref: np.ndarray, tol: np.ndarray, what: str) -> None:
    g = got.float().cpu().double().numpy()
    if g.shape != ref.shape:
        raise AssertionError(f"{what}: shape {g.shape} != expected {ref.shape}")
    count_check()
    _, e = np.frexp(np.maximum(np.abs(g), np.abs(ref)))
    bound = np.ldexp(1.0, e - 9) + tol
    bad = np.argwhere(~(np.abs(g - ref) <= bound))  # NaN is off too
    if len(bad):
        i = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {g.size} values off; first at {i}: got {g[i]!r}, reference "
                             f"{ref[i]!r}, allowed {bound[i]:.3g}")


def check_combine(combined: torch.Tensor, mine: MyRows, topk_idx: torch.Tensor, weights: torch.Tensor,
                  case: LLCase, n: int, what: str, logfmt: bool = False) -> None:
    """combined_x against the fp64 reference of this rank's tokens.
    `weights`: the weights the combine is to use (the dispatch's when it had
    them). Every expert rank sends one partial sum per token (pre-reduced)."""
    T = topk_idx.shape[0]
    assert combined.dtype == torch.bfloat16 and tuple(combined.shape) == (T, case.hidden), \
        f"{what}: combined_x is {combined.dtype} {tuple(combined.shape)}, expected bf16 {(T, case.hidden)}"
    ids, w = topk_idx.cpu().numpy(), weights.cpu().numpy()
    ref = mine.combine(ids, w)
    tol = combine_tolerance(mine, ids, w, n, case.experts, logfmt)
    assert_combine_close(combined, ref, tol, what)


def combine_call(buf, y: torch.Tensor, handle, topk_idx: torch.Tensor, weights: torch.Tensor, zero_copy=False,
                 use_out=False, **kwargs):
    """low_latency_combine of expert outputs y (copied into the buffer's next
    combine buffer first with zero_copy; into a fresh `out` with use_out)."""
    x = y
    if zero_copy:
        x = buf.get_next_low_latency_combine_buffer(handle)
        assert x.dtype == torch.bfloat16 and x.shape == y.shape, \
            f"get_next_low_latency_combine_buffer: {x.dtype} {tuple(x.shape)}, expected bf16 {tuple(y.shape)}"
        x.copy_(y)
    out = None
    if use_out:
        out = torch.full((topk_idx.shape[0], y.shape[2]), 7.0, dtype=torch.bfloat16, device=y.device)
        kwargs["out"] = out
    combined, event, hook = buf.low_latency_combine(x, topk_idx, weights, handle, zero_copy=zero_copy, **kwargs)
    if use_out:
        assert combined.data_ptr() == out.data_ptr() and combined.shape == out.shape, "combine must return `out`"
    return combined, event, hook


@dataclasses.dataclass
class RoundTrip:
    inputs: List[LLInputs]
    refs: list
    out: tuple           # dispatch's
    canon: Canonical
    mine: MyRows
    y: torch.Tensor      # the expert outputs sent back
    combined: torch.Tensor


def round_trip(ctx, buf, case: LLCase, n: int, what: str, weights_at_dispatch: bool = False, logfmt: bool = False,
               zero_copy: bool = False, use_out: bool = False, stats: bool = False) -> RoundTrip:
    """Dispatch of `case` then combine of the expert outputs over the group of n
    ranks, each checked against the reference (the current stream waits for
    each: async_finish off). weights_at_dispatch: topk_weights go to dispatch
    (pre-reduced combine) and combine gets other weights, which it must not
    read. stats: the cumulative and wait-cost stats tensors are passed and
    checked."""
    dev, me = ctx.device, ctx.rank
    inputs = [inputs_of(case, n, r) for r in range(n)]
    refs = reference_dispatch(case, n, inputs)
    mine_in = inputs[me]
    L = case.experts // n
    kwargs = {}
    if weights_at_dispatch:
        kwargs["topk_weights"] = mine_in.topk_weights.to(dev)
    if stats:
        start = torch.randint(0, 1000, (L,), dtype=torch.int32, generator=generator("ll stats", case, n, me))
        kwargs["cumulative_local_expert_recv_stats"] = start.to(dev, copy=True)
        kwargs["dispatch_wait_recv_cost_stats"] = torch.zeros(n, dtype=torch.int64, device=dev)
    t0 = time.monotonic()
    out = dispatch(buf, case, mine_in, dev, **kwargs)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - t0
    assert out[4] is None, f"{what}: hook must be None without return_recv_hook"
    canon = check_dispatch(out, refs[me], case, n, what, dev)
    if stats:
        assert_equal(kwargs["cumulative_local_expert_recv_stats"], start.numpy() + refs[me].recv_count,
                     f"{what}: cumulative_local_expert_recv_stats")
        check_stats(torch.zeros(n, dtype=torch.int64), kwargs["dispatch_wait_recv_cost_stats"], elapsed,
                    f"{what}: dispatch_wait_recv_cost_stats")

    y = expert_outputs(canon, all_x(inputs, case), case, n, me, dev)
    topk_idx = mine_in.topk_idx.to(dev)
    weights = mine_in.other_weights if weights_at_dispatch else mine_in.topk_weights
    extra = {}
    if stats:
        extra["combine_wait_recv_cost_stats"] = torch.zeros(n, dtype=torch.int64, device=dev)
    t0 = time.monotonic()
    combined, _, hook = combine_call(buf, y, out[2], topk_idx, weights.to(dev), zero_copy=zero_copy, use_out=use_out,
                                     use_logfmt=logfmt, **extra)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - t0
    assert hook is None, f"{what}: combine's hook must be None without return_recv_hook"
    if stats:
        check_stats(torch.zeros(n, dtype=torch.int64), extra["combine_wait_recv_cost_stats"], elapsed,
                    f"{what}: combine_wait_recv_cost_stats")
    mine = MyRows(refs, me, mine_in.x)
    check_combine(combined, mine, mine_in.topk_idx, mine_in.topk_weights, case, n, what, logfmt=logfmt)
    return RoundTrip(inputs, refs, out, canon, mine, y, combined)


def world(ctx):
    """(n, group) of every rank of the run; skips a run of one rank."""
    n = ctx.world_size
    if n < 2:
        ctx.skip(f"needs at least 2 ranks; this run has {n}")
    return n, ctx.groups[n]
