"""Low-latency dispatch and combine in CUDA graphs, with receive hooks, and the
two live result sets.

- A step (dispatch, an expert function on the GPU, combine) captured once,
  with and without receive hooks, replayed 100 times with new inputs copied
  into the captured tensors: each replay's results are bitwise those of an
  eager step on the same inputs (dispatch in canonical order), and some
  replays are checked against the reference too.
- Double buffering: after two dispatches both results (and handles) are valid;
  after a third, the second's still are, the third's recv_x is the first's
  memory (same data_ptr), and the first's handle is refused (ValueError
  naming `handle`) rather than combined from overwritten rows.
- Hooks: a send-only call followed by hook() gives the eager call's result;
  two dispatches outstanding before their hooks; a hook on another stream;
  return_recv_hook with async_finish refused by name (as in DeepEP: the hook's
  receive runs on the stream current when it is called); async_finish alone.
"""
import torch

from harness import assert_equal, assert_raises
from low_latency_cases import (
    LLCase,
    MyRows,
    all_x,
    assert_same_snapshot,
    canonical,
    check_combine,
    check_dispatch,
    combine_call,
    dispatch,
    dispatch_snapshot,
    expert_outputs,
    expert_scale,
    inputs_of,
    reference_dispatch,
    round_trip,
    size_hint,
    world,
)

REPLAYS = 100
REFERENCE_EVERY = 10  # replays checked against the reference as well


def expert_function(case: LLCase, n: int, rank: int, device):
    """What the captured step runs between dispatch and combine, on the GPU:
    each received row (dequantized with use_fp8) times expert_scale of its
    expert, in bf16. For bf16 dispatch it is low_latency_cases' expert row of
    the same token, so MyRows gives the reference."""
    assert not case.use_ue8m0, "the expert function dequantizes float scales"
    L = case.experts // n
    scale = torch.tensor([expert_scale(rank * L + le) for le in range(L)], dtype=torch.float32, device=device)

    def fn(recv_x):
        if case.use_fp8:
            data, scales = recv_x
            values = data.float() * scales.repeat_interleave(128, dim=2)
        else:
            values = recv_x.float()
        return (values * scale[:, None, None]).bfloat16()

    return fn


def graph_replays(ctx, case: LLCase, hooks: bool, weights_at_dispatch: bool) -> None:
    n, g = world(ctx)
    if case.unfit(n):
        ctx.skip(f"{case}: {case.unfit(n)}")
    dev, me = ctx.device, ctx.rank
    with ctx.buffer(g, num_rdma_bytes=size_hint([case], n), low_latency_mode=True) as buf:
        first = inputs_of(case, n, me)
        x = first.x.to(dev)
        topk_idx = first.topk_idx.to(dev)
        weights = first.topk_weights.to(dev)
        expert = expert_function(case, n, me, dev)
        kwargs = dict(topk_weights=weights) if weights_at_dispatch else {}

        def step():
            out = buf.low_latency_dispatch(x, topk_idx, case.max_tokens, case.experts, use_fp8=case.use_fp8,
                                           round_scale=case.round_scale, use_ue8m0=case.use_ue8m0,
                                           return_recv_hook=hooks, **kwargs)
            if hooks:
                out[4]()
            y = expert(out[0])
            combined, _, hook = buf.low_latency_combine(y, topk_idx, weights, out[2], return_recv_hook=hooks)
            if hooks:
                hook()
            return out, combined

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_combined = step()

        for it in range(REPLAYS):
            it_case = LLCase(case.kind, case.tokens, case.max_tokens, case.hidden, case.topk, case.experts, case.mode,
                             seed=1000 + it)
            check_reference = it % REFERENCE_EVERY == 0 or it == REPLAYS - 1
            inputs = [inputs_of(it_case, n, r) for r in range(n)] if check_reference else None
            mine = inputs[me] if inputs else inputs_of(it_case, n, me)
            x.copy_(mine.x)
            topk_idx.copy_(mine.topk_idx)
            weights.copy_(mine.topk_weights)
            graph.replay()
            torch.cuda.synchronize()
            what = f"n={n} {'hooks ' if hooks else ''}replay {it}"
            if check_reference:
                refs = reference_dispatch(it_case, n, inputs)
                check_dispatch(g_out, refs[me], it_case, n, what, dev)
                if not case.use_fp8:
                    check_combine(g_combined, MyRows(refs, me, mine.x), mine.topk_idx, mine.topk_weights, it_case, n,
                                  what)
            # Copies first: the eager step may reuse the captured outputs' memory.
            g_snap, _ = dispatch_snapshot(g_out, it_case, what + " (replay)", dev)
            g_bits = g_combined.view(torch.int16).cpu()
            e_out, e_combined = step()
            torch.cuda.synchronize()
            e_snap, _ = dispatch_snapshot(e_out, it_case, what + " (eager)", dev)
            assert_same_snapshot(g_snap, e_snap, f"{what}: replay vs eager dispatch")
            assert_equal(g_bits, e_combined.view(torch.int16).cpu(), f"{what}: replay vs eager combined_x")
        del graph


