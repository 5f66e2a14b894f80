"""Bad input to low-latency dispatch and combine raises an exception whose
message names the argument, on every rank alike, before anything moves; the
buffer then serves the next correct call (a round trip checked against the
reference). Expert ids outside [-1, E) are found on the GPU: the next call or
Buffer.check_errors raises ValueError naming topk_idx on every rank. A rank
that never calls makes the others raise TimeoutError naming it within the
timeout (+2 s); the CUDA context stays usable and a new Buffer works.

Argument errors are TypeError or ValueError (the house rule: a wrong type or
dtype is a TypeError, a wrong value, shape or device a ValueError; either is
accepted here, the message is what is checked)."""
import re
import time

import torch

import turnout
from harness import count_check
from intranode_cases import nvl_bytes
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
    inputs_of,
    reference_dispatch,
    round_trip,
    size_hint,
    world,
)

CASE = LLCase("uniform", 32, 32, 2048, 8, 64, "bf16")
H2880 = LLCase("uniform", 32, 32, 2880, 8, 64, "bf16")  # for use_logfmt with a hidden not a multiple of 128
TIMEOUT_S = 3.0
HOST_GRACE_S = 2.0


def lacking(message: str, words) -> list:
    """The words of `words` that `message` does not hold as words (so "x" is
    not found in "expected", nor "out" in "without")."""
    return [w for w in words if not re.search(rf"(?<!\w){re.escape(w)}(?!\w)", message)]


