"""Shrink mode (Buffer(..., enable_shrink=True)) in normal mode (ours: DeepEP
has it in low-latency mode only). One mask per buffer serves both modes.

- A rank masked through the API (it sits the calls out): get_dispatch_layout
  gives its experts no token, dispatch leaves its tokens out (also when the
  caller passes a layout that still names it), combine leaves its rows out;
  every survivor's results match the host reference with the masked ranks'
  tokens and experts removed, and no call waits for it. Unmasked on every
  rank, it takes part again at once.
- A rank that stops calling at its first dispatch: the survivors' dispatch
  masks it after the shrink timeout and matches the reduced reference, and
  the calls after it run without waiting.
- A rank that stops calling between a dispatch and its combine: the
  survivors' combine sums every row but its own."""
import time

import numpy as np
import torch

import turnout_reference
from harness import assert_equal
from intranode_cases import (
    Case,
    Inputs,
    check_combine,
    check_dispatch,
    combine,
    combine_inputs,
    dispatch,
    inputs_of,
    nvl_bytes,
    reference_combine,
    reference_dispatch,
    round_trip,
    x_on_device,
)
from low_latency_cases import world
from shrink_cases import SHRINK_S, assert_mask, without_masked_experts

CASES = (Case("uniform", 128, 1024, 8, 64), Case("uniform", 128, 1024, 8, 64, fp8=True))


def empty_inputs(inp: Inputs) -> Inputs:
    x = (inp.x[0][:0], inp.x[1][:0]) if isinstance(inp.x, tuple) else inp.x[:0]
    return Inputs(x, inp.topk_idx[:0], inp.topk_weights[:0], inp.is_token_in_rank[:0])


