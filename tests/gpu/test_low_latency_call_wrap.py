"""Low-latency call numbers past the 32-bit tags' wrap. Each phase numbers its
calls in 64 bits; what a call writes for others to match carries a 32-bit
tag, 1 to 2^32 - 1 and around again, never 0. A buffer whose calls start just
below a wrap (clean_low_latency_buffer with first_call, every rank alike)
makes round trips across it, BF16 and FP8, weights at dispatch or combine,
logfmt, a hooked dispatch, each against the host reference; then a bad expert
id on one rank raises once on every rank, and the next round trip is right.
Call 2^32 is where 32-bit numbers read 0 and matched zeroed memory."""
import torch
from test_low_latency_errors import raised_once

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
ROUND_TRIPS = 4


def restart_calls(buf, case: LLCase, first_call: int) -> None:
    from turnout.ops import low_latency

    low_latency.clean(buf._context, case.max_tokens, case.hidden, case.experts, first_call=first_call)
    torch.cuda.synchronize()


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
        for start in STARTS:
            for case in cases:
                restart_calls(buf, case, start)
                for i in range(ROUND_TRIPS):
                    what = f"n={n} {case}, calls from {start}, round trip {i}"
                    round_trip(ctx, buf, case, n, what, weights_at_dispatch=i % 2 == 1, logfmt=i == 2)
                hooked_dispatch(ctx, buf, case, n, f"n={n} {case}, calls from {start}, hooked dispatch")


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
