"""Inputs of intranode dispatch/combine that every rank can rebuild for every
other rank (seeded per rank), the host reference over all ranks, the checks
of one rank's results against it, and a whole round trip checked."""
import dataclasses
import functools
from typing import Optional, Tuple

import numpy as np
import torch

import routing
import turnout
import turnout_reference
from harness import assert_equal, generator


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str = "uniform"        # a routing of routing.py
    tokens: int = 256
    hidden: int = 1024
    topk: int = 8                # 0: dispatch without top-k
    experts: int = 64
    fp8: bool = False
    alignment: int = 1
    biases: int = 0              # 0, 1 or 2 bias tensors in combine
    empty_rank: int = -1         # this rank has no tokens at all
    seed: int = 0

    def tokens_of(self, rank: int) -> int:
        return 0 if rank == self.empty_rank else self.tokens


@dataclasses.dataclass
class Inputs:
    x: object                    # bf16 tensor or (fp8, scales) on the CPU
    topk_idx: torch.Tensor       # [T, K] int64 (K >= 1 even without top-k: it makes the routing)
    topk_weights: torch.Tensor
    is_token_in_rank: np.ndarray


def make_routing(case: Case, n: int, rank: int, gen) -> torch.Tensor:
    k = max(case.topk, 1)
    t = case.tokens_of(rank)
    if case.kind in ("skip_rank", "one_rank"):
        return getattr(routing, case.kind)(t, case.experts, k, n, gen, "cpu")
    return getattr(routing, case.kind)(t, case.experts, k, gen, "cpu")


