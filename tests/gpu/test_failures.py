"""Failures found on the GPU reach every rank: a bad expert id in one rank's
layout call, a num_worst_tokens below a receive count, a combine handle that
does not fit, errors under CUDA-graph replay. Every rank raises within a
second, no output holds garbage, and the buffer serves the next correct call."""
import time

import torch

from harness import assert_raises
from intranode_cases import (
    Case,
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
)

CASE = Case("uniform", 256, 1024, 4, 32, biases=1)
SECOND_S = 1.0


def assert_works(ctx, buf, n: int, what: str, case: Case = CASE) -> None:
    """The buffer serves the next correct call: a round trip matches the reference."""
    round_trip(ctx, buf, case, n, what)
    torch.cuda.synchronize()


def raised_by(fn):
    """(the exception fn raised or None, fn's result or None)."""
    try:
        return None, fn()
    except Exception as e:  # noqa: BLE001 - the caller checks the kind
        return e, None


def raised_once(buf, rank: int, fn, *words):
    """Runs fn, synchronizes, asks check_errors: exactly one of the two raises
    ValueError with every word of `words` (fn raises if the GPU found the error
    before fn's host check, else check_errors does). Returns fn's result."""
    start = time.monotonic()
    first, result = raised_by(fn)
    torch.cuda.synchronize()
    second, _ = raised_by(buf.check_errors)
    elapsed = time.monotonic() - start
    errors = [e for e in (first, second) if e is not None]
    assert len(errors) == 1, f"rank {rank}: expected one error, got {errors!r}"
    err = errors[0]
    assert isinstance(err, ValueError), f"rank {rank}: expected ValueError, got {type(err).__name__}: {err}"
    missing = [w for w in words if w not in str(err)]
    assert not missing, f"rank {rank}: the message lacks {missing}: {err}"
    assert elapsed < SECOND_S, f"rank {rank}: the error took {elapsed:.2f} s"
    return result


def layout_and_inputs(buf, case: Case, n: int, rank: int, device, bad_rank: int):
    """Rank `bad_rank`'s layout call gets an expert id out of range (token 7,
    slot 2); every rank's dispatch then uses the layout's outputs."""
    inp = inputs_of(case, n, rank)
    topk_idx = inp.topk_idx.to(device)
    layout_ids = topk_idx.clone()
    if rank == bad_rank:
        layout_ids[7, 2] = case.experts + 3
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(layout_ids, case.experts)
    return dict(x=inp.x.to(device), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=inp.topk_weights.to(device))


def test_bad_layout_ids_fail_the_next_dispatch_on_every_rank(ctx):
    for n, g in ctx.each_group():
        bad_rank = n - 1
        mine = ("topk_idx[7, 2]", str(CASE.experts + 3), "get_dispatch_layout (call")
        theirs = (f"rank {bad_rank} passed invalid input", "get_dispatch_layout call")
        words = mine if ctx.rank == bad_rank else theirs
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(CASE.hidden, n)) as buf:
            # With a host wait: every rank raises there, and nothing else runs.
            args = layout_and_inputs(buf, CASE, n, ctx.rank, ctx.device, bad_rank)
            start = time.monotonic()
            assert_raises(ValueError, lambda: buf.dispatch(**args), *words)
            assert time.monotonic() - start < SECOND_S, f"n={n}: the dispatch took {time.monotonic() - start:.2f} s"
            buf.check_errors()  # nothing left behind
            assert_works(ctx, buf, n, f"n={n} after a bad layout (waiting dispatch)")

            # num_worst_tokens: no host wait, so the error comes after the
            # launches or from check_errors; the outputs are all padding.
            args = layout_and_inputs(buf, CASE, n, ctx.rank, ctx.device, bad_rank)
            worst = CASE.tokens * n
            out = raised_once(buf, ctx.rank, lambda: buf.dispatch(**args, num_worst_tokens=worst), *words)
            if out is not None:
                recv_x, recv_topk_idx, recv_topk_weights, _, handle, _ = out
                assert recv_x.shape[0] == worst, f"n={n}: {recv_x.shape[0]} rows, num_worst_tokens is {worst}"
                assert bool((recv_topk_idx == -1).all()), f"n={n}: a failed dispatch left top-k ids that are not -1"
                assert bool((recv_topk_weights == 0).all()), f"n={n}: a failed dispatch left nonzero weights"
                assert bool((handle[3] == -1).all()), f"n={n}: a failed dispatch left source indices"
                assert bool((handle[1] == -1).all()), f"n={n}: a failed dispatch must mark its source counts -1"
            ctx.all_gather(None, g)
            assert_works(ctx, buf, n, f"n={n} after a bad layout (num_worst_tokens)")


test_bad_layout_ids_fail_the_next_dispatch_on_every_rank.timeout = 120


