"""Low-latency dispatch and combine against the host reference, on random
inputs, over every rank of the run (run it at 2, 4 and 8 ranks): routings of
every shape, T = 1 and T = M, hidden 2048 / 2880 (BF16 only) / 7168 / 8192,
top-k 1 / 8 / 9, 8 / 64 / 288 experts, BF16 / FP8 / FP8 with round_scale /
FP8 with UE8M0 scales. Dispatch is compared bitwise in canonical order;
combine (default and pre-reduced, with and without use_logfmt, zero_copy and
out=) within the tolerance stated in low_latency_cases; combine is bitwise
repeatable; dispatch and combine give the same results in one call
(turnout._torch_ext) as through the Python path; normal and low-latency calls
share one Buffer."""
import itertools

import torch

from harness import assert_equal
from intranode_cases import Case, nvl_bytes
from intranode_cases import round_trip as intranode_round_trip
from low_latency_cases import (
    LLCase,
    MyRows,
    all_x,
    canonical,
    check_combine,
    check_dispatch,
    combine_call,
    dispatch,
    expert_outputs,
    fit_cases,
    inputs_of,
    reference_dispatch,
    round_trip,
    same_dispatch,
    size_hint,
    world,
)
from turnout import torch_ext
from turnout.ops import low_latency as ops_low_latency

# E * M * H stays small enough that every shape's two output sets (and combine
# buffers) of 8 ranks fit one GPU at once: a Buffer keeps them per shape.
CASES = (
    LLCase("uniform", 64, 64, 7168, 8, 64, "bf16"),                 # T = M
    LLCase("uniform", 48, 64, 7168, 8, 288, "fp8"),
    LLCase("uniform", 64, 64, 7168, 9, 64, "ue8m0"),
    LLCase("uniform", 32, 32, 7168, 8, 288, "fp8_round"),
    LLCase("uniform", 1, 128, 8192, 8, 64, "bf16"),                 # T = 1, the largest M and hidden
    LLCase("uniform", 128, 128, 2048, 8, 64, "fp8"),                # T = M = 128
    LLCase("one_rank", 40, 48, 2048, 8, 64, "ue8m0"),               # every token's experts on one rank
    LLCase("one_expert", 48, 48, 2880, 8, 64, "bf16"),              # all to one expert, 7 slots -1
    LLCase("holes", 32, 32, 8192, 9, 288, "fp8"),                   # -1 slots, tokens that go nowhere
    LLCase("uniform", 32, 32, 2880, 1, 8, "bf16", empty_rank=0),    # a rank with 0 tokens
    LLCase("skip_rank", 32, 32, 2048, 8, 64, "fp8_round"),
    LLCase("uniform", 1, 1, 2048, 1, 8, "fp8"),                     # T = M = 1
    LLCase("duplicates", 32, 32, 2048, 8, 64, "bf16"),              # a token naming an expert twice
    LLCase("holes", 16, 32, 7168, 1, 288, "ue8m0", empty_rank=7),
    LLCase("uniform", 16, 16, 8192, 8, 8, "ue8m0"),                 # top-8 of 8: every expert
    LLCase("one_expert", 32, 32, 2048, 9, 288, "fp8", empty_rank=3),
    LLCase("uniform", 24, 32, 2880, 9, 64, "bf16"),
)

# Combine variants, one per case in turn: (weights at dispatch, use_logfmt, zero_copy, out=).
COMBINE_VARIANTS = (
    (False, False, False, False),
    (True, False, False, False),
    (False, True, False, True),
    (False, False, True, False),
    (True, True, True, False),
    (True, False, False, True),
    (False, True, True, True),
)


def say(ctx, line: str) -> None:
    if ctx.rank == 0:
        print(line, flush=True)


def test_dispatch_and_combine_match_reference(ctx):
    n, g = world(ctx)
    cases, left_out = fit_cases(CASES, n)
    if left_out:
        say(ctx, f"cases that cannot run on {n} ranks (not run): {left_out}")
    if not cases:
        ctx.skip(f"no case fits {n} ranks: {left_out}")
    with ctx.buffer(g, num_rdma_bytes=size_hint(cases, n), low_latency_mode=True) as buf:
        assert buf.low_latency_mode and buf.group_size == n, "low_latency_mode / group_size"
        for i, case in enumerate(cases):
            weights_at_dispatch, logfmt, zero_copy, use_out = COMBINE_VARIANTS[i % len(COMBINE_VARIANTS)]
            logfmt = logfmt and case.hidden % 128 == 0
            round_trip(ctx, buf, case, n, f"n={n} case {i} ({case}) combine "
                       f"{dict(weights_at_dispatch=weights_at_dispatch, logfmt=logfmt, zero_copy=zero_copy)}",
                       weights_at_dispatch=weights_at_dispatch, logfmt=logfmt, zero_copy=zero_copy, use_out=use_out,
                       stats=i % 2 == 0)