def inputs_of(case: Case, n: int, rank: int) -> Inputs:
    gen = generator("intranode", case, n, rank)
    t, h = case.tokens_of(rank), case.hidden
    topk_idx = make_routing(case, n, rank, gen)
    weights = torch.rand(topk_idx.shape, generator=gen)
    if case.fp8:
        data = torch.randint(0, 256, (t, h), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
        # Column-major scales, as DeepGEMM lays them out.
        scales = torch.rand(h // 128, t, generator=gen).t()
        x = (data, scales)
    else:
        x = torch.randn(t, h, generator=gen).bfloat16()
    in_rank = turnout_reference.get_dispatch_layout(topk_idx.numpy(), n, case.experts, n)[3]
    return Inputs(x, topk_idx, weights, in_rank)


def scales_to_device(scales: torch.Tensor, device) -> torch.Tensor:
    """Keeps the column-major layout on the device."""
    return scales.t().contiguous().to(device).t()


def x_on_device(x, device):
    if isinstance(x, tuple):
        return x[0].to(device), scales_to_device(x[1], device)
    return x.to(device)


def x_bytes(x) -> np.ndarray:
    data = x[0] if isinstance(x, tuple) else x
    return data.contiguous().view(torch.uint8).numpy()


def reference_dispatch(case: Case, n: int, all_inputs, x_override=None, only_rank: int = -1):
    """Every rank's reference dispatch result (x_override: other x, same routing;
    only_rank >= 0: only that rank's result keeps its rows, the checked ones)."""
    xs = x_override if x_override is not None else [i.x for i in all_inputs]
    return turnout_reference.normal_dispatch(
        [x_bytes(x) for x in xs],
        [x[1].contiguous().numpy() if isinstance(x, tuple) else None for x in xs],
        [i.topk_idx.numpy() if case.topk else None for i in all_inputs],
        [i.topk_weights.numpy() if case.topk else None for i in all_inputs],
        [i.is_token_in_rank for i in all_inputs],
        case.experts, case.alignment, only_rank=only_rank)


def dispatch(buf, case: Case, inp: Inputs, device, **kwargs):
    """Layout on the GPU, then dispatch; returns dispatch's tuple."""
    topk_idx = inp.topk_idx.to(device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, case.experts)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                expert_alignment=case.alignment)
    if case.topk:
        args.update(topk_idx=topk_idx, topk_weights=inp.topk_weights.to(device))
    args.update(kwargs)
    return buf.dispatch(x_on_device(inp.x, device), **args)


def check_dispatch(out, ref, case: Case, what: str, worst: int = 0, source_tokens=None) -> None:
    """`source_tokens`: the tokens the handle counts per source rank, where
    they are not the case's (shrink mode: 0 for a masked rank)."""
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, _ = out
    n_ref = ref.num_recv
    data = recv_x[0] if case.fp8 else recv_x
    rows = worst if worst else n_ref
    assert data.shape[0] == rows, f"{what}: recv_x has {data.shape[0]} rows, expected {rows}"
    assert_equal(data[:n_ref].contiguous().view(torch.uint8), ref.recv_x, f"{what}: recv_x")
    if case.fp8:
        assert_equal(recv_x[1][:n_ref].contiguous().view(torch.int32), ref.recv_x_scales.view(np.int32),
                     f"{what}: recv_x scales")
    if case.topk:
        assert_equal(recv_topk_idx[:n_ref], ref.recv_topk_idx, f"{what}: recv_topk_idx")
        assert_equal(recv_topk_weights[:n_ref].view(torch.int32), ref.recv_topk_weights.view(np.int32),
                     f"{what}: recv_topk_weights")
        if worst:
            assert bool((recv_topk_idx[n_ref:] == -1).all()), f"{what}: padding rows must have top-k -1"
    else:
        assert recv_topk_idx is None and recv_topk_weights is None, f"{what}: top-k outputs without top-k"
    if worst:
        assert per_expert == [], f"{what}: the per-expert list must be empty with num_worst_tokens, got {per_expert}"
    elif case.topk:
        assert list(per_expert) == list(ref.num_recv_tokens_per_expert), \
            f"{what}: num_recv_tokens_per_expert {per_expert} != {list(ref.num_recv_tokens_per_expert)}"
    assert_equal(handle[0], ref.rank_prefix_matrix, f"{what}: rank_prefix_matrix")
    num_ranks = handle[0].shape[0]
    assert len(handle) == 6 and handle[2] is None and handle[5] is None, f"{what}: the handle's layout"
    source_tokens, recv_src_idx = handle[1].tolist(), handle[3]
    want = source_tokens if source_tokens is not None else [case.tokens_of(r) for r in range(num_ranks)]
    assert source_tokens == want, f"{what}: the handle's source token counts {source_tokens} != {want}"
    assert recv_src_idx.shape[0] == rows, f"{what}: the handle has {recv_src_idx.shape[0]} source indices"
    assert_equal(recv_src_idx[:n_ref], ref.recv_src_idx, f"{what}: recv_src_idx (handle)")
    if worst:
        assert bool((recv_src_idx[n_ref:] == -1).all()), f"{what}: padding rows must have source index -1"


# Combine inputs are windows of one pool of normals per (case, group size,
# rank): row i starts at its own offset. Any rank can so make just the rows
# that hold its tokens (1/n of all ranks' rows) for its reference, instead of
# every rank's whole input. Offsets i * ROW_STRIDE mod (windows) differ for
# every row index below the window count (the stride is prime to it), so no
# two rows of a rank are equal.
POOL_WINDOWS = (1 << 20) + 1
ROW_STRIDE = 7919


@functools.lru_cache(maxsize=32)
def _combine_pool(case: Case, n: int, rank: int) -> np.ndarray:
    gen = generator("combine", case, n, rank)
    pool = torch.randn(POOL_WINDOWS + case.hidden - 1, generator=gen).bfloat16()
    return pool.view(torch.int16).numpy().view(np.uint16)


def combine_rows(case: Case, n: int, rank: int, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of ``rank``'s combine input: bf16 bits [len(rows), hidden]."""
    windows = np.lib.stride_tricks.sliding_window_view(_combine_pool(case, n, rank), case.hidden)
    return windows[(np.asarray(rows, dtype=np.int64) * ROW_STRIDE) % POOL_WINDOWS]


def combine_inputs(case: Case, n: int, rank: int, num_rows: int,
                   with_biases: bool = True) -> Tuple[torch.Tensor, Optional[tuple]]:
    x = torch.from_numpy(combine_rows(case, n, rank, np.arange(num_rows))).view(torch.bfloat16)
    gen = generator("combine biases", case, n, rank)
    t = case.tokens_of(rank)
    biases = tuple(torch.randn(t, case.hidden, generator=gen).bfloat16() for _ in range(case.biases)) \
        if with_biases else ()
    return x, biases


def bf16_bits_to_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def reference_combine(case: Case, n: int, refs, rank: int):
    """``rank``'s fp64 combine of combine_inputs over the reference receive
    order: (combined_x, combined_topk_weights). Only the rows that hold rank's
    tokens are made. A token reaches a rank at most once, so each rank's rows
    add to distinct tokens; fp64 holds these few bf16 terms exactly, so the
    order of the sums does not matter (the C++ reference's normal_combine,
    which CPU tests check, sums the same terms)."""
    t = case.tokens_of(rank)
    combined_x = np.zeros((t, case.hidden))
    combined_w = np.zeros((t, case.topk))
    for r in range(n):
        rows = np.flatnonzero(refs[r].recv_src_rank == rank)
        tokens = refs[r].recv_src_idx[rows]
        combined_x[tokens] += bf16_bits_to_f64(combine_rows(case, n, r, rows))
        if case.topk:
            combined_w[tokens] += refs[r].recv_topk_weights[rows]
    # Biases once per token, after the received rows.
    for bias in combine_inputs(case, n, rank, 0)[1]:
        combined_x += bf16_bits_to_f64(bias.view(torch.int16).numpy().view(np.uint16))
    return combined_x, combined_w


def combine(buf, case: Case, n: int, rank: int, out, device, worst: int = 0, **kwargs):
    recv_x, _, recv_topk_weights, _, handle, _ = out
    num_rows = handle[3].shape[0]
    x, biases = combine_inputs(case, n, rank, num_rows if not worst else int(handle[0][-1, rank]))
    if worst:
        x = torch.cat([x, torch.randn(num_rows - x.shape[0], case.hidden).bfloat16()])
    bias = None if not biases else (tuple(b.to(device) for b in biases) if len(biases) == 2 else biases[0].to(device))
    return buf.combine(x.to(device), handle, topk_weights=recv_topk_weights if case.topk else None, bias=bias,
                       **kwargs)


# fp32 accumulation of a few unit-scale bf16 terms: where they cancel, the sum
# keeps an absolute error of a few fp32 ulps of the terms (2^-24 each).
FP32_SUM_ABS = 1e-6


def assert_bf16_close(got: torch.Tensor, ref: np.ndarray, what: str, rel: float = 1e-5) -> None:
    """got (bf16) is a rounding of a value within `rel` (plus the fp32 sum's
    absolute error) of the fp64 reference."""
    g = got.float().cpu().double().numpy()
    if g.shape != ref.shape:
        raise AssertionError(f"{what}: shape {g.shape} != expected {ref.shape}")
    _, e = np.frexp(np.maximum(np.abs(g), np.abs(ref)))
    tol = np.ldexp(1.0, e - 9) + rel * np.abs(ref) + FP32_SUM_ABS
    bad = np.argwhere(np.abs(g - ref) > tol)
    if len(bad):
        i = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} elements off; first at {i}: got {g[i]!r}, reference {ref[i]!r}")


def assert_float_close(got: torch.Tensor, ref: np.ndarray, what: str, rel: float = 1e-5) -> None:
    g = got.cpu().double().numpy()
    if g.shape != ref.shape:
        raise AssertionError(f"{what}: shape {g.shape} != expected {ref.shape}")
    bad = np.argwhere(np.abs(g - ref) > rel * np.abs(ref) + 1e-6)
    if len(bad):
        i = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} elements off; first at {i}: got {g[i]!r}, reference {ref[i]!r}")