def test_dispatch_and_combine_in_cuda_graph(ctx):
    graph_replays(ctx, LLCase("uniform", 32, 32, 2048, 8, 64, "bf16"), hooks=False, weights_at_dispatch=False)


test_dispatch_and_combine_in_cuda_graph.timeout = 300


def test_hooked_dispatch_and_combine_in_cuda_graph(ctx):
    graph_replays(ctx, LLCase("holes", 32, 32, 2048, 8, 64, "fp8"), hooks=True, weights_at_dispatch=True)


test_hooked_dispatch_and_combine_in_cuda_graph.timeout = 300


def test_two_results_live_and_the_third_reuses_the_first(ctx):
    n, g = world(ctx)
    cases = [LLCase("uniform", 32, 32, 2048, 8, 64, "fp8", seed=s) for s in (1, 2, 3)]
    if cases[0].unfit(n):
        ctx.skip(f"{cases[0]}: {cases[0].unfit(n)}")
    dev, me = ctx.device, ctx.rank
    with ctx.buffer(g, num_rdma_bytes=size_hint(cases, n), low_latency_mode=True) as buf:
        inputs = [[inputs_of(c, n, r) for r in range(n)] for c in cases]
        refs = [reference_dispatch(c, n, i) for c, i in zip(cases, inputs)]
        rows = [MyRows(r, me, i[me].x) for r, i in zip(refs, inputs)]

        def combine_checked(k, out, what):
            y = expert_outputs(canonical(out[2], out[1], what), all_x(inputs[k], cases[k]), cases[k], n, me, dev)
            mine = inputs[k][me]
            combined, _, _ = combine_call(buf, y, out[2], mine.topk_idx.to(dev), mine.topk_weights.to(dev))
            torch.cuda.synchronize()
            check_combine(combined, rows[k], mine.topk_idx, mine.topk_weights, cases[k], n, what)

        outs = [dispatch(buf, cases[k], inputs[k][me], dev) for k in range(2)]
        torch.cuda.synchronize()
        for k in range(2):
            check_dispatch(outs[k], refs[k][me], cases[k], n, f"n={n} dispatch {k} of 2", dev)
        for k in range(2):
            combine_checked(k, outs[k], f"n={n} combine of dispatch {k} of 2")

        outs.append(dispatch(buf, cases[2], inputs[2][me], dev))
        torch.cuda.synchronize()
        check_dispatch(outs[1], refs[1][me], cases[1], n, f"n={n} dispatch 1 after a third", dev)
        check_dispatch(outs[2], refs[2][me], cases[2], n, f"n={n} dispatch 2", dev)
        assert outs[2][0][0].data_ptr() == outs[0][0][0].data_ptr(), \
            f"n={n}: the third dispatch's recv_x is not the first's memory (double buffering)"
        assert outs[2][0][0].data_ptr() != outs[1][0][0].data_ptr(), f"n={n}: the second and third share recv_x"
        combine_checked(1, outs[1], f"n={n} combine of dispatch 1 after a third")
        combine_checked(2, outs[2], f"n={n} combine of dispatch 2")
        mine = inputs[0][me]
        x = torch.zeros_like(outs[1][0][0], dtype=torch.bfloat16)
        assert_raises(ValueError, lambda: buf.low_latency_combine(x, mine.topk_idx.to(dev), mine.topk_weights.to(dev),
                                                                  outs[0][2]), "handle")
        # And the buffer goes on.
        round_trip(ctx, buf, cases[0], n, f"n={n} after the refused handle")


test_two_results_live_and_the_third_reuses_the_first.timeout = 180


