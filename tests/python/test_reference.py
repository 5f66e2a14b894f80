"""The host reference the GPU tests trust: the bound layout against a plain
Python recomputation, and the FP8 cast against its definition."""
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