test_dispatch_and_combine_match_reference.timeout = 400


def test_combine_options(ctx):
    """One dispatch per weights placement, then combine with every mix of
    use_logfmt, zero_copy and out= on its handle, each against the reference."""
    case = LLCase("uniform", 48, 64, 7168, 8, 64, "fp8")
    n, g = world(ctx)
    if case.unfit(n):
        ctx.skip(f"{case}: {case.unfit(n)}")
    dev, me = ctx.device, ctx.rank
    with ctx.buffer(g, num_rdma_bytes=size_hint([case], n), low_latency_mode=True) as buf:
        inputs = [inputs_of(case, n, r) for r in range(n)]
        refs = reference_dispatch(case, n, inputs)
        mine = MyRows(refs, me, inputs[me].x)
        topk_idx = inputs[me].topk_idx.to(dev)
        for weights_at_dispatch in (False, True):
            kwargs = dict(topk_weights=inputs[me].topk_weights.to(dev)) if weights_at_dispatch else {}
            out = dispatch(buf, case, inputs[me], dev, **kwargs)
            torch.cuda.synchronize()
            canon = canonical(out[2], out[1], f"n={n}")
            y = expert_outputs(canon, all_x(inputs, case), case, n, me, dev)
            weights = inputs[me].other_weights if weights_at_dispatch else inputs[me].topk_weights
            results = []
            for logfmt, zero_copy, use_out in itertools.product((False, True), repeat=3):
                what = f"n={n} weights at dispatch {weights_at_dispatch} logfmt {logfmt} zero_copy {zero_copy} " \
                       f"out {use_out}"
                combined, _, _ = combine_call(buf, y, out[2], topk_idx, weights.to(dev), zero_copy=zero_copy,
                                              use_out=use_out, use_logfmt=logfmt)
                torch.cuda.synchronize()
                check_combine(combined, mine, inputs[me].topk_idx, inputs[me].topk_weights, case, n, what,
                              logfmt=logfmt)
                results.append((logfmt, combined.clone()))
            # zero_copy and out= change where rows are, not what is summed: same bits.
            for logfmt in (False, True):
                same = [c for f, c in results if f == logfmt]
                for c in same[1:]:
                    assert_equal(c.view(torch.int16), same[0].view(torch.int16),
                                 f"n={n} weights at dispatch {weights_at_dispatch} logfmt {logfmt}: "
                                 f"zero_copy / out= changed the result")


test_combine_options.timeout = 300


class Counted:
    """Calls ``fn``, noting in ``taken`` whether each call took what it was
    given (a one-call op returns None where it declines)."""

    def __init__(self, fn) -> None:
        self.fn, self.taken = fn, []

    def __call__(self, *args):
        made = self.fn(*args)
        self.taken.append(made is not None)
        return made


