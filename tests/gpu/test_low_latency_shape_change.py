"""A low-latency combine after a change of shape. A call's areas in the region
move with (num_max_dispatch_tokens_per_rank, hidden), so what calls of an
earlier shape wrote stays where calls of the new one read. A combine takes a
source's published weight from the first 8-byte word at its place that
carries the combine's tag; a dispatch message starts with its call's tag and
its token index, so its first word, read as a weight, carries the token index
where the tag goes. From the region's offsets the test picks two shapes and a
combine call c such that the message of token c of the first shape lies on a
weight the c-th combine of the second shape reads on another rank, leaves it
there (a dispatch of the first shape just before the second shape's c-th round
trip) and checks every round trip against the host reference."""
import torch

from low_latency_cases import LLCase, dispatch, inputs_of, round_trip, size_hint, world
from turnout import _C

TOPK, EXPERTS = 8, 64
# (num_max_dispatch_tokens_per_rank, hidden), tried in pairs in this order;
# the first pairs put a message on a weight at 2, 4 and 8 ranks.
SHAPES = ((16, 512), (16, 128), (16, 1024), (16, 256), (32, 128), (16, 2048), (32, 512), (64, 1024), (32, 2048))


def case_of(shape) -> LLCase:
    m, h = shape
    return LLCase("uniform", m, m, h, TOPK, EXPERTS, "bf16")


def overlap(n: int):
    """(first case, second case, c, what) where, on some rank d, the message of
    token c from source s of the first case's c-th dispatch lies on the weight
    of top-k slot k of token t from source s2 that the second case's c-th
    combine reads on d (d holds that slot's expert, s2 is another rank), or
    None where no pair of SHAPES does that on n ranks."""
    experts_per_rank = EXPERTS // n
    for first in SHAPES:
        for second in SHAPES:
            if first == second:
                continue
            a, b = case_of(first), case_of(second)
            if a.unfit(n) or b.unfit(n):
                continue
            at, bt = _C.low_latency_region_offsets(*first, n), _C.low_latency_region_offsets(*second, n)
            dests = [[{int(e) // experts_per_rank for e in row} for row in inputs_of(a, n, s).topk_idx]
                     for s in range(n)]
            routes = [inputs_of(b, n, s).topk_idx for s in range(n)]
            # Dispatch c (after c - 1 round trips of b) and combine c share parity c & 1.
            for c in range(2, a.tokens):
                for s in range(n):
                    message = at["dispatch_slots"][c & 1] + (s * a.max_tokens + c) * at["message_bytes"]
                    word, rest = divmod(message - bt["weights"][c & 1], 8)
                    if word < 0 or rest:
                        continue
                    slot, k = divmod(word, _C.low_latency_max_topk)
                    s2, t = divmod(slot, b.max_tokens)
                    if s2 >= n or t >= b.tokens or k >= TOPK:
                        continue
                    d = int(routes[s2][t, k]) // experts_per_rank
                    if d in dests[s][c] and d != s2:
                        return a, b, c, (f"source {s}'s message of token {c} of {first} lies, on rank {d}, on "
                                         f"source {s2}'s weight of token {t}, slot {k} of {second}")
    return None


def test_no_earlier_shape_passes_for_a_weight(ctx):
    n, g = world(ctx)
    found = overlap(n)
    if found is None:
        ctx.skip(f"no two shapes of {SHAPES} put a message on a weight at {n} ranks")
    a, b, c, what = found
    with ctx.buffer(g, num_rdma_bytes=size_hint([a, b], n), low_latency_mode=True) as buf:
        for i in range(1, c):
            round_trip(ctx, buf, b, n, f"round trip {i} of {b}")
        dispatch(buf, a, inputs_of(a, n, ctx.rank), ctx.device)
        torch.cuda.synchronize()
        round_trip(ctx, buf, b, n, f"round trip {c} of {b}, after a dispatch of {a} ({what})")
