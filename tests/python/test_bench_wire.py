"""The low-latency bench's wire accounting (turnout.bench.wire), bytes and
messages, on routings small enough to count by hand."""
import pytest

from turnout.bench.wire import remote_pairs, remote_ranks, wire_bytes

# 2 ranks, 4 experts: experts 0, 1 on rank 0; 2, 3 on rank 1.
ROUTING = [[0, 2],    # rank 0 sees: expert 2 remote (rank 1)          -> 1 rank, 1 expert
           [2, 3],    # both on rank 1                                 -> 1 rank, 2 experts
           [0, 1],    # both local to rank 0                           -> nothing crosses
           [3, -1]]   # one expert on rank 1, one empty slot           -> 1 rank, 1 expert


def by_op(rows):
    return {row["op"]: row for row in rows}


def test_pairs_from_each_side():
    assert remote_pairs(ROUTING, rank=0, num_ranks=2, num_experts=4) == (3, 4)
    # From rank 1, experts 0 and 1 are the remote ones: tokens 0 and 2.
    assert remote_pairs(ROUTING, rank=1, num_ranks=2, num_experts=4) == (2, 3)


def test_bytes_small_hidden():
    # hidden 128: FP8 payload 128 + 1 scale * 4 = 132 bytes, BF16 256.
    rows = by_op(wire_bytes(ROUTING, rank=0, num_ranks=2, num_experts=4, hidden=128))
    assert (rows["dispatch FP8"]["ours_bytes"], rows["dispatch FP8"]["ref_bytes"]) == (3 * (144 + 132), 4 * (132 + 16))
    assert (rows["dispatch BF16"]["ours_bytes"], rows["dispatch BF16"]["ref_bytes"]) == (3 * (144 + 256), 4 * 272)
    # One vector per remote (token, rank), and 4 tokens x 2 slots of 8-byte weights to the one peer.
    assert (rows["combine BF16"]["ours_bytes"], rows["combine BF16"]["ref_bytes"]) == (768 + 64, 1024)
    pre = rows["combine BF16, weights at dispatch"]
    assert (pre["ours_bytes"], pre["ref_bytes"]) == (768, 1024)
    assert pre["ratio"] == pytest.approx(0.75)
    # At this hidden the 144-byte header outweighs what the fewer messages save.
    assert rows["dispatch FP8"]["ratio"] == pytest.approx(828 / 592)
    assert all((r["token_rank_pairs"], r["token_expert_pairs"]) == (3, 4) for r in rows.values())


def test_messages_small_hidden():
    rows = by_op(wire_bytes(ROUTING, rank=0, num_ranks=2, num_experts=4, hidden=128))
    # Header and payload per remote (token, rank), against one message per remote (token, expert).
    assert (rows["dispatch FP8"]["ours_messages"], rows["dispatch FP8"]["ref_messages"]) == (6, 4)
    assert (rows["dispatch BF16"]["ours_messages"], rows["dispatch BF16"]["ref_messages"]) == (6, 4)
    # One row per remote (token, rank), plus one weight per (token, slot) to the one peer: 4 x 2.
    assert (rows["combine BF16"]["ours_messages"], rows["combine BF16"]["ref_messages"]) == (3 + 8, 4)
    pre = rows["combine BF16, weights at dispatch"]
    assert (pre["ours_messages"], pre["ref_messages"], pre["message_ratio"]) == (3, 4, 0.75)
    assert all(r["nvl_domain_size"] is None for r in rows.values())


# 4 ranks, 8 experts (rank r holds 2r, 2r + 1), NVL domains of 2: {0, 1} and {2, 3}.
DOMAIN_ROUTING = [[1, 2, 4],    # rank 0 sees: 1 local, 2 on rank 1 (its domain), 4 on rank 2 -> 1 rank, 1 expert
                  [4, 5, 6],    # 4, 5 on rank 2 and 6 on rank 3, both in the other domain   -> 2 ranks, 3 experts
                  [2, 3, -1]]   # both on rank 1, within the domain                          -> nothing crosses


