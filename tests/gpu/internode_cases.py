"""Internode dispatch/combine of intranode_cases' inputs over declared NVL
domains, checked against the host reference: rows and handle entries bitwise,
combine within the reference's stated tolerance (docs/INTERNODE.md)."""
import numpy as np
import torch

import turnout
import turnout_reference
from harness import assert_equal
from intranode_cases import Case, assert_bf16_close, assert_float_close, combine_inputs, inputs_of, x_bytes

# The network ring is a whole number of send chunks; combine splits each NVL
# ring per source domain, so it holds at least a few slots per domain.
CONFIG = dict(num_sms=8, num_max_nvl_chunked_send_tokens=8, num_max_nvl_chunked_recv_tokens=256,
              num_max_rdma_chunked_send_tokens=16, num_max_rdma_chunked_recv_tokens=128)

# A remote partial sum crosses the network as bf16; where it lies on a
# rounding boundary the GPU's fp32 partial may round the other way: one bf16
# step of the partial, relative to the terms (unit scale here).
PARTIAL_REL = 2.0 ** -8


def config() -> "turnout.Config":
    return turnout.Config(**CONFIG)


def buffer_bytes(hidden: int, n: int, domain: int):
    """(num_nvl_bytes, num_rdma_bytes) of every call of CONFIG with rows of this hidden size."""
    c = config()
    return c.get_nvl_buffer_size_hint(hidden * 2, n), c.get_rdma_buffer_size_hint(hidden * 2, n, domain)


def reference_dispatch(case: Case, n: int, domain: int, all_inputs, channels: int, x_override=None, live=None):
    """live: None (every rank) or a truth value per rank (shrink mode: the
    reference reduces the routing and forwards through substitutes)."""
    xs = x_override if x_override is not None else [i.x for i in all_inputs]
    return turnout_reference.internode_dispatch(
        [x_bytes(x) for x in xs],
        [x[1].contiguous().numpy() if isinstance(x, tuple) else None for x in xs],
        [i.topk_idx.numpy() if case.topk else None for i in all_inputs],
        [i.topk_weights.numpy() if case.topk else None for i in all_inputs],
        [i.is_token_in_rank for i in all_inputs],
        case.experts, case.alignment, domain, channels, live=live)


def dispatch(buf, case: Case, inp, device, **kwargs):
    """Layout on the GPU (num_tokens_per_rdma_rank included), then dispatch."""
    topk_idx = inp.topk_idx.to(device)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, case.experts)
    assert per_rdma is not None, "get_dispatch_layout gave no num_tokens_per_rdma_rank across domains"
    args = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, expert_alignment=case.alignment, config=config())
    if case.topk:
        args.update(topk_idx=topk_idx, topk_weights=inp.topk_weights.to(device))
    args.update(kwargs)
    x = inp.x
    if isinstance(x, tuple):
        x = (x[0].to(device), x[1].t().contiguous().to(device).t())
    else:
        x = x.to(device)
    return buf.dispatch(x, **args)


def check_rows(recv_x, recv_topk_idx, recv_topk_weights, ref, case: Case, what: str, worst: int = 0) -> None:
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


def worst_part_rows(ref):
    """Handle [3] and [4] of a shrink-mode dispatch with num_worst_tokens: a
    row per part a rank may have (N x D; the host never learns the parts P
    it serves), the reference's N x P rows first, then parts with no tokens:
    [3] zeros, [4] the forwarded tokens' count."""
    num_domains, channels = ref.rdma_channel_prefix_matrix.shape
    rows = num_domains * ref.num_nvl_ranks
    prefix = np.zeros((rows, channels), dtype=np.int32)
    sums = np.full(rows, ref.num_forward, dtype=np.int32)
    served = num_domains * ref.num_parts
    prefix[:served] = ref.recv_rdma_channel_prefix_matrix
    sums[:served] = ref.recv_rdma_rank_prefix_sum
    return prefix, sums