def test_combine_refuses_a_handle_that_does_not_fit(ctx):
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(CASE.hidden, n)) as buf, \
                ctx.buffer(g, num_nvl_bytes=nvl_bytes(CASE.hidden, n)) as other:
            inputs = [inputs_of(CASE, n, r) for r in range(n)]
            refs = reference_dispatch(CASE, n, inputs)
            out = dispatch(buf, CASE, inputs[ctx.rank], ctx.device)
            handle = out[4]
            rows = handle[3].shape[0]
            x = torch.zeros(rows, CASE.hidden, dtype=torch.bfloat16, device=ctx.device)

            # Checked on the host, before any kernel reads it.
            assert_raises(TypeError, lambda: buf.combine(x, handle[:3]), "handle", "six-entry")
            other_out = dispatch(other, CASE, inputs[ctx.rank], ctx.device)
            assert_raises(ValueError, lambda: buf.combine(x, other_out[4]), "handle", "another Buffer")
            wrong = list(handle)
            wrong[0] = handle[0].long()
            assert_raises(TypeError, lambda: buf.combine(x, wrong), "handle[0] (rank_prefix_matrix)", "int32")
            wrong = list(handle)
            wrong[4] = handle[4].cpu()
            assert_raises(ValueError, lambda: buf.combine(x, wrong), "handle[4] (is_token_in_rank)", "cuda")
            wrong = list(handle)
            wrong[1] = handle[1][:-1]
            assert_raises(ValueError, lambda: buf.combine(x, wrong), "handle[1] (source_num_tokens)", "shape")

            # A list of the same entries is a handle too.
            back = combine(buf, CASE, n, ctx.rank, (*out[:4], list(handle), out[5]), ctx.device)
            check_combine(back, reference_combine(CASE, n, refs, ctx.rank), CASE, f"n={n} handle as a list")

            # Rank 0's rank_prefix_matrix counts more rows than its x has: found
            # on the device, every rank raises, nothing moves.
            forged = list(handle)
            if ctx.rank == 0:
                forged[0] = handle[0] + rows + 1
            words = ("does not fit", "rank_prefix_matrix") if ctx.rank == 0 else ("rank 0 passed invalid input",
                                                                                  "handle")
            raised_once(buf, ctx.rank, lambda: buf.combine(x, forged), *words)
            ctx.all_gather(None, g)
            assert_works(ctx, buf, n, f"n={n} after a combine handle that did not fit")


test_combine_refuses_a_handle_that_does_not_fit.timeout = 120


def test_errors_under_graph_replay_are_kept(ctx):
    """A captured dispatch(num_worst_tokens) + combine, replayed once with a
    routing whose receive count exceeds num_worst_tokens: the replay moves
    nothing, its outputs are padding, check_errors raises on every rank, and
    the next replay with a fitting routing is right."""
    case = Case("uniform", 128, 1024, 4, 32, biases=0)
    for n, g in ctx.each_group():
        worst = case.tokens * n - 1  # too few only when every token goes to every rank
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(case.hidden, n)) as buf:
            dev = ctx.device
            inp = inputs_of(case, n, ctx.rank)
            x = inp.x.to(dev)
            topk_idx = inp.topk_idx.to(dev)
            weights = inp.topk_weights.to(dev)
            in_rank = torch.zeros(case.tokens, n, dtype=torch.bool, device=dev)
            per_rank = torch.zeros(n, dtype=torch.int32, device=dev)
            per_expert = torch.zeros(case.experts, dtype=torch.int32, device=dev)
            comb_x = torch.zeros(worst, case.hidden, dtype=torch.bfloat16, device=dev)

            def step():
                out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights,
                                   num_worst_tokens=worst)
                back = buf.combine(comb_x, out[4], topk_weights=out[2])
                return out, back

            # A dispatch that waits for its counts cannot be captured: it says so at once.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()  # warm-up outside the graph (no token goes anywhere)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            refused = torch.cuda.CUDAGraph()
            start = time.monotonic()

            def capture_waiting():
                with torch.cuda.graph(refused):
                    buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)

            assert_raises(ValueError, capture_waiting, "CUDA graph", "num_worst_tokens")
            assert time.monotonic() - start < SECOND_S, "the capture of a waiting dispatch did not fail at once"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, back = step()

            # Every token to every rank: rank r receives T * n > worst rows.
            in_rank.fill_(True)
            topk_idx.copy_(torch.arange(case.topk, device=dev).repeat(case.tokens, 1) * (case.experts // case.topk))
            comb_x.normal_()
            back[0].fill_(7.0)
            graph.replay()
            torch.cuda.synchronize()
            e = assert_raises(ValueError, buf.check_errors, "num_worst_tokens", "dispatch (call")
            assert "Buffer.check_errors" in str(e), f"the message must name the asking call: {e}"
            recv_x, recv_topk_idx, recv_topk_weights, _, handle, _ = out
            assert bool((recv_topk_idx == -1).all()), f"n={n}: the failed replay left top-k ids that are not -1"
            assert bool((handle[3] == -1).all()), f"n={n}: the failed replay left source indices"
            assert bool((back[0] == 7.0).all()), f"n={n}: the combine after a failed dispatch wrote its output"
            buf.check_errors()  # reported once

            # The same graph with a routing that fits is right again.
            it_case = Case("uniform", 128, 1024, 4, 32, biases=0, seed=7)
            inputs = [inputs_of(it_case, n, r) for r in range(n)]
            refs = reference_dispatch(it_case, n, inputs)
            mine = inputs[ctx.rank]
            assert max(r.num_recv for r in refs) <= worst, "the fitting routing must fit num_worst_tokens"
            x.copy_(mine.x)
            topk_idx.copy_(mine.topk_idx)
            weights.copy_(mine.topk_weights)
            in_rank.copy_(torch.from_numpy(mine.is_token_in_rank.astype(bool)))
            num_recv = refs[ctx.rank].num_recv
            comb_x.zero_()
            comb_x[:num_recv].copy_(combine_inputs(it_case, n, ctx.rank, num_recv)[0])
            graph.replay()
            torch.cuda.synchronize()
            buf.check_errors()
            check_dispatch(out, refs[ctx.rank], it_case, f"n={n} replay after a failed one", worst=worst)
            check_combine(back, reference_combine(it_case, n, refs, ctx.rank), it_case,
                          f"n={n} replay after a failed one")
            del graph


test_errors_under_graph_replay_are_kept.timeout = 120
