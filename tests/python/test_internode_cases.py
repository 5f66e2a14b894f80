"""The GPU tests' internode checks (tests/gpu/internode_cases.py) on the CPU,
for a shrink-mode dispatch with num_worst_tokens: the handle's [3] and [4]
the GPU must give (a row per part a rank may have, those past the parts it
serves with no tokens), and check_dispatch accepting a result made from the
reference that way and refusing one whose padding rows differ."""
import numpy as np
import pytest
import torch

ref = pytest.importorskip("turnout_reference")
from gpu_modules import load_gpu_module  # noqa: E402

import turnout  # noqa: E402

cases = load_gpu_module("gpu_internode_cases", "internode_cases.py")
ic = load_gpu_module("gpu_intranode_cases_for_internode", "intranode_cases.py")

CHANNELS = 4
CASE = ic.Case("uniform", 48, 128, 4, 32)


def shrink_refs(n, d, masked):
    live = [r not in masked for r in range(n)]
    inputs = [ic.inputs_of(CASE, n, r) for r in range(n)]
    return cases.reference_dispatch(CASE, n, d, inputs, CHANNELS, live=live)


@pytest.mark.parametrize("n,d,masked", [(8, 4, {1, 4}), (4, 2, {1, 2}), (8, 2, set()), (4, 1, {0})])
def test_worst_part_rows_pad_the_references_parts_to_a_row_per_part_a_rank_may_have(n, d, masked):
    refs = shrink_refs(n, d, masked)
    num_domains = n // d
    for r in range(n):
        if r in masked:
            continue
        want = refs[r]
        served = num_domains * want.num_parts
        prefix, sums = cases.worst_part_rows(want)
        assert prefix.shape == (num_domains * d, CHANNELS) and sums.shape == (num_domains * d,)
        assert prefix.dtype == sums.dtype == np.int32
        np.testing.assert_array_equal(prefix[:served], want.recv_rdma_channel_prefix_matrix)
        np.testing.assert_array_equal(sums[:served], want.recv_rdma_rank_prefix_sum)
        assert not prefix[served:].any()
        assert (sums[served:] == want.num_forward).all() and sums[-1] == want.num_forward


def test_the_masked_sets_give_substitutes_with_rows_to_pad():
    # 8 ranks as 2 domains of 4, ranks 1 and 4 masked: the next live local index substitutes,
    # rank 2 for column 1 and rank 5 for column 0; both still serve fewer columns than D.
    refs = shrink_refs(8, 4, {1, 4})
    assert [refs[r].num_parts for r in (0, 2, 3, 5, 6)] == [1, 2, 1, 2, 1]
    assert refs[0].num_forward > 0 and refs[2].num_forward > 0


def gpu_result(want, case, n, worst):
    """What a shrink-mode dispatch with num_worst_tokens returns when it is
    right: the reference's rows, padding marked -1, [3] and [4] padded."""
    num_recv, num_topk, d = want.num_recv, case.topk, want.num_nvl_ranks
    recv_x = torch.zeros(worst, case.hidden, dtype=torch.bfloat16)
    recv_x[:num_recv].view(torch.uint8).copy_(torch.from_numpy(want.recv_x))
    topk_idx = torch.full((worst, num_topk), -1, dtype=torch.int64)
    topk_idx[:num_recv] = torch.from_numpy(want.recv_topk_idx)
    weights = torch.zeros(worst, num_topk, dtype=torch.float32)
    weights[:num_recv] = torch.from_numpy(want.recv_topk_weights)
    meta = torch.full((worst, 2), -1, dtype=torch.int32)
    meta[:num_recv, 0] = torch.from_numpy(want.recv_src_idx.astype(np.int32))
    meta[:num_recv, 1] = torch.from_numpy(want.recv_nvl_mask.view(np.int32))
    nvl_head = torch.full((d * worst, d), -1, dtype=torch.int32)
    nvl_head[:want.num_forward] = torch.from_numpy(want.send_nvl_head)
    prefix, sums = cases.worst_part_rows(want)
    live = want.live.astype(np.int64)
    words = torch.tensor([sum(int(live[r]) << (r - 32 * w) for r in range(32 * w, min(32 * w + 32, n)))
                          for w in range((n + 31) // 32)], dtype=torch.int64).to(torch.int32)
    handle = turnout.InternodeHandle([torch.from_numpy(want.is_token_in_rank.astype(bool)),
                                      torch.from_numpy(want.rdma_channel_prefix_matrix),
                                      torch.from_numpy(want.gbl_channel_prefix_matrix), torch.from_numpy(prefix),
                                      torch.from_numpy(sums), torch.from_numpy(want.recv_gbl_channel_prefix_matrix),
                                      torch.from_numpy(want.recv_gbl_rank_prefix_sum), meta,
                                      torch.from_numpy(want.send_rdma_head), nvl_head, words])
    return [recv_x, topk_idx, weights, [], handle, None]


@pytest.mark.parametrize("rank", [0, 2])
def test_check_dispatch_takes_the_padded_handle_and_refuses_other_padding(rank):
    n, d, masked = 8, 4, {1, 4}
    refs = shrink_refs(n, d, masked)
    worst = CASE.tokens * n
    want = refs[rank]
    served = (n // d) * want.num_parts
    out = gpu_result(want, CASE, n, worst)
    cases.check_dispatch(out, want, CASE, "padded", worst=worst, shrink=True)
    # The served rows only (the host keeping N x P rows, as without num_worst_tokens) are not the handle.
    unpadded = [t.clone() for t in out[4]]
    unpadded[3] = torch.from_numpy(want.recv_rdma_channel_prefix_matrix)
    unpadded[4] = torch.from_numpy(want.recv_rdma_rank_prefix_sum)
    with pytest.raises(AssertionError, match=r"handle\[3\].*shape"):
        cases.check_dispatch(out[:4] + [turnout.InternodeHandle(unpadded), None], want, CASE, "unpadded",
                             worst=worst, shrink=True)
    # A failed dispatch's -1 mark, or a padding row with tokens, is not what a good call leaves.
    for entry, row, value in ((4, -1, -1), (3, served, 1)):
        bad = list(out)
        handle = [t.clone() for t in out[4]]
        handle[entry][row] = value
        bad[4] = turnout.InternodeHandle(handle)
        with pytest.raises(AssertionError, match=rf"handle\[{entry}\]"):
            cases.check_dispatch(bad, want, CASE, "bad padding", worst=worst, shrink=True)