def test_dispatch_in_one_call_gives_the_python_paths_outputs(ctx):
    """Where turnout._torch_ext is in use, a dispatch of a shape that has its
    two output sets goes through its one call (plain, async_finish and a
    hook's send and receive; BF16 and the FP8 formats; with weights and the
    cumulative stats, or without) and receives what the reference and the
    Python path receive."""
    if torch_ext.MODULE is None:
        ctx.skip("turnout._torch_ext is not in use here (not built against this torch, or turned off)")
    cases = [LLCase("uniform", 48, 64, 7168, 8, 64, mode) for mode in ("bf16", "fp8", "fp8_round", "ue8m0")]
    n, g = world(ctx)
    if cases[0].unfit(n):
        ctx.skip(f"{cases[0]}: {cases[0].unfit(n)}")
    dev, me = ctx.device, ctx.rank
    one_call = ops_low_latency._dispatch_in_one_call
    counted = Counted(one_call)
    taken = counted.taken

    with ctx.buffer(g, num_rdma_bytes=size_hint(cases, n), low_latency_mode=True) as buf:
        for case in cases:
            inputs = [inputs_of(case, n, r) for r in range(n)]
            ref = reference_dispatch(case, n, inputs)[me]
            for _ in range(2):  # the shape's two output sets
                dispatch(buf, case, inputs[me], dev)
            torch.cuda.synchronize()
            for mode, extras in itertools.product(("plain", "async_finish", "hook"), (False, True)):
                what = f"n={n} {case.mode} {mode} weights and stats {extras}"
                outs = []
                for path in (counted, None):
                    kwargs = dict(async_finish=mode == "async_finish", return_recv_hook=mode == "hook")
                    if extras:
                        kwargs["topk_weights"] = inputs[me].topk_weights.to(dev)
                        kwargs["cumulative_local_expert_recv_stats"] = torch.zeros(case.experts // n,
                                                                                   dtype=torch.int32, device=dev)
                    ops_low_latency._dispatch_in_one_call = path
                    try:
                        out = dispatch(buf, case, inputs[me], dev, **kwargs)
                        if mode == "async_finish":
                            out[3].current_stream_wait()
                        if mode == "hook":
                            out[4]()
                        torch.cuda.synchronize()
                    finally:
                        ops_low_latency._dispatch_in_one_call = one_call
                    if extras:
                        assert_equal(kwargs["cumulative_local_expert_recv_stats"], ref.recv_count,
                                     f"{what}: cumulative_local_expert_recv_stats")
                        assert out[2].has_weights, f"{what}: the handle must know weights were given"
                    outs.append(out)
                want = [True, True] if mode == "hook" else [True]
                assert taken == want, f"{what}: the one call took {taken}, expected {want}"
                taken.clear()
                check_dispatch(outs[0], ref, case, n, what, dev)
                same_dispatch(outs[0], outs[1], case, what, dev)


test_dispatch_in_one_call_gives_the_python_paths_outputs.timeout = 300


def test_combine_in_one_call_gives_the_python_paths_bits(ctx):
    """Where turnout._torch_ext is in use, every combine but an async_finish
    one with a hook (refused) goes through its one call (plain, async_finish
    and a hook's send and receive; with and without use_logfmt, zero_copy and
    out=) and gives bitwise what the Python path gives."""
    if torch_ext.MODULE is None:
        ctx.skip("turnout._torch_ext is not in use here (not built against this torch, or turned off)")
    case = LLCase("uniform", 48, 64, 7168, 8, 64, "bf16")
    n, g = world(ctx)
    if case.unfit(n):
        ctx.skip(f"{case}: {case.unfit(n)}")
    dev, me = ctx.device, ctx.rank
    one_call = ops_low_latency._combine_in_one_call
    counted = Counted(one_call)
    taken = counted.taken

    with ctx.buffer(g, num_rdma_bytes=size_hint([case], n), low_latency_mode=True) as buf:
        inputs = [inputs_of(case, n, r) for r in range(n)]
        mine = MyRows(reference_dispatch(case, n, inputs), me, inputs[me].x)
        out = dispatch(buf, case, inputs[me], dev)
        torch.cuda.synchronize()
        y = expert_outputs(canonical(out[2], out[1], f"n={n}"), all_x(inputs, case), case, n, me, dev)
        topk_idx, weights = inputs[me].topk_idx.to(dev), inputs[me].topk_weights.to(dev)
        for logfmt, zero_copy, use_out, mode in itertools.product((False, True), (False, True), (False, True),
                                                                  ("plain", "async_finish", "hook")):
            what = f"n={n} logfmt {logfmt} zero_copy {zero_copy} out {use_out} {mode}"
            results = []
            for path in (counted, None):
                ops_low_latency._combine_in_one_call = path
                try:
                    combined, event, hook = combine_call(
                        buf, y, out[2], topk_idx, weights, zero_copy=zero_copy, use_out=use_out, use_logfmt=logfmt,
                        async_finish=mode == "async_finish", return_recv_hook=mode == "hook")
                    if mode == "async_finish":
                        event.current_stream_wait()
                    if mode == "hook":
                        hook()
                    torch.cuda.synchronize()
                finally:
                    ops_low_latency._combine_in_one_call = one_call
                results.append(combined.clone())
            want = [True, True] if mode == "hook" else [True]
            assert taken == want, f"{what}: the one call took {taken}, expected {want}"
            taken.clear()
            check_combine(results[0], mine, inputs[me].topk_idx, inputs[me].topk_weights, case, n, what,
                          logfmt=logfmt)
            assert_equal(results[0].view(torch.int16), results[1].view(torch.int16),
                         f"{what}: the one call and the Python path")


test_combine_in_one_call_gives_the_python_paths_bits.timeout = 300