def test_domains_keep_only_the_other_domains():
    assert remote_ranks(0, 4, 2) == {2, 3}
    assert remote_ranks(3, 4, 2) == {0, 1}
    assert remote_ranks(0, 4) == remote_ranks(0, 4, 0) == remote_ranks(0, 4, 1) == {1, 2, 3}
    assert remote_pairs(DOMAIN_ROUTING, rank=0, num_ranks=4, num_experts=8, nvl_domain_size=2) == (3, 4)
    # Without domains rank 1 counts too: token 0 adds (rank 1, expert 2), token 2 (rank 1, experts 2 and 3).
    assert remote_pairs(DOMAIN_ROUTING, rank=0, num_ranks=4, num_experts=8) == (5, 7)


def test_domain_bytes_and_messages():
    rows = by_op(wire_bytes(DOMAIN_ROUTING, rank=0, num_ranks=4, num_experts=8, hidden=128, nvl_domain_size=2))
    assert (rows["dispatch FP8"]["ours_bytes"], rows["dispatch FP8"]["ref_bytes"]) == (3 * (144 + 132), 4 * (132 + 16))
    assert (rows["dispatch FP8"]["ours_messages"], rows["dispatch FP8"]["ref_messages"]) == (6, 4)
    # The weights go to ranks 2 and 3 only: 3 tokens x 3 slots x 8 bytes each, one put per word.
    combine = rows["combine BF16"]
    assert (combine["ours_bytes"], combine["ref_bytes"]) == (3 * 256 + 2 * 3 * 3 * 8, 4 * 256)
    assert (combine["ours_messages"], combine["ref_messages"]) == (3 + 2 * 3 * 3, 4)
    pre = rows["combine BF16, weights at dispatch"]
    assert (pre["ours_bytes"], pre["ref_bytes"], pre["ours_messages"], pre["ref_messages"]) == (768, 1024, 3, 4)
    assert all(r["nvl_domain_size"] == 2 for r in rows.values())
    # Without domains: every other rank, so 3 peers' weights.
    rows = by_op(wire_bytes(DOMAIN_ROUTING, rank=0, num_ranks=4, num_experts=8, hidden=128))
    assert rows["combine BF16"]["ours_bytes"] == 5 * 256 + 3 * 3 * 3 * 8
    assert rows["combine BF16"]["ours_messages"] == 5 + 3 * 3 * 3


def test_nothing_crosses_within_one_domain():
    rows = wire_bytes(DOMAIN_ROUTING, rank=0, num_ranks=4, num_experts=8, hidden=128, nvl_domain_size=4)
    assert all(r["ours_bytes"] == r["ref_bytes"] == r["ours_messages"] == r["ref_messages"] == 0 for r in rows)
    assert all(r["ratio"] is None and r["message_ratio"] is None for r in rows)


def test_all_experts_on_one_peer_cross_once():
    # EP4, 288 experts (72 per rank): rank 0's token has all 8 experts on rank 2.
    routing = [[144 + k for k in range(8)]]
    rows = by_op(wire_bytes(routing, rank=0, num_ranks=4, num_experts=288, hidden=7168))
    fp8 = 7168 + 7168 // 128 * 4
    assert rows["dispatch FP8"]["ours_bytes"] == 144 + fp8
    assert rows["dispatch FP8"]["ref_bytes"] == 8 * (fp8 + 16)
    assert rows["dispatch FP8"]["ratio"] < 0.5
    assert rows["combine BF16, weights at dispatch"]["ratio"] == pytest.approx(1 / 8)
    # The weights go to the 3 other ranks: 8 slots of 8 bytes each.
    assert rows["combine BF16"]["ratio"] == pytest.approx((2 * 7168 + 3 * 8 * 8) / (8 * 2 * 7168))


def test_nothing_crosses_on_one_rank():
    rows = wire_bytes([[0, 1], [2, 3]], rank=0, num_ranks=1, num_experts=4, hidden=128)
    assert all(r["ours_bytes"] == r["ref_bytes"] == 0 and r["ratio"] is None for r in rows)


@pytest.mark.parametrize("kwargs, match", [
    (dict(topk_idx=[[4]], num_experts=4, hidden=128), "expert 4"),
    (dict(topk_idx=[[0]], num_experts=5, hidden=128), "multiple of num_ranks"),
    (dict(topk_idx=[[0]], num_experts=4, hidden=100), "multiple of 128"),
    (dict(topk_idx=[[0]], num_experts=4, hidden=128, nvl_domain_size=3), "nvl_domain_size"),
    (dict(topk_idx=[[0]], num_experts=4, hidden=128, nvl_domain_size=-2), "nvl_domain_size"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        wire_bytes(rank=0, num_ranks=2, **kwargs)