def check_dispatch(out, ref, case: Case, what: str, worst: int = 0, shrink: bool = False) -> None:
    """Rows and the handle's entries 0-8 bitwise, entry 9's -1 marks (its
    places are in forward order, as the reference's). shrink: the handle has
    an eleventh entry, the live set, checked against the reference's; with
    worst too, [3] and [4] have a row per part a rank may have
    (worst_part_rows)."""
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, _ = out
    check_rows(recv_x, recv_topk_idx, recv_topk_weights, ref, case, what, worst)
    if worst:
        assert per_expert == [], f"{what}: the per-expert list must be empty with num_worst_tokens"
    elif case.topk:
        assert list(per_expert) == list(ref.num_recv_tokens_per_expert), \
            f"{what}: num_recv_tokens_per_expert {per_expert} != {list(ref.num_recv_tokens_per_expert)}"
    assert isinstance(handle, turnout.InternodeHandle) and len(handle) == (11 if shrink else 10), \
        f"{what}: the handle's layout"
    if shrink:
        live = ref.live.astype(np.int64)
        words = [sum(int(live[r]) << (r - 32 * w) for r in range(32 * w, min(32 * w + 32, len(live))))
                 for w in range((len(live) + 31) // 32)]
        got = [int(v) & 0xFFFFFFFF for v in handle[10].cpu().tolist()]
        assert got == words, f"{what}: handle[10] (live) {got} != {words}"
    else:
        # handle[0] is the user's is_token_in_rank; in shrink mode the kernels
        # clear masked columns as they read it, so it may differ from the reduced one.
        assert_equal(handle[0], ref.is_token_in_rank.astype(bool), f"{what}: handle[0]")
    names = ("rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix", "recv_rdma_channel_prefix_matrix",
             "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum")
    want = {i: getattr(ref, name) for i, name in enumerate(names, start=1)}
    if shrink and worst:
        want[3], want[4] = worst_part_rows(ref)
    for i, name in enumerate(names, start=1):
        assert_equal(handle[i], want[i], f"{what}: handle[{i}] ({name})")
    n_ref = ref.num_recv
    assert_equal(handle[7][:n_ref, 0], ref.recv_src_idx, f"{what}: handle[7] source tokens")
    assert_equal(handle[7][:n_ref, 1].view(torch.int32), ref.recv_nvl_mask.view(np.int32), f"{what}: handle[7] masks")
    if worst:
        assert bool((handle[7][n_ref:] == -1).all()), f"{what}: padding rows must have source meta -1"
    assert_equal(handle[8], ref.send_rdma_head, f"{what}: handle[8] (send_rdma_head)")
    forwarded = ref.num_forward
    assert_equal(handle[9][:forwarded] >= 0, ref.send_nvl_head >= 0, f"{what}: handle[9]'s -1 marks")
    assert_equal(handle[9][:forwarded], ref.send_nvl_head, f"{what}: handle[9] (forward order)")


def combine(buf, case: Case, n: int, rank: int, out, device, num_recv: int, **kwargs):
    recv_x, _, recv_topk_weights, _, handle, _ = out
    num_rows = handle[7].shape[0]
    x, biases = combine_inputs(case, n, rank, num_recv)
    if num_rows > num_recv:
        x = torch.cat([x, torch.randn(num_rows - num_recv, case.hidden).bfloat16()])
    bias = None if not biases else (tuple(b.to(device) for b in biases) if len(biases) == 2 else biases[0].to(device))
    return buf.combine(x.to(device), handle, topk_weights=recv_topk_weights if case.topk else None, bias=bias,
                       config=config(), **kwargs)


def reference_combine(case: Case, n: int, refs, rank: int, live=None, drop_lost_partials: bool = False):
    """``rank``'s fp64 two-level combine, remote partials rounded to bf16
    (shrink mode: over the dispatch's live set, which refs carry). live: the
    ranks that take part in the combine (None: the dispatch's); a rank of the
    dispatch left out of it loses its rows, and with drop_lost_partials the
    partials it forwarded too (the GPU's shrink-mode combine)."""
    xs, ws, b0, b1 = [], [], [], []
    for r in range(n):
        x, biases = combine_inputs(case, n, r, refs[r].num_recv, with_biases=r == rank)
        xs.append(x.view(torch.int16).numpy().view(np.uint16))
        ws.append(refs[r].recv_topk_weights if case.topk else None)
        b0.append(biases[0].view(torch.int16).numpy().view(np.uint16) if len(biases) > 0 else None)
        b1.append(biases[1].view(torch.int16).numpy().view(np.uint16) if len(biases) > 1 else None)
    return turnout_reference.internode_combine(xs, ws, b0, b1, refs, case.hidden, case.topk,
                                               round_remote_partials=True, only_rank=rank, live=live,
                                               drop_lost_partials=drop_lost_partials)[rank]


def check_combine(out, ref, case: Case, what: str) -> None:
    combined_x, combined_w, _ = out
    assert_bf16_close(combined_x, ref[0], f"{what}: combined_x", rel=PARTIAL_REL)
    if case.topk:
        assert_float_close(combined_w, ref[1], f"{what}: combined_topk_weights")
    else:
        assert combined_w is None, f"{what}: combined_topk_weights without top-k weights"


def round_trip(ctx, buf, case: Case, n: int, domain: int, what: str, worst: int = 0):
    """Dispatch then combine of ``case``, each checked; returns (inputs, refs, dispatch's out)."""
    inputs = [inputs_of(case, n, r) for r in range(n)]
    extra = dict(num_worst_tokens=worst) if worst else {}
    out = dispatch(buf, case, inputs[ctx.rank], ctx.device, **extra)
    channels = out[4][1].shape[1]
    refs = reference_dispatch(case, n, domain, inputs, channels)
    check_dispatch(out, refs[ctx.rank], case, what, worst)
    back = combine(buf, case, n, ctx.rank, out, ctx.device, refs[ctx.rank].num_recv)
    check_combine(back, reference_combine(case, n, refs, ctx.rank), case, what)
    return inputs, refs, out
