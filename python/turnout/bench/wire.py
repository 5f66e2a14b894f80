"""Bytes one rank puts on the wire in one low-latency call, counted on the host
from its routing: turnout's protocol beside a one-row-per-(token, expert)
protocol like DeepEP's. Exact for the routing given (message and row sizes
only; the per-call signals both protocols send are left out). Pure Python, so
the accounting is checked without a GPU."""
from typing import Dict, List, Sequence, Tuple

#: turnout's dispatch message header (``MessageHeader`` in
#: src/kernels/low_latency/region.hpp): seq, token, the token's experts on the
#: destination, their top-k slots and weights.
HEADER_BYTES = 144
#: A combine weight as a rank publishes it to every other rank: weight and call number.
TAGGED_WEIGHT_BYTES = 8
#: DeepEP's per-message source info: one int4.
PER_EXPERT_HEADER_BYTES = 16
#: Channels per FP8 scale (one float each).
SCALE_GROUP = 128

FORMULAS = {
    "dispatch FP8": ("remote (token, rank) pairs x (144 + H + H/128*4)",
                     "remote (token, expert) pairs x (H + H/128*4 + 16)"),
    "dispatch BF16": ("remote (token, rank) pairs x (144 + 2H)", "remote (token, expert) pairs x (2H + 16)"),
    "combine BF16": ("remote (token, rank) pairs x 2H + (R - 1) x T x K x 8 (weights)",
                     "remote (token, expert) pairs x 2H"),
    "combine BF16, weights at dispatch": ("remote (token, rank) pairs x 2H", "remote (token, expert) pairs x 2H"),
}
PAIRS_NOTE = ("pairs counted from this rank's topk_idx: expert e lives on rank e // (E / R); 'remote' excludes this "
              "rank; -1 slots are skipped and an expert named twice by a token counts once")


def remote_pairs(topk_idx: Sequence[Sequence[int]], rank: int, num_ranks: int, num_experts: int) -> Tuple[int, int]:
    """(remote (token, rank) pairs, remote (token, expert) pairs) of one
    rank's ``topk_idx`` ([T, K] global expert ids, -1 = no expert)."""
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks})")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside [0, {num_ranks})")
    per_rank = num_experts // num_ranks
    token_ranks = token_experts = 0
    for t, row in enumerate(topk_idx):
        experts = {int(e) for e in row if int(e) != -1}
        bad = [e for e in experts if not 0 <= e < num_experts]
        if bad:
            raise ValueError(f"token {t}: expert {bad[0]} is outside [-1, {num_experts})")
        remote = {e for e in experts if e // per_rank != rank}
        token_experts += len(remote)
        token_ranks += len({e // per_rank for e in remote})
    return token_ranks, token_experts


def wire_bytes(topk_idx: Sequence[Sequence[int]], rank: int, num_ranks: int, num_experts: int,
               hidden: int) -> List[Dict]:
    """One row per op: this rank's bytes on the wire per call in turnout's
    protocol (``ours_bytes``) and in a one-row-per-(token, expert) one
    (``ref_bytes``), their ratio (None where nothing crosses), the pair counts
    and the formulas."""
    if hidden % SCALE_GROUP:
        raise ValueError(f"hidden ({hidden}) must be a multiple of {SCALE_GROUP} (FP8 scales)")
    by_rank, by_expert = remote_pairs(topk_idx, rank, num_ranks, num_experts)
    fp8 = hidden + hidden // SCALE_GROUP * 4
    bf16 = 2 * hidden
    num_topk = len(topk_idx[0]) if len(topk_idx) else 0
    weights = (num_ranks - 1) * len(topk_idx) * num_topk * TAGGED_WEIGHT_BYTES
    sizes = {
        "dispatch FP8": (by_rank * (HEADER_BYTES + fp8), by_expert * (fp8 + PER_EXPERT_HEADER_BYTES)),
        "dispatch BF16": (by_rank * (HEADER_BYTES + bf16), by_expert * (bf16 + PER_EXPERT_HEADER_BYTES)),
        "combine BF16": (by_rank * bf16 + weights, by_expert * bf16),
        "combine BF16, weights at dispatch": (by_rank * bf16, by_expert * bf16),
    }
    rows = []
    for op, (ours, ref) in sizes.items():
        rows.append({"op": op, "ours_bytes": ours, "ref_bytes": ref, "ratio": ours / ref if ref else None,
                     "token_rank_pairs": by_rank, "token_expert_pairs": by_expert,
                     "formula_ours": FORMULAS[op][0], "formula_per_expert": FORMULAS[op][1]})
    return rows
