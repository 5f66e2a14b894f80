"""Low-latency call numbers past the 32-bit tags' wrap. Each phase numbers its
calls in 64 bits; what a call writes for others to match carries a 32-bit
tag, 1 to 2^32 - 1 and around again, never 0. A buffer whose calls start just
below a wrap (clean_low_latency_buffer with first_call, every rank alike)
makes round trips across it, BF16 and FP8, weights at dispatch or combine
(each at the wrap in one of the starts), logfmt, a hooked dispatch, each
against the host reference, and the phases' call numbers read back before and
after; then a bad expert id on one rank raises once on every rank, and the
next round trip is right. Call 2^32 is where 32-bit numbers read 0 and matched
zeroed memory."""
import numpy as np
import torch
from test_low_latency_errors import raised_once

from harness import assert_equal
from low_latency_cases import (
    LLCase,
    check_dispatch,
    dispatch,
    inputs_of,
    reference_dispatch,
    round_trip,
    size_hint,
    world,
)

CASES = (LLCase("uniform", 32, 32, 2048, 8, 64, "bf16"), LLCase("holes", 32, 32, 2048, 8, 64, "fp8"))
# Just below the tags' first wrap (call 2^32, tag 1 again) and their second
# (call 2 (2^32 - 1) + 1); each start of either parity.
STARTS = (2**32 - 3, 2 * (2**32 - 1) - 2)
# The fourth round trip of each start is the first past the wrap, the fifth the next.
ROUND_TRIPS = 5


def restart_calls(buf, case: LLCase, first_call: int) -> None:
    from turnout.ops import low_latency

    low_latency.clean(buf._context, case.max_tokens, case.hidden, case.experts, first_call=first_call)
    torch.cuda.synchronize()
    assert_call_numbers(buf, first_call - 1, first_call - 1, "after the restart")


def assert_call_numbers(buf, dispatched: int, combined: int, what: str) -> None:
    """The last finished call of each phase: dispatch send and receive, combine send and receive."""
    got = np.array(list(buf._native.low_latency_call_numbers()), dtype=np.uint64)
    want = np.array([dispatched, dispatched, combined, combined], dtype=np.uint64)
    assert_equal(got, want, f"call numbers {what}")


def hooked_dispatch(ctx, buf, case: LLCase, n: int, what: str) -> None:
    dev, me = ctx.device, ctx.rank
    inputs = [inputs_of(case, n, r) for r in range(n)]
    refs = reference_dispatch(case, n, inputs)
    out = dispatch(buf, case, inputs[me], dev, return_recv_hook=True)
    out[4]()
    torch.cuda.synchronize()
    check_dispatch(out, refs[me], case, n, what, dev)


def test_round_trips_across_the_tag_wrap(ctx):
    n, g = world(ctx)
    cases = [c for c in CASES if not c.unfit(n)]
    if not cases:
        ctx.skip(f"no case fits {n} ranks: {[c.unfit(n) for c in CASES]}")
    with ctx.buffer(g, num_rdma_bytes=size_hint(cases, n), low_latency_mode=True) as buf:
        for s, start in enumerate(STARTS):
            for case in cases:
                restart_calls(buf, case, start)
                for i in range(ROUND_TRIPS):
                    what = f"n={n} {case}, calls from {start}, round trip {i}"
                    round_trip(ctx, buf, case, n, what, weights_at_dispatch=(i + s) % 2 == 1, logfmt=i == 2)
                hooked_dispatch(ctx, buf, case, n, f"n={n} {case}, calls from {start}, hooked dispatch")
                assert_call_numbers(buf, start + ROUND_TRIPS, start + ROUND_TRIPS - 1, f"n={n} {case} from {start}")


test_round_trips_across_the_tag_wrap.timeout = 240


def test_bad_expert_id_after_the_wrap_fails_once_on_every_rank(ctx):
    n, g = world(ctx)
    case = CASES[0]
    if case.unfit(n):
        ctx.skip(f"{case}: {case.unfit(n)}")
    dev, me = ctx.device, ctx.rank
    with ctx.buffer(g, num_rdma_bytes=size_hint([case], n), low_latency_mode=True) as buf:
        restart_calls(buf, case, 2**32 - 1)
        round_trip(ctx, buf, case, n, f"n={n} call 2^32 - 1")
        inp = inputs_of(case, n, me)
        ids = inp.topk_idx.clone()
        bad_rank = n - 1
        if me == bad_rank:
            ids[3, 2] = case.experts
        words = ("topk_idx", str(case.experts)) if me == bad_rank else ("topk_idx", f"rank {bad_rank}")
        x = inp.x.to(dev)

        def bad():
            buf.low_latency_dispatch(x, ids.to(dev), case.max_tokens, case.experts, use_fp8=False)

        raised_once(buf, (bad, torch.cuda.synchronize, buf.check_errors),
                    f"n={n} rank {bad_rank} passes expert id {case.experts} at call 2^32", *words)
        ctx.all_gather(None, g)
        round_trip(ctx, buf, case, n, f"n={n} after the bad call past the wrap")


test_bad_expert_id_after_the_wrap_fails_once_on_every_rank.timeout = 180