def reduced_inputs(case: Case, n: int, masked: set) -> list:
    """Every rank's inputs as the survivors' calls see them: a masked rank
    sends nothing, and no token goes to a masked rank's experts."""
    out = []
    for r in range(n):
        inp = inputs_of(case, n, r)
        if r in masked:
            out.append(empty_inputs(inp))
            continue
        ids = without_masked_experts(inp.topk_idx, masked, case.experts // n)
        in_rank = turnout_reference.get_dispatch_layout(ids.numpy(), n, case.experts, n)[3]
        out.append(Inputs(inp.x, ids, inp.topk_weights, in_rank))
    return out


def source_tokens(case: Case, n: int, masked: set) -> list:
    return [0 if r in masked else case.tokens_of(r) for r in range(n)]


def shrink_buffer(ctx, g, n: int):
    return ctx.buffer(g, num_nvl_bytes=nvl_bytes(1024, n), enable_shrink=True, shrink_timeout_s=SHRINK_S)


def masked_round_trip(ctx, buf, case: Case, n: int, masked: set, what: str, stale_layout: bool = False,
                      cached: bool = False, times: dict = None) -> float:
    """One survivor's dispatch and combine against the reduced reference;
    returns the seconds they took. stale_layout: dispatch gets the layout of
    the full routing (computed without the mask), which it must still reduce.
    cached: a second dispatch reuses the first one's handle. times: gets
    "dispatch_done", the time.time() its dispatch finished (before the checks)."""
    me, dev = ctx.rank, ctx.device
    refs = reference_dispatch(case, n, reduced_inputs(case, n, masked), only_rank=me)
    mine = inputs_of(case, n, me)
    extra = {}
    if stale_layout:
        ids = mine.topk_idx.to(dev)
        full = turnout_reference.get_dispatch_layout(mine.topk_idx.numpy(), n, case.experts, n)
        extra = dict(is_token_in_rank=torch.from_numpy(full[3].astype(bool)).to(dev),
                     num_tokens_per_rank=torch.from_numpy(full[0]).to(dev),
                     num_tokens_per_expert=torch.from_numpy(full[2]).to(dev), topk_idx=ids)
    start = time.monotonic()
    out = dispatch(buf, case, mine, dev, **extra)
    torch.cuda.synchronize()
    took = time.monotonic() - start
    if times is not None:
        times["dispatch_done"] = time.time()
    check_dispatch(out, refs[me], case, f"{what}: dispatch", source_tokens=source_tokens(case, n, masked))
    if cached:
        again = buf.dispatch(x_on_device(mine.x, dev), handle=out[4])
        torch.cuda.synchronize()
        first, second = (out[0][0], again[0][0]) if case.fp8 else (out[0], again[0])
        assert_equal(second.view(torch.uint8), first.view(torch.uint8), f"{what}: cached dispatch rows")
    start = time.monotonic()
    back = combine(buf, case, n, me, out, dev)
    torch.cuda.synchronize()
    took += time.monotonic() - start
    check_combine(back, reference_combine(case, n, refs, me), case, f"{what}: combine")
    return took


def test_normal_mode_rank_masked_by_the_api(ctx):
    n, g = world(ctx)
    me, dev = ctx.rank, ctx.device
    masked = {n - 1} if n < 4 else {1, n - 1}
    with shrink_buffer(ctx, g, n) as buf:
        if me not in masked:
            for r in masked:
                buf.low_latency_update_mask_buffer(r, mask=True)
            for case in CASES:
                for stale, cached in ((False, False), (True, False), (False, True)):
                    what = f"n={n} masked {sorted(masked)} {case} stale layout={stale} cached={cached}"
                    took = masked_round_trip(ctx, buf, case, n, masked, what, stale_layout=stale, cached=cached)
                    assert took < SHRINK_S, f"{what}: the round trip took {took:.2f} s: it waited for a masked rank"
            # The layout alone: the masked ranks' columns and experts are empty.
            case = CASES[0]
            mine = inputs_of(case, n, me)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(mine.topk_idx.to(dev), case.experts)
            ids = without_masked_experts(mine.topk_idx, masked, case.experts // n)
            ref = turnout_reference.get_dispatch_layout(ids.numpy(), n, case.experts, n)
            assert np.array_equal(per_rank.cpu().numpy(), ref[0]), f"n={n}: num_tokens_per_rank with a mask"
            assert np.array_equal(per_expert.cpu().numpy(), ref[2]), f"n={n}: num_tokens_per_expert with a mask"
            assert np.array_equal(in_rank.cpu().numpy(), ref[3].astype(bool)), f"n={n}: is_token_in_rank with a mask"
            assert_mask(buf, n, dev, masked, f"n={n}: after the calls")
        ctx.all_gather(None)
        for r in masked:
            buf.low_latency_update_mask_buffer(r, mask=False)
        ctx.all_gather(None)
        for case in CASES:
            round_trip(ctx, buf, case, n, f"n={n} {case}: after unmasking")


test_normal_mode_rank_masked_by_the_api.timeout = 240


def test_normal_mode_rank_that_stops_at_dispatch(ctx):
    n, g = world(ctx)
    me, dev = ctx.rank, ctx.device
    stopped = n - 1
    with shrink_buffer(ctx, g, n) as buf:
        round_trip(ctx, buf, CASES[0], n, f"n={n}: before the stop")
        if me != stopped:
            took = masked_round_trip(ctx, buf, CASES[0], n, {stopped}, f"n={n}: the call rank {stopped} missed")
            assert SHRINK_S * 0.9 <= took <= SHRINK_S + 2.0, f"n={n}: gave up on rank {stopped} after {took:.2f} s"
            assert_mask(buf, n, dev, {stopped}, f"n={n}: after the call rank {stopped} missed")
            for i in range(20):
                case = CASES[i % len(CASES)]
                took = masked_round_trip(ctx, buf, case, n, {stopped}, f"n={n}: call {i} after the stop")
                assert took < SHRINK_S, f"n={n}: call {i} after the stop took {took:.2f} s"
            print(f"rank {me}: normal mode gave up on the stopped rank after the shrink timeout "
                  f"({SHRINK_S} s), then 20 checked round trips", flush=True)
        ctx.all_gather(None)


test_normal_mode_rank_that_stops_at_dispatch.timeout = 240


def reference_combine_without(case: Case, n: int, refs, rank: int, dropped: int):
    """reference_combine with rank `dropped`'s rows and weights left out."""
    xs, ws = [], []
    for r in range(n):
        x, _ = combine_inputs(case, n, r, refs[r].num_recv, with_biases=False)
        x = x.view(torch.int16).numpy().view(np.uint16)
        w = refs[r].recv_topk_weights
        if r == dropped:
            x, w = np.zeros_like(x), np.zeros_like(w)
        xs.append(x)
        ws.append(w)
    return turnout_reference.normal_combine(xs, ws, [None] * n, [None] * n, refs, case.hidden, case.topk,
                                            only_rank=rank)[rank]


def test_normal_mode_rank_that_stops_before_combine(ctx):
    n, g = world(ctx)
    me, dev = ctx.rank, ctx.device
    stopped = n - 1
    case = CASES[0]
    with shrink_buffer(ctx, g, n) as buf:
        inputs = [inputs_of(case, n, r) for r in range(n)]
        refs = reference_dispatch(case, n, inputs)
        out = dispatch(buf, case, inputs[me], dev)
        torch.cuda.synchronize()
        check_dispatch(out, refs[me], case, f"n={n}: dispatch")
        if me != stopped:
            start = time.monotonic()
            back = combine(buf, case, n, me, out, dev)
            torch.cuda.synchronize()
            took = time.monotonic() - start
            assert SHRINK_S * 0.9 <= took <= SHRINK_S + 2.0, f"n={n}: combine gave up after {took:.2f} s"
            check_combine(back, reference_combine_without(case, n, refs, me, stopped), case,
                          f"n={n}: combine without rank {stopped}")
            assert_mask(buf, n, dev, {stopped}, f"n={n}: after the combine rank {stopped} missed")
            took = masked_round_trip(ctx, buf, case, n, {stopped}, f"n={n}: the next round trip")
            assert took < SHRINK_S, f"n={n}: the next round trip took {took:.2f} s"
        ctx.all_gather(None)


test_normal_mode_rank_that_stops_before_combine.timeout = 240
