"""Intranode dispatch/combine: bad input raises an exception that names the
argument and the next correct call works; a rank that never comes makes the
others raise TimeoutError naming it, and the job goes on with a new buffer."""
import time

import torch

import turnout
from harness import assert_raises
from intranode_cases import Case, dispatch, inputs_of, nvl_bytes, round_trip

CASE = Case("uniform", 512, 1024, 8, 64, biases=1)


def assert_works(ctx, buf, n: int, what: str, case: Case = CASE, **kwargs) -> None:
    """The buffer still serves a correct call: a round trip matches the reference."""
    round_trip(ctx, buf, case, n, what, **kwargs)


def test_bad_dispatch_and_combine_arguments(ctx):
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(CASE.hidden, n)) as buf:
            dev = ctx.device
            inp = inputs_of(CASE, n, ctx.rank)
            x = inp.x.to(dev)
            topk_idx = inp.topk_idx.to(dev)
            weights = inp.topk_weights.to(dev)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, CASE.experts)
            good = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk_idx, topk_weights=weights)

            def bad(expected, *words, x=x, **changes):
                args = dict(good)
                args.update(changes)
                assert_raises(expected, lambda: buf.dispatch(x, **args), *words)
                assert_works(ctx, buf, n, f"n={n} after a bad dispatch ({words[0]})")

            bad(TypeError, "x", "bfloat16", x=x.float())
            bad(ValueError, "x", "cuda", x=x.cpu())
            bad(ValueError, "x", "contiguous", x=torch.empty(CASE.hidden, CASE.tokens, dtype=torch.bfloat16,
                                                              device=dev).t())
            bad(ValueError, "x", "multiple of 8", x=x[:, :1020].contiguous())
            unaligned = torch.empty(CASE.tokens * CASE.hidden + 1, dtype=torch.bfloat16, device=dev)[1:]
            bad(ValueError, "x", "16-byte aligned", x=unaligned.view(CASE.tokens, CASE.hidden))
            bad(TypeError, "x[0]", "float8_e4m3fn", x=(x, torch.ones(CASE.tokens, 8, device=dev)))
            bad(ValueError, "x[1]", "rows", x=(x.to(torch.float8_e4m3fn), torch.ones(3, 8, device=dev)))
            bad(ValueError, "is_token_in_rank", "shape", is_token_in_rank=in_rank[:-1])
            bad(TypeError, "is_token_in_rank", "torch.bool", is_token_in_rank=in_rank.int())
            bad(TypeError, "num_tokens_per_rank", "int32", num_tokens_per_rank=per_rank.long())
            bad(ValueError, "topk_idx", "rows", topk_idx=topk_idx[:-1], topk_weights=weights[:-1])
            bad(ValueError, "topk_weights", "shape", topk_weights=weights[:, :3].contiguous())
            bad(ValueError, "topk_weights", "given with the other", topk_weights=None)
            bad(ValueError, "expert_alignment", ">= 1", expert_alignment=0)
            bad(ValueError, "num_worst_tokens", ">= 0", num_worst_tokens=-1)
            bad(ValueError, "config.num_sms", "1000", config=turnout.Config(1000, 8, 256))
            bad(TypeError, "config", "turnout.Config", config=7)

            # An expert id out of range on one rank: every rank raises, nothing moves.
            wrong = topk_idx.clone()
            if ctx.rank == 0:
                wrong[3, 1] = CASE.experts + 5
            words = ("topk_idx[3, 1]", str(CASE.experts + 5)) if ctx.rank == 0 else ("rank 0", "invalid")
            bad(ValueError, *words, topk_idx=wrong)

            # num_worst_tokens below the receive count: the call moves nothing and
            # (no host wait in that mode) raises after its launches if the GPU has
            # already found it, else check_errors (or the next call) does.
            def too_few():
                try:
                    buf.dispatch(x, num_worst_tokens=1, **good)
                finally:
                    torch.cuda.synchronize()
                buf.check_errors()

            assert_raises(ValueError, too_few, "num_worst_tokens", "receives")
            assert_works(ctx, buf, n, f"n={n} after num_worst_tokens too small")

            out = dispatch(buf, CASE, inp, dev)
            handle = out[4]
            recv_rows = handle[3].shape[0]

            def bad_combine(expected, *words, **changes):
                args = dict(x=torch.randn(recv_rows, CASE.hidden, device=dev).bfloat16(), handle=handle)
                args.update(changes)
                assert_raises(expected, lambda: buf.combine(**args), *words)
                assert_works(ctx, buf, n, f"n={n} after a bad combine ({words[0]})")

            bad_combine(ValueError, "x", "rows", x=torch.zeros(recv_rows + 1, CASE.hidden, dtype=torch.bfloat16,
                                                               device=dev))
            bad_combine(TypeError, "x", "bfloat16", x=torch.zeros(recv_rows, CASE.hidden, device=dev))
            bad_combine(TypeError, "handle", "handle", handle=(1, 2))
            bad_combine(ValueError, "topk_weights", "rows", topk_weights=torch.zeros(recv_rows + 2, 8, device=dev))
            bad_combine(ValueError, "bias", "shape", bias=torch.zeros(5, CASE.hidden, dtype=torch.bfloat16,
                                                                       device=dev))
            bad_combine(TypeError, "bias", "a tuple of 3", bias=(None, None, None))
            unaligned = torch.empty(recv_rows * CASE.hidden + 1, dtype=torch.bfloat16, device=dev)[1:]
            bad_combine(ValueError, "x", "16-byte aligned", x=unaligned.view(recv_rows, CASE.hidden))


test_bad_dispatch_and_combine_arguments.timeout = 300


def test_buffer_too_small_names_the_size(ctx):
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=1 << 20) as buf:
            big = Case("uniform", 64, 7168, 8, 64)
            inp = inputs_of(big, n, ctx.rank)
            assert_raises(ValueError, lambda: dispatch(buf, big, inp, ctx.device), "num_nvl_bytes", "needs")
            # The same buffer still serves a call that fits.
            small = Case("uniform", 64, 256, 4, 32)
            assert_works(ctx, buf, n, f"n={n} small call after a too-big one", small,
                         config=turnout.Config(4, 4, 16))


test_buffer_too_small_names_the_size.timeout = 120

TIMEOUT_S = 1.0
HOST_GRACE_S = 2.0


def test_absent_rank_times_out_in_dispatch(ctx):
    for n in ctx.sizes():
        g = ctx.group(n)
        absent = n - 1
        buf = None
        if g is not None:
            buf = turnout.Buffer(g, num_nvl_bytes=nvl_bytes(CASE.hidden, n), explicitly_destroy=True,
                                 timeout_s=TIMEOUT_S)
            if ctx.rank != absent:
                inp = inputs_of(CASE, n, ctx.rank)
                start = time.monotonic()
                assert_raises(TimeoutError, lambda: dispatch(buf, CASE, inp, ctx.device), f"rank {absent}",
                              "did not answer")
                elapsed = time.monotonic() - start
                assert elapsed <= TIMEOUT_S + HOST_GRACE_S, \
                    f"n={n}: dispatch gave up after {elapsed:.2f} s, timeout_s is {TIMEOUT_S}"
        ctx.all_gather(None)
        if buf is not None and ctx.rank == absent:
            buf.destroy()
        ctx.all_gather(None)
        if buf is not None and ctx.rank != absent:
            buf.destroy()
        ctx.all_gather(None)
        if g is None:
            continue
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(CASE.hidden, n)) as buf:
            assert_works(ctx, buf, n, f"n={n} new buffer after a timeout")


test_absent_rank_times_out_in_dispatch.timeout = 120
