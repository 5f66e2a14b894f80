"""The host reference the GPU tests trust: the bound layout and the bound
low-latency dispatch, canonical order and combine against plain Python
recomputations, and the FP8 cast against its definition."""
import numpy as np
import pytest
import torch

import turnout_reference as ref


def python_layout(topk_idx: np.ndarray, num_ranks: int, num_experts: int, num_nvl_ranks: int):
    """Counts once per distinct rank / RDMA rank / expert a token reaches."""
    per_rank_experts = num_experts // num_ranks
    per_rank = np.zeros(num_ranks, np.int32)
    per_rdma = np.zeros(num_ranks // num_nvl_ranks, np.int32)
    per_expert = np.zeros(num_experts, np.int32)
    in_rank = np.zeros((len(topk_idx), num_ranks), bool)
    for t, row in enumerate(topk_idx):
        experts = {int(e) for e in row if e >= 0}
        ranks = {e // per_rank_experts for e in experts}
        for e in experts:
            per_expert[e] += 1
        for r in ranks:
            per_rank[r] += 1
            in_rank[t, r] = True
        for d in {r // num_nvl_ranks for r in ranks}:
            per_rdma[d] += 1
    return per_rank, per_rdma, per_expert, in_rank


LAYOUT_CASES = [
    # (tokens, top-k, ranks, experts, NVL ranks)
    (0, 4, 2, 8, 2),
    (1, 1, 2, 2, 2),
    (200, 8, 8, 64, 8),
    (300, 6, 4, 32, 2),
    (300, 9, 16, 32, 8),
    (100, 4, 4, 4, 1),
    (500, 3, 2, 6, 2),  # few experts: many duplicates in a row
]


@pytest.mark.parametrize("num_tokens, num_topk, num_ranks, num_experts, num_nvl_ranks", LAYOUT_CASES)
def test_layout_matches_python(num_tokens, num_topk, num_ranks, num_experts, num_nvl_ranks):
    rng = np.random.default_rng(num_tokens * 1000 + num_topk * 100 + num_ranks)
    # Ids drawn with replacement from [-1, E): -1 slots and duplicates in a row.
    topk_idx = rng.integers(-1, num_experts, size=(num_tokens, num_topk), dtype=np.int64)
    got = ref.get_dispatch_layout(topk_idx, num_ranks, num_experts, num_nvl_ranks)
    want = python_layout(topk_idx, num_ranks, num_experts, num_nvl_ranks)
    for name, g, w in zip(("per_rank", "per_rdma_rank", "per_expert"), got[:3], want[:3]):
        assert g.dtype == np.int32, f"{name}: dtype {g.dtype}"
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert set(np.unique(got[3])) <= {0, 1}
    np.testing.assert_array_equal(got[3].astype(bool), want[3], err_msg="is_token_in_rank")


def test_layout_duplicates_count_once():
    topk_idx = np.array([[3, 3, 2, -1], [-1, -1, -1, -1], [0, 7, 7, 0]], np.int64)
    per_rank, per_rdma, per_expert, in_rank = ref.get_dispatch_layout(topk_idx, 4, 8, 2)
    assert per_rank.tolist() == [1, 1, 0, 1]
    assert per_rdma.tolist() == [2, 1]
    assert per_expert.tolist() == [1, 0, 1, 1, 0, 0, 0, 1]
    assert in_rank.astype(bool).tolist() == [[False, True, False, False], [False] * 4, [True, False, False, True]]


@pytest.mark.parametrize("bad", [8, -2, 1 << 40])
def test_layout_rejects_out_of_range_ids(bad):
    topk_idx = np.zeros((4, 2), np.int64)
    topk_idx[2, 1] = bad
    with pytest.raises(ValueError, match=f"topk_idx.*{bad}"):
        ref.get_dispatch_layout(topk_idx, 2, 8, 2)


def test_layout_rejects_bad_sizes():
    topk_idx = np.zeros((4, 2), np.int64)
    with pytest.raises(ValueError, match="num_experts"):
        ref.get_dispatch_layout(topk_idx, 4, 6, 4)
    with pytest.raises(ValueError, match="num_nvl_ranks"):
        ref.get_dispatch_layout(topk_idx, 4, 8, 3)


def bf16_rows(num_tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """bf16 rows whose 128-channel groups span many magnitudes, one group all zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    magnitude = 2.0 ** torch.randint(-20, 20, (num_tokens, hidden // 128, 1), generator=gen).float()
    x = (x.view(num_tokens, hidden // 128, 128) * magnitude).view(num_tokens, hidden)
    x[0, :128] = 0
    return x.to(torch.bfloat16)


def cast(x: torch.Tensor, round_scale: bool, use_ue8m0: bool):
    bits = x.view(torch.int16).numpy().view(np.uint16)
    return ref.cast_to_fp8(bits, round_scale, use_ue8m0)


def group_amax(x: torch.Tensor) -> np.ndarray:
    t, h = x.shape
    return x.float().abs().view(t, h // 128, 128).amax(-1).numpy()


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_round_trip_within_half_an_e4m3_step(round_scale):
    x = bf16_rows(16, 1024, seed=7)
    q, scales, packed = cast(x, round_scale, use_ue8m0=False)
    assert q.shape == (16, 1024) and q.dtype == np.uint8
    assert scales.shape == (16, 8) and scales.dtype == np.float32
    assert packed.shape == (16, 0)
    dequant = torch.from_numpy(q).view(torch.float8_e4m3fn).float() * torch.from_numpy(scales).repeat_interleave(128, 1)
    assert torch.isfinite(dequant).all()
    err = (dequant - x.float()).abs().view(16, 8, 128).amax(-1).numpy()
    amax = group_amax(x)
    # e4m3 keeps 3 mantissa bits: rounding is off by at most 2^-4 of a value.
    assert (err <= 2.0 ** -4 * amax).all(), f"worst relative error {np.max(err / np.maximum(amax, 1e-30))}"
    assert (dequant[0, :128] == 0).all(), "an all-zero group must stay zero"


def test_fp8_scale_is_amax_over_448():
    x = bf16_rows(8, 512, seed=8)
    _, scales, _ = cast(x, round_scale=False, use_ue8m0=False)
    amax = np.maximum(group_amax(x), 1e-4)  # the floor keeps a zero group's scale finite
    np.testing.assert_allclose(scales, amax / 448, rtol=1e-6)


def test_fp8_round_scale_is_the_next_power_of_two():
    x = bf16_rows(8, 512, seed=9)
    _, scales, _ = cast(x, round_scale=True, use_ue8m0=False)
    mantissa, _ = np.frexp(scales)
    assert (mantissa == 0.5).all(), "round_scale scales must be powers of two"
    need = np.maximum(group_amax(x), 1e-4) / 448
    assert (scales >= need).all() and (scales / 2 < need).all(), "not the smallest power of two >= amax / 448"


def test_ue8m0_bytes_are_the_scale_exponents():
    x = bf16_rows(8, 1024, seed=10)
    _, scales, packed = cast(x, round_scale=True, use_ue8m0=True)
    assert packed.shape == (8, 2) and packed.dtype == np.uint32
    exponents = (scales.view(np.uint32) >> 23) & 0xFF
    # Byte j of word i (bits 8j..8j+7) is group 4i + j.
    unpacked = (packed[:, :, None] >> (8 * np.arange(4, dtype=np.uint32))) & 0xFF
    np.testing.assert_array_equal(unpacked.reshape(8, 8), exponents)


def test_fp8_cast_rejects_bad_shapes():
    with pytest.raises(ValueError, match="hidden"):
        cast(bf16_rows(2, 256, seed=1)[:, :200].contiguous(), False, False)
    with pytest.raises(ValueError, match="use_ue8m0"):
        cast(bf16_rows(2, 512, seed=1), round_scale=False, use_ue8m0=True)
    with pytest.raises(ValueError, match="hidden"):
        cast(bf16_rows(2, 256, seed=1), round_scale=True, use_ue8m0=True)


def python_logfmt_bytes(x: torch.Tensor):
    """(ours, DeepEP's) bytes of one bf16 row, from the rules as README states them."""
    groups = x.float().abs().view(-1, 128)
    amax = groups.amax(-1)
    below = (amax < 1).numpy()  # NaN is not below 1
    ours = int(np.where(below, 164, 260).sum())
    chunk_groups = 8 if x.shape[0] % 1024 == 0 else 4
    deepep = 0
    for c in range(0, len(below), chunk_groups):
        g = slice(c, c + chunk_groups)
        cast = below[g].all() and bool((groups[g].amin(-1) < amax[g]).all())
        deepep += (164 if cast else 260) * len(below[g])
    return ours, deepep


@pytest.mark.parametrize("hidden", [128, 1408, 7168])
def test_logfmt_bytes_match_python(hidden):
    gen = torch.Generator().manual_seed(hidden)
    for scale in (1e-3, 0.1, 0.5, 2.0):
        x = torch.randn(hidden, generator=gen) * scale
        x[torch.randint(0, hidden, (hidden // 64,), generator=gen)] = 0
        x = x.to(torch.bfloat16)
        bits = x.view(torch.int16).numpy().view(np.uint16)
        assert (ref.logfmt_row_bytes_ours(bits), ref.logfmt_row_bytes_deepep(bits)) == python_logfmt_bytes(x)


def test_logfmt_bound_keeps_the_shape_and_goes_row_by_row():
    x = bf16_rows(4, 512, seed=12) * 2.0 ** -24  # every group below 1: all cast
    bits = x.view(torch.int16).numpy().view(np.uint16)
    bound = ref.logfmt_error_bound(bits)
    assert bound.shape == (4, 512) and bound.dtype == np.float64
    for t in range(4):
        np.testing.assert_array_equal(ref.logfmt_error_bound(bits[t]), bound[t])
    # Every value errs by at most 2.3% (32 octaves over 510 steps), zeros not at all.
    v = np.abs(x.float().double().numpy())
    assert (bound <= 0.023 * v + 2.0 ** -149).all()
    assert (bound[v == 0] == 0).all() and (bound[v > 0] > 0).all()
    with pytest.raises(ValueError, match="x"):
        ref.logfmt_row_bytes_ours(bits)  # one row at a time


# ---------------------------------------------------------------------------------------------------------------
# Low-latency dispatch and combine


def bf16_bits(rng: np.random.Generator, shape) -> np.ndarray:
    """Random bf16 values (normal, no NaN) as their uint16 bits."""
    return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def python_ll_rows(topk_idx, num_ranks: int, num_experts: int):
    """rows[dst][le]: the (source rank, source token) pairs local expert le of rank dst
    receives, in canonical order; a token naming an expert twice is sent once."""
    per_rank = num_experts // num_ranks
    rows = [[[] for _ in range(per_rank)] for _ in range(num_ranks)]
    for s, ids in enumerate(topk_idx):
        for t, row in enumerate(ids):
            for e in sorted({int(e) for e in row if e >= 0}):
                rows[e // per_rank][e % per_rank].append((s, t))
    for dst in rows:
        for expert in dst:
            expert.sort()
    return rows


def ll_inputs(num_ranks, num_tokens, hidden, num_topk, num_experts, seed, empty_rank=-1):
    rng = np.random.default_rng(seed)
    xs, ids = [], []
    for r in range(num_ranks):
        t = 0 if r == empty_rank else num_tokens
        xs.append(bf16_bits(rng, (t, hidden)))
        # With replacement from [-1, E): empty slots and duplicates in a row.
        ids.append(rng.integers(-1, num_experts, size=(t, num_topk), dtype=np.int64))
    return xs, ids


LL_CASES = [
    # (ranks, tokens, M, hidden, top-k, experts, empty rank)
    (2, 5, 8, 256, 3, 8, -1),
    (4, 16, 16, 512, 8, 8, 2),
    (3, 7, 9, 1024, 9, 12, 0),
    (2, 1, 1, 2880, 1, 2, -1),  # bf16 takes a hidden that is not a multiple of 128
    (8, 6, 6, 128, 4, 64, 7),
]


@pytest.mark.parametrize("num_ranks, num_tokens, m, hidden, num_topk, num_experts, empty_rank", LL_CASES)
def test_ll_dispatch_matches_python(num_ranks, num_tokens, m, hidden, num_topk, num_experts, empty_rank):
    xs, ids = ll_inputs(num_ranks, num_tokens, hidden, num_topk, num_experts, seed=num_ranks * 31 + hidden,
                        empty_rank=empty_rank)
    results = ref.low_latency_dispatch(xs, ids, m, num_experts)
    want = python_ll_rows(ids, num_ranks, num_experts)
    per_rank = num_experts // num_ranks
    assert len(results) == num_ranks
    total = 0
    for dst, res in enumerate(results):
        assert res.num_local_experts == per_rank and res.num_ranks == num_ranks and res.hidden == hidden
        assert res.recv_count.dtype == np.int32 and res.recv_count.shape == (per_rank,)
        assert res.layout_range.dtype == np.int64 and res.layout_range.shape == (per_rank, num_ranks)
        for le in range(per_rank):
            rows = want[dst][le]
            total += len(rows)
            assert res.recv_count[le] == len(rows), f"rank {dst} expert {le}"
            np.testing.assert_array_equal(res.recv_src_rank(le), [s for s, _ in rows])
            np.testing.assert_array_equal(res.recv_src_token(le), [t for _, t in rows])
            got_x = res.recv_x(le)
            assert got_x.shape == (len(rows), hidden) and got_x.dtype == np.uint16
            for i, (s, t) in enumerate(rows):
                np.testing.assert_array_equal(got_x[i], xs[s][t], err_msg=f"rank {dst} expert {le} row {i}")
            # (begin << 32) | count, groups by source rank ascending.
            begin = 0
            for s in range(num_ranks):
                count = sum(1 for src, _ in rows if src == s)
                assert res.layout_range[le, s] == (begin << 32) | count, f"rank {dst} expert {le} source {s}"
                begin += count
    assert total == sum(len({int(e) for e in row if e >= 0}) for r_ids in ids for row in r_ids)


@pytest.mark.parametrize("round_scale, use_ue8m0", [(False, False), (True, False), (True, True)])
def test_ll_dispatch_fp8_rows_are_the_cast_of_the_source_row(round_scale, use_ue8m0):
    num_ranks, hidden, num_experts = 4, 1024, 16
    xs, ids = ll_inputs(num_ranks, 9, hidden, 6, num_experts, seed=5, empty_rank=1)
    results = ref.low_latency_dispatch(xs, ids, 12, num_experts, use_fp8=True, round_scale=round_scale,
                                       use_ue8m0=use_ue8m0)
    casts = [ref.cast_to_fp8(x, round_scale, use_ue8m0) for x in xs]
    want = python_ll_rows(ids, num_ranks, num_experts)
    checked = 0
    for dst, res in enumerate(results):
        assert res.use_fp8 and res.use_ue8m0 == use_ue8m0
        with pytest.raises(ValueError, match="use_fp8"):
            res.recv_x(0)
        for le in range(res.num_local_experts):
            q, scales = res.recv_x_fp8(le), res.recv_scales(le)
            assert q.dtype == np.uint8 and q.shape == (len(want[dst][le]), hidden)
            assert scales.dtype == np.float32 and scales.shape == (len(want[dst][le]), hidden // 128)
            if use_ue8m0:
                packed = res.recv_packed_scales(le)
                assert packed.dtype == np.uint32 and packed.shape == (len(want[dst][le]), hidden // 512)
            else:
                with pytest.raises(ValueError, match="use_ue8m0"):
                    res.recv_packed_scales(le)
            for i, (s, t) in enumerate(want[dst][le]):
                np.testing.assert_array_equal(q[i], casts[s][0][t])
                np.testing.assert_array_equal(scales[i].view(np.uint32), casts[s][1][t].view(np.uint32))
                if use_ue8m0:
                    np.testing.assert_array_equal(packed[i], casts[s][2][t])
                checked += 1
    assert checked > 0


def gpu_like_expert(rng, rows, num_ranks: int, num_slots: int):
    """One expert's rows laid out as a GPU may: source groups in a random
    order, rows shuffled inside each group, garbage past recv_count. Returns
    (src_info [num_slots], layout_range [R], the canonical row at each GPU row)."""
    src_info = rng.integers(-5, 1000, size=num_slots).astype(np.int32)
    layout_range = np.zeros(num_ranks, np.int64)
    canonical_at = np.full(num_slots, -1)
    at = 0
    for s in rng.permutation(num_ranks):
        group = [i for i, (src, _) in enumerate(rows) if src == s]
        layout_range[s] = (at << 32) | len(group)
        for i in rng.permutation(group) if group else []:
            src_info[at] = rows[i][1]
            canonical_at[at] = i
            at += 1
    return src_info, layout_range, canonical_at


def test_ll_canonical_order_undoes_any_gpu_order():
    num_ranks, num_experts, m = 4, 8, 10
    xs, ids = ll_inputs(num_ranks, m, 128, 5, num_experts, seed=11)
    results = ref.low_latency_dispatch(xs, ids, m, num_experts)
    rng = np.random.default_rng(3)
    for res in results:
        for le in range(res.num_local_experts):
            rows = list(zip(res.recv_src_rank(le).tolist(), res.recv_src_token(le).tolist()))
            src_info, layout_range, canonical_at = gpu_like_expert(rng, rows, num_ranks, m * num_ranks)
            perm = ref.low_latency_canonical_order(src_info, layout_range, len(rows))
            assert perm.dtype == np.int32 and perm.shape == (len(rows),)
            np.testing.assert_array_equal(canonical_at[perm], np.arange(len(rows)))
            np.testing.assert_array_equal(src_info[perm], res.recv_src_token(le))


def test_ll_canonical_order_rejects_bad_layouts():
    src_info = np.array([4, 2, 7, 1, 0, 99], np.int32)
    good = np.array([(0 << 32) | 2, (2 << 32) | 3], np.int64)
    np.testing.assert_array_equal(ref.low_latency_canonical_order(src_info, good, 5), [1, 0, 4, 3, 2])
    with pytest.raises(ValueError, match="overlaps"):
        ref.low_latency_canonical_order(src_info, np.array([(0 << 32) | 3, (2 << 32) | 3], np.int64), 6)
    with pytest.raises(ValueError, match="cover"):
        ref.low_latency_canonical_order(src_info, np.array([(0 << 32) | 2, (3 << 32) | 2], np.int64), 5)
    with pytest.raises(ValueError, match="pass recv_count"):
        ref.low_latency_canonical_order(src_info, good, 4)
    with pytest.raises(ValueError, match="twice"):
        ref.low_latency_canonical_order(np.array([3, 3], np.int32), np.array([2, 0], np.int64), 2)
    with pytest.raises(ValueError, match="recv_count"):
        ref.low_latency_canonical_order(src_info, good, 7)


def python_ll_combine(expert_x, ids, weights, rows, num_ranks: int, num_experts: int, hidden: int):
    """fp64 combine from the canonical rows of python_ll_rows."""
    per_rank = num_experts // num_ranks
    out = []
    for s in range(num_ranks):
        acc = np.zeros((len(ids[s]), hidden))
        for t, row in enumerate(ids[s]):
            for k, e in enumerate(row):
                if e < 0:
                    continue
                owner, le = int(e) // per_rank, int(e) % per_rank
                i = rows[owner][le].index((s, t))
                acc[t] += float(weights[s][t, k]) * bf16_values(expert_x[owner][le][i])
        out.append(acc)
    return out


@pytest.mark.parametrize("num_ranks, num_tokens, m, hidden, num_topk, num_experts, empty_rank", LL_CASES)
def test_ll_combine_matches_python(num_ranks, num_tokens, m, hidden, num_topk, num_experts, empty_rank):
    xs, ids = ll_inputs(num_ranks, num_tokens, hidden, num_topk, num_experts, seed=num_ranks * 7 + num_topk,
                        empty_rank=empty_rank)
    results = ref.low_latency_dispatch(xs, ids, m, num_experts)
    rng = np.random.default_rng(num_tokens)
    # Expert outputs unrelated to what was dispatched, and weights of either sign.
    expert_x = [[bf16_bits(rng, (int(res.recv_count[le]), hidden)) for le in range(res.num_local_experts)]
                for res in results]
    weights = [rng.uniform(-1, 1, size=i.shape).astype(np.float32) for i in ids]
    got = ref.low_latency_combine(expert_x, ids, weights, results)
    want = python_ll_combine(expert_x, ids, weights, python_ll_rows(ids, num_ranks, num_experts), num_ranks,
                             num_experts, hidden)
    for s in range(num_ranks):
        assert got[s].dtype == np.float64 and got[s].shape == (len(ids[s]), hidden)
        np.testing.assert_allclose(got[s], want[s], rtol=1e-12, atol=0, err_msg=f"rank {s}")
    # One rank's result from the rows that came from it alone.
    only = num_ranks - 1
    mine = [[res.recv_src_rank(le) == only for le in range(res.num_local_experts)] for res in results]
    expert_mine = [[expert_x[r][le][mine[r][le]] for le in range(results[r].num_local_experts)]
                   for r in range(num_ranks)]
    ids_mine = [i if r == only else None for r, i in enumerate(ids)]
    weights_mine = [w if r == only else None for r, w in enumerate(weights)]
    alone = ref.low_latency_combine(expert_mine, ids_mine, weights_mine, results, only_rank=only)
    assert all(a is None for r, a in enumerate(alone) if r != only)
    np.testing.assert_array_equal(alone[only], got[only])


def test_ll_duplicate_expert_is_one_row_weighted_twice():
    # Rank 0's token 0 names expert 3 twice; rank 1 sends nothing.
    x0 = bf16_bits(np.random.default_rng(1), (1, 256))
    ids = [np.array([[3, -1, 3]], np.int64), np.zeros((0, 3), np.int64)]
    xs = [x0, np.zeros((0, 256), np.uint16)]
    results = ref.low_latency_dispatch(xs, ids, 2, 4)
    assert results[1].recv_count.tolist() == [0, 1]
    assert results[0].recv_count.tolist() == [0, 0]
    assert results[1].layout_range[1].tolist() == [1, 1 << 32]  # source 1: no rows, from row 1
    assert results[1].recv_src_token(1).tolist() == [0]
    np.testing.assert_array_equal(results[1].recv_x(1)[0], x0[0])
    weights = [np.array([[0.25, 5.0, 0.5]], np.float32), np.zeros((0, 3), np.float32)]
    expert_x = [[np.zeros((0, 256), np.uint16)] * 2, [np.zeros((0, 256), np.uint16), x0]]
    out = ref.low_latency_combine(expert_x, ids, weights, results)
    np.testing.assert_array_equal(out[0][0], 0.75 * bf16_values(x0[0]))
    assert out[1].shape == (0, 256)


def test_ll_reference_rejects_bad_input():
    xs, ids = ll_inputs(2, 4, 256, 2, 8, seed=2)
    bad = [ids[0].copy(), ids[1]]
    bad[0][1, 1] = 8
    with pytest.raises(ValueError, match="topk_idx"):
        ref.low_latency_dispatch(xs, bad, 4, 8)
    bad[0][1, 1] = -2
    with pytest.raises(ValueError, match="topk_idx"):
        ref.low_latency_dispatch(xs, bad, 4, 8)
    with pytest.raises(ValueError, match="num_tokens"):
        ref.low_latency_dispatch(xs, ids, 3, 8)  # T = 4 > M = 3
    with pytest.raises(ValueError, match="num_experts"):
        ref.low_latency_dispatch(xs, ids, 4, 7)
    with pytest.raises(ValueError, match="use_ue8m0"):
        ref.low_latency_dispatch(xs, ids, 4, 8, use_fp8=True, use_ue8m0=True)
    with pytest.raises(ValueError, match="hidden"):
        ref.low_latency_dispatch([x[:, :200].copy() for x in xs], ids, 4, 8, use_fp8=True)
    with pytest.raises(ValueError, match="topk_idx"):
        ref.low_latency_dispatch(xs, [ids[0], ids[1][:3].copy()], 4, 8)
    results = ref.low_latency_dispatch(xs, ids, 4, 8)
    with pytest.raises(ValueError, match="local_expert"):
        results[0].recv_x(4)
    expert_x = [[res.recv_x(le) for le in range(res.num_local_experts)] for res in results]
    weights = [np.ones(i.shape, np.float32) for i in ids]
    short = [list(e) for e in expert_x]
    short[1][0] = short[1][0][:-1] if len(short[1][0]) else np.zeros((1, 256), np.uint16)
    with pytest.raises(ValueError, match=r"expert_x\[1\]\[0\]"):
        ref.low_latency_combine(short, ids, weights, results)
    # Combine names an expert that its dispatch did not.
    moved = [ids[0].copy(), ids[1]]
    moved[0][0] = [next(e for e in range(8) if e not in ids[0][0]), -1]
    with pytest.raises(ValueError, match="not dispatched"):
        ref.low_latency_combine(expert_x, moved, weights, results)
    with pytest.raises(ValueError, match="only_rank"):
        ref.low_latency_combine(expert_x, ids, weights, results, only_rank=2)
    with pytest.raises(ValueError, match="None"):
        ref.low_latency_combine(expert_x, [ids[0], None], weights, results)


# ---------------------------------------------------------------------------------------------------------------
# Internode normal mode


def internode_inputs(num_ranks: int, num_nvl_ranks: int, num_experts: int, num_topk: int, hidden: int, seed: int):
    """Every rank's (x bytes, topk_idx, topk_weights, is_token_in_rank); rank 1 has no tokens."""
    rng = np.random.default_rng(seed)
    xs, ids, weights, in_rank = [], [], [], []
    for r in range(num_ranks):
        t = 0 if r == 1 else int(rng.integers(1, 30))
        xs.append(bf16_bits(rng, (t, hidden)).view(np.uint8))
        ids.append(rng.integers(-1, num_experts, size=(t, num_topk), dtype=np.int64))
        weights.append(rng.random((t, num_topk), dtype=np.float32))
        in_rank.append(ref.get_dispatch_layout(ids[-1], num_ranks, num_experts, num_nvl_ranks)[3])
    return xs, ids, weights, in_rank


@pytest.mark.parametrize("num_ranks, num_nvl_ranks", [(4, 2), (8, 4), (8, 2), (16, 8), (6, 1), (4, 4)])
def test_internode_dispatch_is_intranode_plus_the_handle(num_ranks, num_nvl_ranks):
    num_experts, num_topk, hidden, channels = 4 * num_ranks, 6, 16, 3
    xs, ids, weights, in_rank = internode_inputs(num_ranks, num_nvl_ranks, num_experts, num_topk, hidden,
                                                 seed=num_ranks * 10 + num_nvl_ranks)
    args = (xs, [None] * num_ranks, ids, weights, in_rank, num_experts, 4)
    normal = ref.normal_dispatch(*args)
    out = ref.internode_dispatch(*args, num_nvl_ranks, channels)
    num_domains = num_ranks // num_nvl_ranks
    for r, (d, n) in enumerate(zip(out, normal)):
        for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "recv_src_rank",
                     "rank_prefix_matrix"):
            np.testing.assert_array_equal(getattr(d, name), getattr(n, name), err_msg=f"rank {r} {name}")
        assert d.num_recv_tokens_per_expert == n.num_recv_tokens_per_expert
        assert d.num_nvl_ranks == num_nvl_ranks and d.num_channels == channels
        np.testing.assert_array_equal(d.is_token_in_rank, in_rank[r])
        np.testing.assert_array_equal(d.recv_gbl_rank_prefix_sum, n.rank_prefix_matrix[:, r])
        # [4]: what the peer of each domain sends to this rank's domain, as its layout counts it.
        local, domain = r % num_nvl_ranks, r // num_nvl_ranks
        per_domain = [ref.get_dispatch_layout(ids[s * num_nvl_ranks + local], num_ranks, num_experts,
                                              num_nvl_ranks)[1][domain] for s in range(num_domains)]
        np.testing.assert_array_equal(d.recv_rdma_rank_prefix_sum, np.cumsum(per_domain))
        assert d.num_forward == sum(per_domain)
        shapes = {"rdma_channel_prefix_matrix": (num_domains, channels),
                  "gbl_channel_prefix_matrix": (num_ranks, channels),
                  "recv_rdma_channel_prefix_matrix": (num_domains, channels),
                  "recv_gbl_channel_prefix_matrix": (num_ranks, channels),
                  "send_rdma_head": (len(ids[r]), num_domains), "send_nvl_head": (d.num_forward, num_nvl_ranks),
                  "recv_nvl_mask": (d.num_recv,), "forward_src_idx": (d.num_forward,)}
        for name, shape in shapes.items():
            assert getattr(d, name).shape == shape, f"rank {r} {name}"
        np.testing.assert_array_equal(d.gbl_channel_prefix_matrix[:, -1], in_rank[r].sum(0))
        # The rows of each forwarded token's mask bits hold that token.
        for i in range(d.num_forward):
            src = d.forward_src_domain[i] * num_nvl_ranks + local
            for j in range(num_nvl_ranks):
                assert bool(d.forward_nvl_mask[i] >> j & 1) == bool(in_rank[src][d.forward_src_idx[i], domain *
                                                                                   num_nvl_ranks + j])


def test_internode_combine_matches_normal_and_rounds_remote_partials():
    num_ranks, num_nvl_ranks, num_experts, num_topk, hidden = 8, 2, 32, 4, 16
    xs, ids, weights, in_rank = internode_inputs(num_ranks, num_nvl_ranks, num_experts, num_topk, hidden, seed=3)
    args = (xs, [None] * num_ranks, ids, weights, in_rank, num_experts, 1)
    normal, out = ref.normal_dispatch(*args), ref.internode_dispatch(*args, num_nvl_ranks)
    rows = [d.recv_x.view(np.uint16) for d in out]
    ws = [d.recv_topk_weights for d in out]
    none = [None] * num_ranks
    want = ref.normal_combine(rows, ws, none, none, normal, hidden, num_topk)
    exact = ref.internode_combine(rows, ws, none, none, out, hidden, num_topk, round_remote_partials=False)
    rounded = ref.internode_combine(rows, ws, none, none, out, hidden, num_topk)
    for r in range(num_ranks):
        np.testing.assert_array_equal(exact[r][0], want[r][0])
        np.testing.assert_array_equal(exact[r][1], want[r][1])
        assert rounded[r][0].shape == (len(ids[r]), hidden)
        # Each remote partial moves by at most half a bf16 step: 2^-8 of the rows it sums.
        np.testing.assert_array_less(np.abs(rounded[r][0] - want[r][0]),
                                     in_rank[r].sum(1, keepdims=True) * np.abs(bf16_values(xs[r].view(np.uint16)))
                                     * 2.0 ** -8 + 1e-300)
    only = ref.internode_combine(rows, ws, none, none, out, hidden, num_topk, only_rank=5)
    assert only[0] is None
    np.testing.assert_array_equal(only[5][0], rounded[5][0])


def test_internode_wire_counts_copies_per_domain():
    num_ranks, num_nvl_ranks, num_experts = 8, 4, 32
    _, ids, _, in_rank = internode_inputs(num_ranks, num_nvl_ranks, num_experts, 8, 16, seed=9)
    params = ref.InternodeWireParams()
    params.row_bytes, params.num_scales, params.num_topk, params.hidden = 7168, 56, 8, 7168
    params.num_nvl_ranks, params.num_channels, params.chunk_tokens = num_nvl_ranks, 2, 4
    rows = ref.internode_wire(in_rank, params)
    ours = ref.turnout_dispatch_token_bytes(7168, 56, 8)
    assert ours == ref.deepep_dispatch_token_bytes(7168, 56, 8) == 7472
    for r, row in enumerate(rows):
        domain = r // num_nvl_ranks
        others = [d for d in range(num_ranks // num_nvl_ranks) if d != domain]
        by_domain = in_rank[r].reshape(len(ids[r]), num_ranks // num_nvl_ranks, num_nvl_ranks)
        assert row["token_domain_pairs"] == int(by_domain[:, others].any(2).sum())
        assert row["token_rank_pairs"] == int(by_domain[:, others].sum())
        assert row["dispatch_turnout_bytes"] == row["token_domain_pairs"] * ours
        assert row["dispatch_per_rank_bytes"] == row["token_rank_pairs"] * ours
        assert row["dispatch_turnout_messages"] <= row["token_domain_pairs"] <= 4 * row["dispatch_turnout_messages"]
    assert sum(r["combine_turnout_bytes"] for r in rows) == \
        sum(r["token_domain_pairs"] for r in rows) * ref.turnout_combine_token_bytes(7168, 8)


def test_internode_reference_rejects_bad_domains():
    xs, ids, weights, in_rank = internode_inputs(4, 2, 16, 2, 16, seed=1)
    with pytest.raises(ValueError, match="num_nvl_ranks"):
        ref.internode_dispatch(xs, [None] * 4, ids, weights, in_rank, 16, 1, 3)
    params = ref.InternodeWireParams()
    params.row_bytes, params.hidden, params.num_nvl_ranks = 32, 16, 2
    with pytest.raises(ValueError, match="is_token_in_rank"):
        ref.internode_wire([m[:, :2] for m in in_rank], params)


def test_normal_dispatch_only_rank_keeps_one_ranks_rows():
    num_ranks, num_nvl_ranks, num_experts, num_topk, hidden = 4, 4, 16, 4, 16
    xs, ids, weights, in_rank = internode_inputs(num_ranks, num_nvl_ranks, num_experts, num_topk, hidden, seed=5)
    args = (xs, [None] * num_ranks, ids, weights, in_rank, num_experts, 1)
    full = ref.normal_dispatch(*args)
    some = ref.normal_dispatch(*args, only_rank=2)
    for r in range(num_ranks):
        assert some[r].num_recv == full[r].num_recv > 0
        for name in ("recv_src_rank", "recv_src_idx", "recv_topk_idx", "recv_topk_weights"):
            np.testing.assert_array_equal(getattr(some[r], name), getattr(full[r], name), err_msg=f"rank {r} {name}")
        if r == 2:
            np.testing.assert_array_equal(some[r].recv_x, full[r].recv_x)
        else:
            with pytest.raises(ValueError, match="only_rank"):
                _ = some[r].recv_x
    with pytest.raises(ValueError, match="rows_for_rank"):
        ref.normal_dispatch(*args, only_rank=num_ranks)


# ---------------------------------------------------------------------------------------------------------------
# Internode shrink mode: masked ranks, substitute forwarders


def reduced_internode_inputs(xs, ids, weights, num_ranks, num_nvl_ranks, num_experts, masked):
    """The inputs as the GPU tests reduce them: a masked rank sends nothing, no token goes to its experts."""
    per_rank = num_experts // num_ranks
    out = ([], [], [], [])
    for r in range(num_ranks):
        x, i, w = xs[r], ids[r].copy(), weights[r]
        if r in masked:
            x, i, w = x[:0], i[:0], w[:0]
        i[(i >= 0) & np.isin(i // per_rank, sorted(masked))] = -1
        for part, value in zip(out, (x, i, w, ref.get_dispatch_layout(i, num_ranks, num_experts, num_nvl_ranks)[3])):
            part.append(value)
    return out


def test_internode_forwarders_substitute_the_next_live_column():
    forwarder, part, num_parts = ref.internode_forwarders(8, 4, live=[1, 1, 1, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(forwarder, [[0, 1, 2, 3], [0, 3, 3, 3]])
    np.testing.assert_array_equal(part, [[0, 0, 0, 0], [0, 0, 1, 2]])
    np.testing.assert_array_equal(num_parts, [1, 1, 1, 1, 1, 0, 0, 3])
    forwarder, _, num_parts = ref.internode_forwarders(4, 2, live=np.array([False, False, True, True]))
    np.testing.assert_array_equal(forwarder, [[-1, -1], [0, 1]])
    np.testing.assert_array_equal(ref.internode_forwarders(4, 2)[0], [[0, 1], [0, 1]])
    with pytest.raises(ValueError, match="live"):
        ref.internode_forwarders(4, 2, live=[1, 1, 1])


@pytest.mark.parametrize("num_ranks, num_nvl_ranks, masked", [(4, 2, {3}), (8, 4, {4, 7}), (8, 2, {1, 2}),
                                                               (16, 8, {0, 9, 10}), (4, 2, {0})])
def test_internode_dispatch_with_masked_ranks_is_intranode_on_the_reduced_routing(num_ranks, num_nvl_ranks, masked):
    num_experts, num_topk, hidden, channels = 4 * num_ranks, 6, 16, 3
    xs, ids, weights, in_rank = internode_inputs(num_ranks, num_nvl_ranks, num_experts, num_topk, hidden,
                                                 seed=num_ranks + 7 * num_nvl_ranks)
    live = [r not in masked for r in range(num_ranks)]
    out = ref.internode_dispatch(xs, [None] * num_ranks, ids, weights, in_rank, num_experts, 1, num_nvl_ranks,
                                 channels, live=live)
    rx, rids, rw, rin = reduced_internode_inputs(xs, ids, weights, num_ranks, num_nvl_ranks, num_experts, masked)
    want = ref.normal_dispatch(rx, [None] * num_ranks, rids, rw, rin, num_experts, 1)
    forwarder, _, num_parts = ref.internode_forwarders(num_ranks, num_nvl_ranks, live=live)
    num_domains = num_ranks // num_nvl_ranks
    for r, (d, w) in enumerate(zip(out, want)):
        for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "recv_src_rank"):
            np.testing.assert_array_equal(getattr(d, name), getattr(w, name), err_msg=f"rank {r} {name}")
        np.testing.assert_array_equal(d.live, live)
        assert d.num_parts == num_parts[r]
        assert d.recv_rdma_rank_prefix_sum.shape == (num_domains * d.num_parts,)
        assert d.recv_rdma_channel_prefix_matrix.shape == (num_domains * d.num_parts, channels)
        assert d.send_nvl_head.shape == (d.num_forward, num_nvl_ranks)
        domain, local = divmod(r, num_nvl_ranks)
        # Each forwarded token's source column is one this rank forwards.
        for src in d.forward_src_rank:
            assert forwarder[domain, src % num_nvl_ranks] == local
    # The sums do not depend on who forwards: the reduced routing with every rank live gives the same bits.
    plain = ref.internode_dispatch(rx, [None] * num_ranks, rids, rw, rin, num_experts, 1, num_nvl_ranks)
    rows = [d.recv_x.view(np.uint16) for d in out]
    ws = [d.recv_topk_weights for d in out]
    none = [None] * num_ranks
    shrunk = ref.internode_combine(rows, ws, none, none, out, hidden, num_topk)
    every = ref.internode_combine(rows, ws, none, none, plain, hidden, num_topk)
    for r in range(num_ranks):
        np.testing.assert_array_equal(shrunk[r][0], every[r][0])
        np.testing.assert_array_equal(shrunk[r][1], every[r][1])
    # A rank lost before combine: its rows leave the sums, its result is None.
    lost = max(set(range(num_ranks)) - masked)
    later = [r not in masked and r != lost for r in range(num_ranks)]
    zeroed = [np.zeros_like(x) if r == lost else x for r, x in enumerate(rows)]
    zeroed_ws = [np.zeros_like(w) if r == lost else w for r, w in enumerate(ws)]
    without = ref.internode_combine(rows, ws, none, none, out, hidden, num_topk, round_remote_partials=False,
                                    live=later)
    want_sums = ref.normal_combine(zeroed, zeroed_ws, none, none, want, hidden, num_topk)
    for r in range(num_ranks):
        if not later[r]:
            assert without[r] is None, f"rank {r} sat the combine out"
            continue
        np.testing.assert_array_equal(without[r][0], want_sums[r][0])
        np.testing.assert_array_equal(without[r][1], want_sums[r][1])
    # drop_lost_partials: the partials the lost rank forwarded into its domain for other
    # domains' sources are lost too: those sources' rows there read as zeros.
    lost_domain, lost_local = divmod(lost, num_nvl_ranks)
    dropped_rows = [x.copy() for x in zeroed]
    dropped_ws = [w.copy() for w in zeroed_ws]
    beyond_lost = 0  # rows forwarded by the lost rank to another rank of its domain
    for dst in range(lost_domain * num_nvl_ranks, (lost_domain + 1) * num_nvl_ranks):
        src = want[dst].recv_src_rank
        forwarded = (src // num_nvl_ranks != lost_domain) & (forwarder[lost_domain, src % num_nvl_ranks] == lost_local)
        dropped_rows[dst][forwarded] = 0
        dropped_ws[dst][forwarded] = 0
        beyond_lost += int(forwarded.sum()) if dst != lost else 0
    dropped = ref.internode_combine(rows, ws, none, none, out, hidden, num_topk, round_remote_partials=False,
                                    live=later, drop_lost_partials=True)
    want_dropped = ref.normal_combine(dropped_rows, dropped_ws, none, none, want, hidden, num_topk)
    differs = False
    for r in range(num_ranks):
        if not later[r]:
            assert dropped[r] is None
            continue
        np.testing.assert_array_equal(dropped[r][0], want_dropped[r][0])
        np.testing.assert_array_equal(dropped[r][1], want_dropped[r][1])
        differs |= not np.array_equal(dropped[r][0], without[r][0])
    # Only rows the lost rank forwarded to others change a sum (its own are out either way).
    assert differs == (beyond_lost > 0), f"dropping the lost rank's partials changes a sum: {differs}"
    with pytest.raises(ValueError, match="was masked in the dispatch"):
        ref.internode_combine(rows, ws, none, none, out, hidden, num_topk, live=[True] * num_ranks)


def test_internode_wire_with_masked_ranks():
    num_ranks, num_nvl_ranks, num_experts = 8, 4, 32
    xs, ids, weights, in_rank = internode_inputs(num_ranks, num_nvl_ranks, num_experts, 8, 16, seed=19)
    params = ref.InternodeWireParams()
    params.row_bytes, params.hidden, params.num_topk, params.num_nvl_ranks = 256, 128, 8, num_nvl_ranks
    masked = {6}
    live = [r not in masked for r in range(num_ranks)]
    rows = ref.internode_wire(in_rank, params, live=live)
    # The reduced routing with every rank live: rank 6 still forwards column 2 into domain 1.
    plain = ref.internode_wire(reduced_internode_inputs(xs, ids, weights, num_ranks, num_nvl_ranks, num_experts,
                                                        masked)[3], params)
    # Rank 6 sends, forwards and receives nothing; rank 7 carries column 2's combine streams too.
    assert rows[6]["dispatch_turnout_bytes"] == rows[6]["combine_turnout_bytes"] == 0
    assert rows[6]["combine_per_rank_bytes"] == 0
    assert plain[6]["combine_turnout_bytes"] > 0
    assert rows[7]["combine_turnout_bytes"] == plain[6]["combine_turnout_bytes"] + plain[7]["combine_turnout_bytes"]
    for r in range(num_ranks):
        assert rows[r]["dispatch_turnout_bytes"] == plain[r]["dispatch_turnout_bytes"], f"rank {r}"
    assert sum(r["combine_turnout_bytes"] for r in rows) == \
        sum(r["token_domain_pairs"] for r in rows) * ref.turnout_combine_token_bytes(128, 8)
    with pytest.raises(ValueError, match="live"):
        ref.internode_wire(in_rank, params, live=[True] * 3)