def check_combine(out, ref, case: Case, what: str) -> None:
    combined_x, combined_w, _ = out
    assert_bf16_close(combined_x, ref[0], f"{what}: combined_x")
    if case.topk:
        assert_float_close(combined_w, ref[1], f"{what}: combined_topk_weights")
    else:
        assert combined_w is None, f"{what}: combined_topk_weights without top-k weights"


def round_trip(ctx, buf, case: Case, n: int, what: str, **kwargs):
    """Dispatch then combine of ``case`` over the group of n ranks, each result
    checked against the reference (kwargs go to both calls; with async_finish
    the current stream waits for each); returns (inputs, refs, dispatch's out)."""
    inputs = [inputs_of(case, n, r) for r in range(n)]
    refs = reference_dispatch(case, n, inputs, only_rank=ctx.rank)
    out = dispatch(buf, case, inputs[ctx.rank], ctx.device, **kwargs)
    if kwargs.get("async_finish"):
        out[-1].current_stream_wait()
    check_dispatch(out, refs[ctx.rank], case, what)
    back = combine(buf, case, n, ctx.rank, out, ctx.device, **kwargs)
    if kwargs.get("async_finish"):
        back[-1].current_stream_wait()
    check_combine(back, reference_combine(case, n, refs, ctx.rank), case, what)
    return inputs, refs, out


def nvl_bytes(hidden: int, n: int, config=None) -> int:
    config = config or turnout.Buffer.get_dispatch_config(n)
    return config.get_nvl_buffer_size_hint(hidden * 2, n)
