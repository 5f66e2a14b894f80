"""Network bytes and puts one rank sends in one internode dispatch and one
combine, counted on the host from every rank's ``is_token_in_rank``: turnout's
protocol, DeepEP's and a per-rank protocol (no forwarding) for the same
routing. Only what crosses between NVL domains counts (NVLink hops are free
here), and only token data: the counts step and the tails, heads and credits
are left out. The same accounting as the host reference's ``internode_wire``
(tests/reference/internode.cpp), which the CPU tests compare it with; written
here so that the installed bench needs no test build.

Both two-level protocols send one copy per (token, other domain) it reaches,
to that domain's rank of the same local index, and in combine one partial sum
back per such forwarded token; the per-rank protocol one copy per (token,
destination rank of another domain) and one row back per received row.
Channel c of T tokens over C channels is ``[T c / C, T (c + 1) / C)`` in
turnout's kernels (the per-rank protocol split the same way) and pieces of
``ceil(T / C)`` in DeepEP's; a put carries at most ``chunk_tokens`` tokens of
one channel to one destination."""
from typing import Dict, List, Sequence

import torch

#: Bytes of one token copy, as docs/INTERNODE.md states them ("Buffers" and
#: "Network bytes per rank").
FORMULAS = {
    "turnout dispatch": "align16(row) + align16(4 x scales) + 2 x align16(4 x top-k) + 16",
    "DeepEP dispatch": "align16(row + 8 + 4 x scales + 8 x top-k)",
    "turnout combine": "align16(2H) + align16(4 x top-k)",
    "DeepEP combine": "align16(2H + 8 + 4 x top-k)",
}
PROTOCOLS = ("turnout", "deepep", "per_rank")


def align16(num_bytes: int) -> int:
    return (num_bytes + 15) // 16 * 16


def turnout_dispatch_token_bytes(row_bytes: int, num_scales: int, num_topk: int) -> int:
    # Row | scales | top-k ids (int32) | weights | {source token, local-rank mask}, each 16-byte aligned.
    return align16(row_bytes) + align16(4 * num_scales) + 2 * align16(4 * num_topk) + 16


def deepep_dispatch_token_bytes(row_bytes: int, num_scales: int, num_topk: int) -> int:
    # 8 bytes of source meta, top-k ids as int32 beside the float weights, the whole rounded once.
    return align16(row_bytes + 8 + 4 * num_scales + 8 * num_topk)


def turnout_combine_token_bytes(hidden: int, num_topk: int) -> int:
    return align16(2 * hidden) + align16(4 * num_topk)


def deepep_combine_token_bytes(hidden: int, num_topk: int) -> int:
    return align16(2 * hidden + 8 + 4 * num_topk)