def test_receive_hooks(ctx):
    n, g = world(ctx)
    case = LLCase("uniform", 32, 32, 2048, 8, 64, "fp8")
    other = LLCase("one_rank", 32, 32, 2048, 8, 64, "fp8", seed=5)
    if case.unfit(n):
        ctx.skip(f"{case}: {case.unfit(n)}")
    dev, me = ctx.device, ctx.rank
    with ctx.buffer(g, num_rdma_bytes=size_hint([case], n), low_latency_mode=True) as buf:
        inputs = {c: [inputs_of(c, n, r) for r in range(n)] for c in (case, other)}
        refs = {c: reference_dispatch(c, n, inputs[c]) for c in (case, other)}
        mine = inputs[case][me]
        topk_idx, weights = mine.topk_idx.to(dev), mine.topk_weights.to(dev)
        rows = MyRows(refs[case], me, mine.x)
        xs = all_x(inputs[case], case)

        def outputs_for(canon):
            # Each dispatch may place rows its own way: its expert outputs follow its layout.
            return expert_outputs(canon, xs, case, n, me, dev)

        # Eager, for the bits the hooked calls must give.
        eager = dispatch(buf, case, mine, dev)
        torch.cuda.synchronize()
        want, canon = dispatch_snapshot(eager, case, f"n={n} eager", dev)
        eager_y = outputs_for(canon)
        eager_combined, _, _ = combine_call(buf, eager_y, eager[2], topk_idx, weights)
        torch.cuda.synchronize()
        eager_bits = eager_combined.view(torch.int16).cpu()

        def hooked(what, hook_stream=None):
            out = dispatch(buf, case, mine, dev, return_recv_hook=True)
            assert callable(out[4]), f"{what}: dispatch's hook must be callable with return_recv_hook"
            call_hook(out[4], hook_stream)
            torch.cuda.synchronize()
            check_dispatch(out, refs[case][me], case, n, what, dev)
            got, canon = dispatch_snapshot(out, case, what, dev)
            assert_same_snapshot(got, want, f"{what}: vs eager")
            combined, _, hook = combine_call(buf, outputs_for(canon), out[2], topk_idx, weights,
                                             return_recv_hook=True)
            assert callable(hook), f"{what}: combine's hook must be callable with return_recv_hook"
            call_hook(hook, hook_stream)
            torch.cuda.synchronize()
            assert_equal(combined.view(torch.int16), eager_bits, f"{what}: combined_x vs eager")

        def call_hook(hook, hook_stream):
            if hook_stream is None:
                hook()
                return
            hook_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(hook_stream):
                hook()
            torch.cuda.current_stream().wait_stream(hook_stream)

        hooked(f"n={n} send-only then hook()")
        # As in DeepEP, a hook's receive runs on the stream current when it is
        # called, so async_finish has nothing to finish: refused by name.
        assert_raises(ValueError, lambda: dispatch(buf, case, mine, dev, return_recv_hook=True, async_finish=True),
                      "return_recv_hook", "async_finish")
        assert_raises(ValueError, lambda: buf.low_latency_combine(eager_y, topk_idx, weights, eager[2],
                                                                  return_recv_hook=True, async_finish=True),
                      "return_recv_hook", "async_finish")
        hooked(f"n={n} hook on another stream", hook_stream=torch.cuda.Stream())
        check_combine(eager_combined, rows, mine.topk_idx, mine.topk_weights, case, n, f"n={n} eager combine")

        # async_finish alone: the event is what the caller waits on.
        out = dispatch(buf, case, mine, dev, async_finish=True)
        assert out[4] is None, f"n={n}: no hook without return_recv_hook"
        out[3].current_stream_wait()
        got, canon = dispatch_snapshot(out, case, f"n={n} async_finish", dev)
        assert_same_snapshot(got, want, f"n={n} async_finish dispatch vs eager")
        combined, event, hook = combine_call(buf, outputs_for(canon), out[2], topk_idx, weights,
                                             async_finish=True)
        assert hook is None, f"n={n}: no combine hook without return_recv_hook"
        event.current_stream_wait()
        assert_equal(combined.view(torch.int16), eager_bits, f"n={n} async_finish combined_x vs eager")

        # Two micro-batches: both sends out before either receive.
        mine_b = inputs[other][me]
        a = dispatch(buf, case, mine, dev, return_recv_hook=True)
        b = dispatch(buf, other, mine_b, dev, return_recv_hook=True)
        a[4]()
        b[4]()
        torch.cuda.synchronize()
        check_dispatch(a, refs[case][me], case, n, f"n={n} micro-batch a", dev)
        check_dispatch(b, refs[other][me], other, n, f"n={n} micro-batch b", dev)
        y_a = outputs_for(canonical(a[2], a[1], f"n={n} a"))
        y_b = expert_outputs(canonical(b[2], b[1], f"n={n} b"), all_x(inputs[other], other), other, n, me, dev)
        ca, _, hook_a = combine_call(buf, y_a, a[2], topk_idx, weights, return_recv_hook=True)
        cb, _, hook_b = combine_call(buf, y_b, b[2], mine_b.topk_idx.to(dev), mine_b.topk_weights.to(dev),
                                     return_recv_hook=True)
        hook_a()
        hook_b()
        torch.cuda.synchronize()
        assert_equal(ca.view(torch.int16), eager_bits, f"n={n} micro-batch a: combined_x vs eager")
        check_combine(cb, MyRows(refs[other], me, mine_b.x), mine_b.topk_idx, mine_b.topk_weights, other, n,
                      f"n={n} micro-batch b combine")


test_receive_hooks.timeout = 180