def raises_naming(what: str, fn, *words, kinds=(TypeError, ValueError)):
    """fn raises one of `kinds` with every word of `words` in its message."""
    count_check()
    names = "/".join(k.__name__ for k in kinds)
    try:
        fn()
    except kinds as e:
        missing = lacking(str(e), words)
        if missing:
            raise AssertionError(f"{what}: {type(e).__name__} raised, but its message lacks {missing}: {e}") from e
        return e
    except BaseException as e:
        raise AssertionError(f"{what}: expected {names}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"{what}: expected {names} naming {list(words)}, nothing was raised")


def bad_dispatch_calls(buf, case: LLCase, n: int, x, topk_idx, weights, dev):
    """(what, call, words) of every bad dispatch argument; x, topk_idx and
    weights are a correct call's tensors on the device."""
    T, H, K, M, E = x.shape[0], case.hidden, case.topk, case.max_tokens, case.experts
    L = E // n

    def call(x=x, topk_idx=topk_idx, m=M, e=E, **kwargs):
        args = dict(use_fp8=False)
        args.update(kwargs)
        return lambda: buf.low_latency_dispatch(x, topk_idx, m, e, **args)

    too_many = torch.randn(M + 1, H, device=dev).bfloat16()
    too_many_ids = torch.zeros(M + 1, K, dtype=torch.int64, device=dev)
    wide = torch.randn(T, 2 * H, device=dev).bfloat16()
    return [
        ("T > M", call(x=too_many, topk_idx=too_many_ids), ("num_max_dispatch_tokens_per_rank",)),
        ("x float32", call(x=x.float()), ("x",)),
        ("x 3-D", call(x=x.unsqueeze(0)), ("x",)),
        ("x 1-D", call(x=x.flatten()), ("x",)),
        ("x not contiguous", call(x=wide[:, :H]), ("x",)),
        ("x on the CPU", call(x=x.cpu()), ("x",)),
        ("topk_idx int32", call(topk_idx=topk_idx.int()), ("topk_idx",)),
        ("topk_idx with a row too many", call(topk_idx=torch.cat([topk_idx, topk_idx[:1]])), ("topk_idx",)),
        ("topk_idx 1-D", call(topk_idx=topk_idx[:, 0].contiguous()), ("topk_idx",)),
        ("topk_idx with 17 columns", call(topk_idx=torch.cat([topk_idx, topk_idx, topk_idx[:, :1]], 1)),
         ("topk_idx",)),
        ("topk_idx on the CPU", call(topk_idx=topk_idx.cpu()), ("topk_idx",)),
        ("num_experts not a multiple of the group size", call(e=E + 1), ("num_experts",)),
        ("num_max_dispatch_tokens_per_rank 0", call(x=x[:0], topk_idx=topk_idx[:0], m=0),
         ("num_max_dispatch_tokens_per_rank",)),
        ("use_ue8m0 without round_scale", call(use_fp8=True, round_scale=False, use_ue8m0=True), ("use_ue8m0",)),
        ("topk_weights of another shape", call(topk_weights=weights[:, :-1].contiguous()), ("topk_weights",)),
        ("topk_weights bf16", call(topk_weights=weights.bfloat16()), ("topk_weights",)),
        ("cumulative_local_expert_recv_stats int64",
         call(cumulative_local_expert_recv_stats=torch.zeros(L, dtype=torch.int64, device=dev)),
         ("cumulative_local_expert_recv_stats",)),
        ("cumulative_local_expert_recv_stats of L + 1",
         call(cumulative_local_expert_recv_stats=torch.zeros(L + 1, dtype=torch.int32, device=dev)),
         ("cumulative_local_expert_recv_stats",)),
        ("dispatch_wait_recv_cost_stats int32",
         call(dispatch_wait_recv_cost_stats=torch.zeros(n, dtype=torch.int32, device=dev)),
         ("dispatch_wait_recv_cost_stats",)),
    ]


def test_bad_arguments_raise_and_the_buffer_goes_on(ctx):
    n, g = world(ctx)
    if CASE.unfit(n):
        ctx.skip(f"{CASE}: {CASE.unfit(n)}")
    dev, me = ctx.device, ctx.rank
    with ctx.buffer(g, num_rdma_bytes=size_hint([CASE, H2880], n), low_latency_mode=True) as buf, \
            ctx.buffer(g, num_rdma_bytes=size_hint([CASE], n), low_latency_mode=True) as other:
        inp = inputs_of(CASE, n, me)
        x, topk_idx, weights = inp.x.to(dev), inp.topk_idx.to(dev), inp.topk_weights.to(dev)
        for what, call, words in bad_dispatch_calls(buf, CASE, n, x, topk_idx, weights, dev):
            raises_naming(f"n={n} dispatch: {what}", call, *words)
            round_trip(ctx, buf, CASE, n, f"n={n} after dispatch with {what}")
        # The arguments of DeepEP forks are not ours: TypeError naming them.
        for name, value in (("x_global_scale", torch.ones(1, device=dev)), ("use_nvfp4", True)):
            raises_naming(f"n={n} dispatch: {name} (a DeepEP fork's)",
                          lambda: buf.low_latency_dispatch(x, topk_idx, CASE.max_tokens, CASE.experts, use_fp8=False,
                                                           **{name: value}), name, kinds=(TypeError,))
        round_trip(ctx, buf, CASE, n, f"n={n} after a DeepEP fork's arguments")

        # Unsupported hidden sizes.
        for what, hidden, fp8, words in (("hidden 2880 with use_fp8", 2880, True, ("hidden",)),
                                         ("hidden 1004 (not a multiple of 8)", 1004, False, ("hidden",)),
                                         ("hidden 16392 (past the largest)", 16392, False, ("hidden",))):
            odd = torch.randn(CASE.tokens, hidden, device=dev).bfloat16()
            raises_naming(f"n={n} dispatch: {what}",
                          lambda: buf.low_latency_dispatch(odd, topk_idx, CASE.max_tokens, CASE.experts, use_fp8=fp8),
                          *words)
            round_trip(ctx, buf, CASE, n, f"n={n} after dispatch with {what}")

        # Combine: a correct dispatch, then bad combine arguments.
        inputs = [inputs_of(CASE, n, r) for r in range(n)]
        refs = reference_dispatch(CASE, n, inputs)
        out = dispatch(buf, CASE, inputs[me], dev)
        torch.cuda.synchronize()
        check_dispatch(out, refs[me], CASE, n, f"n={n} dispatch before bad combines", dev)
        handle = out[2]
        y = expert_outputs(canonical(handle, out[1], f"n={n}"), all_x(inputs, CASE), CASE, n, me, dev)
        other_out = dispatch(other, CASE, inputs[me], dev)
        torch.cuda.synchronize()
        T, H = CASE.tokens, CASE.hidden
        combines = [
            ("x with hidden + 8", dict(x=torch.zeros(*y.shape[:2], H + 8, dtype=torch.bfloat16, device=dev)),
             ("x",)),
            ("x with an expert too many", dict(x=torch.zeros(y.shape[0] + 1, *y.shape[1:], dtype=torch.bfloat16,
                                                             device=dev)), ("x",)),
            ("x float32", dict(x=y.float()), ("x",)),
            ("x on the CPU", dict(x=y.cpu()), ("x",)),
            ("out with a row too many", dict(out=torch.empty(T + 1, H, dtype=torch.bfloat16, device=dev)), ("out",)),
            ("out float32", dict(out=torch.empty(T, H, dtype=torch.float32, device=dev)), ("out",)),
            ("topk_idx with a row too many", dict(topk_idx=torch.cat([topk_idx, topk_idx[:1]])), ("topk_idx",)),
            ("topk_weights of another shape", dict(topk_weights=weights[:, :-1].contiguous()), ("topk_weights",)),
            ("topk_weights float64", dict(topk_weights=weights.double()), ("topk_weights",)),
            ("a handle of another buffer", dict(handle=other_out[2]), ("handle",)),
            ("a handle that is not one", dict(handle=tuple(handle)[:3]), ("handle",)),
            ("combine_wait_recv_cost_stats int32",
             dict(combine_wait_recv_cost_stats=torch.zeros(n, dtype=torch.int32, device=dev)),
             ("combine_wait_recv_cost_stats",)),
        ]
        for what, change, words in combines:
            args = dict(x=y, topk_idx=topk_idx, topk_weights=weights, handle=handle)
            args.update(change)
            raises_naming(f"n={n} combine: {what}", lambda: buf.low_latency_combine(**args), *words)
        # The handle is still good after all of them.
        combined, _, _ = combine_call(buf, y, handle, topk_idx, weights)
        torch.cuda.synchronize()
        check_combine(combined, MyRows(refs, me, inputs[me].x), inputs[me].topk_idx, inputs[me].topk_weights, CASE,
                      n, f"n={n} combine after the bad ones")

        # A handle overwritten by two later dispatches of its shape.
        old = dispatch(buf, CASE, inputs[me], dev)
        dispatch(buf, CASE, inputs[me], dev)
        dispatch(buf, CASE, inputs[me], dev)
        torch.cuda.synchronize()
        raises_naming(f"n={n} combine: an overwritten handle",
                      lambda: buf.low_latency_combine(y, topk_idx, weights, old[2]), "handle", kinds=(ValueError,))
        round_trip(ctx, buf, CASE, n, f"n={n} after an overwritten handle")

        # use_logfmt needs a hidden that is a multiple of 128.
        case = H2880
        inputs = [inputs_of(case, n, r) for r in range(n)]
        out = dispatch(buf, case, inputs[me], dev)
        torch.cuda.synchronize()
        y = torch.zeros(case.experts // n, case.max_tokens * n, case.hidden, dtype=torch.bfloat16, device=dev)
        raises_naming(f"n={n} combine: use_logfmt with hidden 2880",
                      lambda: buf.low_latency_combine(y, inputs[me].topk_idx.to(dev), inputs[me].topk_weights.to(dev),
                                                      out[2], use_logfmt=True), "use_logfmt")
        round_trip(ctx, buf, CASE, n, f"n={n} after use_logfmt with hidden 2880")


test_bad_arguments_raise_and_the_buffer_goes_on.timeout = 300


def test_buffer_without_low_latency_mode_or_too_small(ctx):
    n, g = world(ctx)
    if CASE.unfit(n):
        ctx.skip(f"{CASE}: {CASE.unfit(n)}")
    dev, me = ctx.device, ctx.rank
    inp = inputs_of(CASE, n, me)
    x, topk_idx = inp.x.to(dev), inp.topk_idx.to(dev)
    # Refused before any collective: every rank alike.
    raises_naming(f"n={n}: low_latency_mode without num_rdma_bytes",
                  lambda: turnout.Buffer(g, num_rdma_bytes=0, low_latency_mode=True), "num_rdma_bytes",
                  kinds=(ValueError,))
    with ctx.buffer(g, num_nvl_bytes=nvl_bytes(CASE.hidden, n)) as normal:
        raises_naming(f"n={n}: low_latency_dispatch on a normal buffer",
                      lambda: normal.low_latency_dispatch(x, topk_idx, CASE.max_tokens, CASE.experts, use_fp8=False),
                      "low_latency_mode", kinds=(ValueError, RuntimeError))
        raises_naming(f"n={n}: clean_low_latency_buffer on a normal buffer",
                      lambda: normal.clean_low_latency_buffer(CASE.max_tokens, CASE.hidden, CASE.experts),
                      "low_latency_mode", kinds=(ValueError, RuntimeError))

    big = LLCase("uniform", 128, 128, 8192, 8, 64, "bf16")
    size = size_hint([CASE], n)
    with ctx.buffer(g, num_rdma_bytes=size, low_latency_mode=True) as buf:
        big_in = inputs_of(big, n, me)
        e = raises_naming(f"n={n}: a call bigger than the buffer",
                          lambda: dispatch(buf, big, big_in, dev), "num_rdma_bytes", kinds=(ValueError,))
        # The message names the size needed: more than the buffer has, at most the hint for the call.
        need = size_hint([big], n)
        numbers = [int(v) for v in re.findall(r"\d+", str(e))]
        assert any(size < v <= need for v in numbers), \
            f"n={n}: the message names no size in ({size}, {need}]: {e}"
        round_trip(ctx, buf, CASE, n, f"n={n} after a call bigger than the buffer")


test_buffer_without_low_latency_mode_or_too_small.timeout = 180


def raised_once(buf, steps, what: str, *words) -> None:
    """Runs `steps` (the bad call first): exactly one of them raises, a
    ValueError with every word of `words` (the bad call itself if the GPU had
    found the error before it returned, else the later call that asks);
    check_errors then raises nothing: the error is reported once."""
    errors = []
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)
    assert len(errors) == 1, f"{what}: expected one error, got {errors!r}"
    err = errors[0]
    assert isinstance(err, ValueError), f"{what}: expected ValueError, got {type(err).__name__}: {err}"
    missing = lacking(str(err), words)
    assert not missing, f"{what}: the message lacks {missing}: {err}"
    buf.check_errors()


def test_expert_ids_out_of_range_fail_on_every_rank(ctx):
    """Rank b passes an expert id outside [-1, E): after a synchronize, the
    next call of the buffer (rounds 1 and 2: check_errors; round 3: a correct
    low_latency_dispatch) raises ValueError on every rank, naming topk_idx (and
    the value on rank b, rank b elsewhere); the next round trip is right."""
    n, g = world(ctx)
    if CASE.unfit(n):
        ctx.skip(f"{CASE}: {CASE.unfit(n)}")
    dev, me = ctx.device, ctx.rank
    with ctx.buffer(g, num_rdma_bytes=size_hint([CASE], n), low_latency_mode=True) as buf:
        rounds = ((n - 1, CASE.experts, "check_errors"), (0, -2, "check_errors"),
                  (n // 2, CASE.experts + 1000, "the next dispatch"))
        for bad_rank, bad_value, asker in rounds:
            inp = inputs_of(CASE, n, me)
            ids = inp.topk_idx.clone()
            if me == bad_rank:
                ids[5, 3] = bad_value
            words = ("topk_idx", str(bad_value)) if me == bad_rank else ("topk_idx", f"rank {bad_rank}")
            what = f"n={n} rank {bad_rank} passes expert id {bad_value}, raised by {asker}"
            x, good_ids = inp.x.to(dev), inp.topk_idx.to(dev)

            def bad():
                buf.low_latency_dispatch(x, ids.to(dev), CASE.max_tokens, CASE.experts, use_fp8=False)

            def next_dispatch():
                buf.low_latency_dispatch(x, good_ids, CASE.max_tokens, CASE.experts, use_fp8=False)

            if asker == "check_errors":
                steps = (bad, torch.cuda.synchronize, buf.check_errors)
            else:
                steps = (bad, torch.cuda.synchronize, next_dispatch, torch.cuda.synchronize)
            raised_once(buf, steps, what, *words)
            ctx.all_gather(None, g)
            round_trip(ctx, buf, CASE, n, f"{what}: the next round trip")


test_expert_ids_out_of_range_fail_on_every_rank.timeout = 180


def absent_rank_times_out(ctx, phase: str) -> None:
    """Every rank but the last calls low_latency_dispatch (phase "dispatch"),
    or every rank dispatches and all but the last combine (phase "combine")."""
    n, g = world(ctx)
    absent = n - 1
    dev, me = ctx.device, ctx.rank
    buf = turnout.Buffer(g, num_rdma_bytes=size_hint([CASE], n), low_latency_mode=True, explicitly_destroy=True,
                         timeout_s=TIMEOUT_S)
    inputs = [inputs_of(CASE, n, r) for r in range(n)]
    y = None
    if phase == "combine":
        out = dispatch(buf, CASE, inputs[me], dev)
        torch.cuda.synchronize()
        y = expert_outputs(canonical(out[2], out[1], f"n={n}"), all_x(inputs, CASE), CASE, n, me, dev)
        ctx.all_gather(None)
    if me != absent:
        start = time.monotonic()
        error = None
        try:
            if phase == "dispatch":
                dispatch(buf, CASE, inputs[me], dev)
            else:
                combine_call(buf, y, out[2], inputs[me].topk_idx.to(dev), inputs[me].topk_weights.to(dev))
            torch.cuda.synchronize()  # the kernel gives up after timeout_s
            buf.check_errors()
        except TimeoutError as e:
            error = e
        elapsed = time.monotonic() - start
        assert error is not None, f"n={n} {phase}: rank {absent} never called, and no TimeoutError came"
        assert re.search(rf"\brank {absent}\b", str(error)), f"n={n} {phase}: the error does not name rank {absent}: " \
                                                            f"{error}"
        assert 0.9 * TIMEOUT_S <= elapsed <= TIMEOUT_S + HOST_GRACE_S, \
            f"n={n} {phase}: TimeoutError after {elapsed:.2f} s, timeout_s is {TIMEOUT_S}"
        assert torch.arange(10, device=dev).sum().item() == 45, f"n={n} {phase}: the CUDA context is broken"
    # The absent rank frees its buffer while the others' mappings are valid;
    # then the others, whose destroy must not wait for it.
    ctx.all_gather(None)
    if me == absent:
        buf.destroy()
    ctx.all_gather(None)
    if me != absent:
        start = time.monotonic()
        buf.destroy()
        elapsed = time.monotonic() - start
        assert elapsed < TIMEOUT_S, f"n={n} {phase}: destroy after a timeout took {elapsed:.2f} s"
    ctx.all_gather(None)
    with ctx.buffer(g, num_rdma_bytes=size_hint([CASE], n), low_latency_mode=True, timeout_s=TIMEOUT_S) as fresh:
        round_trip(ctx, fresh, CASE, n, f"n={n} {phase}: a new buffer after the timeout")


def test_absent_rank_times_out_in_dispatch(ctx):
    absent_rank_times_out(ctx, "dispatch")


test_absent_rank_times_out_in_dispatch.timeout = 120


def test_absent_rank_times_out_in_combine(ctx):
    absent_rank_times_out(ctx, "combine")


test_absent_rank_times_out_in_combine.timeout = 120