def turnout_channel_bounds(num_tokens: int, num_channels: int) -> List[int]:
    return [num_tokens * c // num_channels for c in range(num_channels + 1)]


def deepep_channel_bounds(num_tokens: int, num_channels: int) -> List[int]:
    per_channel = -(-num_tokens // num_channels)
    return [min(per_channel * c, num_tokens) for c in range(num_channels + 1)]


def check_args(in_ranks: Sequence[torch.Tensor], num_nvl_ranks: int, num_channels: int, chunk_tokens: int) -> int:
    """The rank count, after checking what the counts need of the arguments."""
    num_ranks = len(in_ranks)
    if num_ranks < 1:
        raise ValueError("is_token_in_rank: one [T, R] matrix per rank, got none")
    if num_nvl_ranks < 1 or num_ranks % num_nvl_ranks:
        raise ValueError(f"num_nvl_ranks ({num_nvl_ranks}) must be a positive divisor of the ranks ({num_ranks})")
    if num_channels < 1 or chunk_tokens < 1:
        raise ValueError(f"num_channels ({num_channels}) and chunk_tokens ({chunk_tokens}) must be >= 1")
    for r, m in enumerate(in_ranks):
        if m.dim() != 2 or m.shape[1] != num_ranks:
            raise ValueError(f"is_token_in_rank[{r}]: expected [T, {num_ranks}], got {list(m.shape)}")
    return num_ranks


def network_counts(in_ranks: Sequence, rank: int, num_nvl_ranks: int, row_bytes: int, num_scales: int,
                   num_topk: int, hidden: int, num_channels: int, chunk_tokens: int) -> Dict[str, int]:
    """``rank``'s network traffic of one dispatch (rows of ``row_bytes`` with
    ``num_scales`` scales and ``num_topk`` top-k slots) and one combine (bf16
    rows of ``hidden``, ``num_topk`` weights): keys ``<op>_<protocol>_bytes``
    and ``<op>_<protocol>_messages`` (op dispatch / combine, protocol as in
    PROTOCOLS), ``token_domain_pairs`` and ``token_rank_pairs`` (this rank's
    tokens times the other domains / ranks of other domains they reach).
    ``in_ranks``: every rank's ``is_token_in_rank`` [T, R] (anything
    ``torch.as_tensor`` takes), rank order."""
    in_ranks = [torch.as_tensor(m).to("cpu", torch.bool) for m in in_ranks]
    num_ranks = check_args(in_ranks, num_nvl_ranks, num_channels, chunk_tokens)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside [0, {num_ranks})")
    nvl, num_domains = num_nvl_ranks, num_ranks // num_nvl_ranks
    # [T, N]: whether a token reaches a domain at all.
    reach = [m.view(m.shape[0], num_domains, nvl).any(dim=2) for m in in_ranks]
    domain, local = divmod(rank, nvl)
    token_bytes = {
        ("dispatch", "turnout"): turnout_dispatch_token_bytes(row_bytes, num_scales, num_topk),
        ("dispatch", "deepep"): deepep_dispatch_token_bytes(row_bytes, num_scales, num_topk),
        ("dispatch", "per_rank"): turnout_dispatch_token_bytes(row_bytes, num_scales, num_topk),
        ("combine", "turnout"): turnout_combine_token_bytes(hidden, num_topk),
        ("combine", "deepep"): deepep_combine_token_bytes(hidden, num_topk),
        ("combine", "per_rank"): turnout_combine_token_bytes(hidden, num_topk),
    }
    out = {f"{op}_{p}_{what}": 0 for op in ("dispatch", "combine") for p in PROTOCOLS for what in ("bytes",
                                                                                                  "messages")}

    def add(op: str, protocol: str, column: torch.Tensor, bounds: List[int]) -> None:
        """One stream of the tokens marked in ``column``, channel by channel, in puts of chunk_tokens."""
        for c in range(num_channels):
            tokens = int(column[bounds[c]:bounds[c + 1]].sum())
            out[f"{op}_{protocol}_bytes"] += tokens * token_bytes[(op, protocol)]
            out[f"{op}_{protocol}_messages"] += -(-tokens // chunk_tokens)

    mine = in_ranks[rank]
    ours, theirs = (turnout_channel_bounds(mine.shape[0], num_channels),
                    deepep_channel_bounds(mine.shape[0], num_channels))
    others = [e for e in range(num_domains) if e != domain]
    out["token_domain_pairs"] = int(sum(reach[rank][:, e].sum() for e in others))
    out["token_rank_pairs"] = int(sum(mine[:, e * nvl:(e + 1) * nvl].sum() for e in others))
    for e in others:
        add("dispatch", "turnout", reach[rank][:, e], ours)
        add("dispatch", "deepep", reach[rank][:, e], theirs)
        for j in range(e * nvl, (e + 1) * nvl):
            add("dispatch", "per_rank", mine[:, j], ours)
    # Combine sends back what dispatch brought from other domains: as the forwarder of
    # peer (s, local) one partial sum per token of it that reached this domain; per rank,
    # one row per row received from a rank of another domain.
    for s in others:
        peer = s * nvl + local
        peer_tokens = in_ranks[peer].shape[0]
        add("combine", "turnout", reach[peer][:, domain], turnout_channel_bounds(peer_tokens, num_channels))
        add("combine", "deepep", reach[peer][:, domain], deepep_channel_bounds(peer_tokens, num_channels))
        for q in range(s * nvl, (s + 1) * nvl):
            add("combine", "per_rank", in_ranks[q][:, rank], turnout_channel_bounds(in_ranks[q].shape[0],
                                                                                     num_channels))
    return out