def test_same_inputs_give_same_bits(ctx):
    """20 seeds, modes in turn: the same dispatch twice holds the same rows, and
    the same combine twice gives bitwise the same combined_x."""
    modes = ("bf16", "fp8", "ue8m0", "fp8_round")
    variants = ((False, False), (True, False), (False, True), (True, True))  # (weights at dispatch, logfmt)
    n, g = world(ctx)
    dev, me = ctx.device, ctx.rank
    first = LLCase("uniform", 32, 32, 2048, 8, 64)
    if first.unfit(n):
        ctx.skip(f"{first}: {first.unfit(n)}")
    with ctx.buffer(g, num_rdma_bytes=size_hint([first], n), low_latency_mode=True) as buf:
        for seed in range(20):
            case = LLCase("uniform", 32, 32, 2048, 8, 64, modes[seed % 4], seed=seed)
            weights_at_dispatch, logfmt = variants[(seed // 4) % 4]
            inputs = [inputs_of(case, n, r) for r in range(n)]
            mine = inputs[me]
            xs = all_x(inputs, case)
            topk_idx = mine.topk_idx.to(dev)
            kwargs = dict(topk_weights=mine.topk_weights.to(dev)) if weights_at_dispatch else {}
            runs = []
            for _ in range(2):
                out = dispatch(buf, case, mine, dev, **kwargs)
                torch.cuda.synchronize()
                y = expert_outputs(canonical(out[2], out[1], f"n={n} seed {seed}"), xs, case, n, me, dev)
                combined, _, _ = combine_call(buf, y, out[2], topk_idx, mine.topk_weights.to(dev), use_logfmt=logfmt)
                torch.cuda.synchronize()
                runs.append((out, combined.clone()))
            what = f"n={n} seed {seed} {case.mode} weights at dispatch {weights_at_dispatch} logfmt {logfmt}"
            # The first run's outputs are still valid: two result sets live.
            same_dispatch(runs[0][0], runs[1][0], case, what, dev)
            assert_equal(runs[1][1].view(torch.int16), runs[0][1].view(torch.int16), f"{what}: combined_x of two runs")
            if seed == 19:
                refs = reference_dispatch(case, n, inputs)
                check_combine(runs[1][1], MyRows(refs, me, mine.x), mine.topk_idx, mine.topk_weights, case, n, what,
                              logfmt=logfmt)


test_same_inputs_give_same_bits.timeout = 300


def test_normal_and_low_latency_on_one_buffer(ctx):
    """Intranode and low-latency calls in turn on one Buffer that has both
    num_nvl_bytes and num_rdma_bytes, over every group size of the run;
    clean_low_latency_buffer after normal use, as the SPEC asks."""
    normal = Case("uniform", 256, 2048, 8, 64, biases=1)
    ll = (LLCase("uniform", 32, 64, 2048, 8, 64, "bf16"), LLCase("holes", 64, 64, 2048, 8, 64, "fp8"))
    sizes = [n for n in ctx.sizes() if not any(c.unfit(n) for c in ll) and normal.experts % n == 0]
    if not sizes:
        ctx.skip(f"64 experts fit none of the group sizes {ctx.sizes()}")
    for n, g in ctx.each_group():
        if n not in sizes:
            continue
        rdma = size_hint(ll, n)
        nvl = nvl_bytes(normal.hidden, n)
        with ctx.buffer(g, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True) as buf:
            assert (buf.num_nvl_bytes, buf.num_rdma_bytes, buf.low_latency_mode) == (nvl, rdma, True), \
                f"n={n}: num_nvl_bytes / num_rdma_bytes / low_latency_mode of the buffer"
            round_trip(ctx, buf, ll[0], n, f"n={n} low-latency first")
            intranode_round_trip(ctx, buf, normal, n, f"n={n} normal after low-latency")
            buf.clean_low_latency_buffer(ll[0].max_tokens, ll[0].hidden, ll[0].experts)
            round_trip(ctx, buf, ll[1], n, f"n={n} low-latency after normal and clean", weights_at_dispatch=True)
            round_trip(ctx, buf, ll[0], n, f"n={n} low-latency after low-latency", logfmt=True)
            intranode_round_trip(ctx, buf, normal, n, f"n={n} normal after low-latency again")
            buf.clean_low_latency_buffer(ll[1].max_tokens, ll[1].hidden, ll[1].experts)
            round_trip(ctx, buf, ll[1], n, f"n={n} low-latency at the end", zero_copy=True)


test_normal_and_low_latency_on_one_buffer.timeout = 300
