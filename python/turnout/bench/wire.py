"""Bytes and messages one rank puts on the wire in one low-latency call,
counted on the host from its routing: turnout's protocol beside a
one-message-per-(token, expert) protocol like DeepEP's. Exact for the routing
given (message and row sizes only; the per-call signals both protocols send
are left out). By default every other rank counts as on the wire; with
``nvl_domain_size`` only the ranks of other NVL domains do, the network
traffic of a group spanning several. Pure Python, so the accounting is checked
without a GPU."""
from typing import Dict, List, Optional, Sequence, Set, Tuple

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
    "combine BF16": ("remote (token, rank) pairs x 2H + N x T x K x 8 (weights; N remote ranks)",
                     "remote (token, expert) pairs x 2H"),
    "combine BF16, weights at dispatch": ("remote (token, rank) pairs x 2H", "remote (token, expert) pairs x 2H"),
}
#: Messages (puts): turnout's dispatch puts a header and a payload per remote
#: (token, rank), its combine one row; a published weight is one 8-byte
#: atomic set per (token, top-k slot, remote rank), so that it lands whole
#: with its call number over any transport.
MESSAGE_FORMULAS = {
    "dispatch FP8": ("remote (token, rank) pairs x 2", "remote (token, expert) pairs"),
    "dispatch BF16": ("remote (token, rank) pairs x 2", "remote (token, expert) pairs"),
    "combine BF16": ("remote (token, rank) pairs + N x T x K (weights)", "remote (token, expert) pairs"),
    "combine BF16, weights at dispatch": ("remote (token, rank) pairs", "remote (token, expert) pairs"),
}
PAIRS_NOTE = ("pairs counted from this rank's topk_idx: expert e lives on rank e // (E / R); 'remote' excludes this "
              "rank (with an NVL domain size D, every rank of its domain r // D); -1 slots are skipped and an expert "
              "named twice by a token counts once")


def remote_ranks(rank: int, num_ranks: int, nvl_domain_size: Optional[int] = None) -> Set[int]:
    """The ranks whose traffic from ``rank`` is on the wire: every other rank,
    or with ``nvl_domain_size`` (None or 0: not given) those outside
    ``rank``'s NVL domain (rank r is in domain r // nvl_domain_size)."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks ({num_ranks}) must be >= 1")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside [0, {num_ranks})")
    if not nvl_domain_size:
        return {r for r in range(num_ranks) if r != rank}
    if nvl_domain_size < 0 or num_ranks % nvl_domain_size:
        raise ValueError(f"nvl_domain_size ({nvl_domain_size}) must be a positive divisor of num_ranks ({num_ranks})")
    return {r for r in range(num_ranks) if r // nvl_domain_size != rank // nvl_domain_size}


def remote_pairs(topk_idx: Sequence[Sequence[int]], rank: int, num_ranks: int, num_experts: int,
                 nvl_domain_size: Optional[int] = None) -> Tuple[int, int]:
    """(remote (token, rank) pairs, remote (token, expert) pairs) of one
    rank's ``topk_idx`` ([T, K] global expert ids, -1 = no expert); remote as
    ``remote_ranks`` has it."""
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks})")
    remote = remote_ranks(rank, num_ranks, nvl_domain_size)
    per_rank = num_experts // num_ranks
    token_ranks = token_experts = 0
    for t, row in enumerate(topk_idx):
        experts = {int(e) for e in row if int(e) != -1}
        bad = [e for e in experts if not 0 <= e < num_experts]
        if bad:
            raise ValueError(f"token {t}: expert {bad[0]} is outside [-1, {num_experts})")
        crossing = {e for e in experts if e // per_rank in remote}
        token_experts += len(crossing)
        token_ranks += len({e // per_rank for e in crossing})
    return token_ranks, token_experts


def wire_bytes(topk_idx: Sequence[Sequence[int]], rank: int, num_ranks: int, num_experts: int, hidden: int,
               nvl_domain_size: Optional[int] = None) -> List[Dict]:
    """One row per op: this rank's bytes and messages on the wire per call in
    turnout's protocol (``ours_bytes``, ``ours_messages``) and in a
    one-message-per-(token, expert) one (``ref_bytes``, ``ref_messages``),
    their ratios (None where nothing crosses), the pair counts, the NVL domain
    size counted with (None: every other rank is remote) and the formulas."""
    if hidden % SCALE_GROUP:
        raise ValueError(f"hidden ({hidden}) must be a multiple of {SCALE_GROUP} (FP8 scales)")
    by_rank, by_expert = remote_pairs(topk_idx, rank, num_ranks, num_experts, nvl_domain_size)
    num_remote = len(remote_ranks(rank, num_ranks, nvl_domain_size))
    fp8 = hidden + hidden // SCALE_GROUP * 4
    bf16 = 2 * hidden
    num_tokens = len(topk_idx)
    num_topk = len(topk_idx[0]) if num_tokens else 0
    weights = num_remote * num_tokens * num_topk * TAGGED_WEIGHT_BYTES
    # op -> (ours bytes, ref bytes, ours messages, ref messages)
    counts = {
        "dispatch FP8": (by_rank * (HEADER_BYTES + fp8), by_expert * (fp8 + PER_EXPERT_HEADER_BYTES), 2 * by_rank,
                         by_expert),
        "dispatch BF16": (by_rank * (HEADER_BYTES + bf16), by_expert * (bf16 + PER_EXPERT_HEADER_BYTES), 2 * by_rank,
                          by_expert),
        "combine BF16": (by_rank * bf16 + weights, by_expert * bf16, by_rank + num_remote * num_tokens * num_topk,
                         by_expert),
        "combine BF16, weights at dispatch": (by_rank * bf16, by_expert * bf16, by_rank, by_expert),
    }
    rows = []
    for op, (ours, ref, ours_messages, ref_messages) in counts.items():
        rows.append({"op": op, "ours_bytes": ours, "ref_bytes": ref, "ratio": ours / ref if ref else None,
                     "ours_messages": ours_messages, "ref_messages": ref_messages,
                     "message_ratio": ours_messages / ref_messages if ref_messages else None,
                     "token_rank_pairs": by_rank, "token_expert_pairs": by_expert,
                     "nvl_domain_size": nvl_domain_size or None,
                     "formula_ours": FORMULAS[op][0], "formula_per_expert": FORMULAS[op][1],
                     "formula_ours_messages": MESSAGE_FORMULAS[op][0],
                     "formula_per_expert_messages": MESSAGE_FORMULAS[op][1]})
    return rows
