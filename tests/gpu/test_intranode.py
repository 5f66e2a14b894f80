"""Intranode dispatch and combine against the host reference: routings of
every shape, BF16 and FP8, with and without top-k, the stream options, cached
dispatch, determinism, the ops of one buffer on two streams ordering
themselves, and num_worst_tokens in a CUDA graph."""

import os

import torch

import turnout
from harness import assert_equal
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
    x_on_device,
)

HIDDEN_MAX = 7168
# A middle rank's own rows of at most this many bytes go into its combine stage
# with the others' (kOwnRowsCopiedBytes, kernels/intranode/combine_stage.hpp).
OWN_ROWS_COPIED_BYTES = 2 << 20

CASES = (
    Case("uniform", 4096, 7168, 8, 256, biases=1),
    Case("uniform", 4096, 7168, 8, 256, fp8=True, alignment=128),
    Case("one_expert", 127, 2048, 6, 64, biases=2),
    Case("one_rank", 1024, 4096, 8, 64, alignment=32),
    Case("skip_rank", 8192, 2048, 8, 256, fp8=True),
    Case("holes", 8192, 4096, 8, 256, biases=1),
    Case("holes", 1, 4096, 1, 8),
    Case("uniform", 127, 4096, 0, 64),
    Case("uniform", 4096, 2048, 6, 64, empty_rank=0, fp8=True),
)


def test_dispatch_combine_match_reference(ctx):
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(HIDDEN_MAX, n)) as buf:
            for case in CASES:
                round_trip(ctx, buf, case, n, f"n={n} {case}")


test_dispatch_combine_match_reference.timeout = 600


def stage_room(num_tokens: int, hidden: int, n: int) -> int:
    """Bytes past the rings for combine's two stages of every rank's rows,
    each of n ranks sending num_tokens tokens (a rank gets each at most once)."""
    return (2 << 20) + 2 * (num_tokens * n * (hidden * 2 + 4 * 32) + 8192)


def as_bits(t):
    return None if t is None else t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def test_landing_areas_and_stages(ctx):
    """With room past the rings for every rank's rows, dispatch stores them in
    the receivers' landing areas, and combine stages them and the blocks pull
    them: every case matches the reference, combines alternate between the two
    stages, and combine's outputs are the bits the rings give (the same sums in
    the same order). With room for some ranks' rows only, combine's ranks
    stage what fits and every rank still takes the rings."""
    for n, g in ctx.each_group():
        rings_only = nvl_bytes(HIDDEN_MAX, n)
        with ctx.buffer(g, num_nvl_bytes=rings_only + stage_room(8192, HIDDEN_MAX, n)) as staged, \
                ctx.buffer(g, num_nvl_bytes=rings_only) as rings:
            for case in CASES:
                what = f"n={n} {case}"
                _, _, out = round_trip(ctx, staged, case, n, f"{what}, staged")
                again = combine(staged, case, n, ctx.rank, out, ctx.device)
                _, _, ring_out = round_trip(ctx, rings, case, n, f"{what}, rings")
                ringed = combine(rings, case, n, ctx.rank, ring_out, ctx.device)
                assert_equal(as_bits(again[0]), as_bits(ringed[0]), f"{what}: combined_x, stages against rings")
                if case.topk:
                    assert_equal(as_bits(again[1]), as_bits(ringed[1]), f"{what}: weights, stages against rings")
        # Room for a bit over 1024 rows: the rank that gets every token (1024
        # from each rank) cannot stage them, the others stage none.
        case = Case("one_rank", 1024, 4096, 8, 64)
        config = turnout.Buffer.get_combine_config(n)
        past_rings = max(-(-nvl_bytes(case.hidden, n, config) // 4096) * 4096, 1 << 20)
        with ctx.buffer(g, num_nvl_bytes=past_rings + 2 * (1024 * (case.hidden * 2 + 32) + 8192)) as some:
            for i in range(3):
                round_trip(ctx, some, case, n, f"n={n} {case}, one rank's rows past its stage, call {i}",
                           config=config)


test_landing_areas_and_stages.timeout = 600


def test_fp8_past_64_scale_groups(ctx):
    """FP8 rows of more than 64 scale groups (hidden 10240: 80), whose groups
    past 64 each path moves apart from the rest (a lane holds two), landed and
    through the rings, against the reference."""
    case = Case("skip_rank", 512, 10240, 8, 64, fp8=True, biases=1)
    for n, g in ctx.each_group():
        rings_only = nvl_bytes(case.hidden, n)
        with ctx.buffer(g, num_nvl_bytes=rings_only + stage_room(case.tokens, case.hidden, n)) as landing, \
                ctx.buffer(g, num_nvl_bytes=rings_only) as rings:
            round_trip(ctx, landing, case, n, f"n={n} {case}, landing areas")
            round_trip(ctx, rings, case, n, f"n={n} {case}, rings")


def test_combine_stage_leaves_out_only_the_rows_from_itself(ctx):
    """Combine's copy into its stage leaves out the rows a rank sent itself
    (its reducers read them from x): the handle of a dispatch that waited for
    its counts says where they lie, and the sums match the reference. A range
    the handle's matrix does not confirm sends every rank to the rings for
    that call, and the sums still match, though the stage row it left out
    holds another call's zeros."""
    case = Case("uniform", 1024, 2048, 8, 64, biases=1)
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(HIDDEN_MAX, n) + stage_room(1024, case.hidden, n)) as buf:
            what = f"n={n} {case}"
            _, refs, out = round_trip(ctx, buf, case, n, what)
            handle, me = out[4], ctx.rank
            prefix = handle[0].cpu()
            begin = int(prefix[me - 1, me]) if me else 0
            assert handle._own_rows == (begin, int(prefix[me, me]) - begin), f"{what}: {handle._own_rows}"
            count = handle._own_rows[1]
            if 0 < begin and begin + count < out[0].shape[0]:
                assert count * case.hidden * 2 > OWN_ROWS_COPIED_BYTES, f"{what}: {count} own rows go into the stage"
            zeros = torch.zeros_like(out[0])
            for _ in range(2):  # both stages
                buf.combine(zeros, handle, topk_weights=out[2])
            handle._own_rows = (begin - 1, count) if begin else (1, count)
            back = combine(buf, case, n, me, out, ctx.device)
            check_combine(back, reference_combine(case, n, refs, me), case, f"{what}, own rows misplaced")


def test_combine_stage_takes_few_own_rows_along(ctx):
    """A rank whose rows from itself lie between other ranks' rows and are few
    copies them into its stage with the rest, in one copy: the sums match the
    reference from both stages, each of which held zeros before."""
    case = Case("uniform", 64, 2048, 8, 64, biases=1)
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(HIDDEN_MAX, n) + stage_room(case.tokens, case.hidden, n)) as buf:
            what = f"n={n} {case}"
            _, refs, out = round_trip(ctx, buf, case, n, what)
            count = out[4]._own_rows[1]
            assert count * case.hidden * 2 <= OWN_ROWS_COPIED_BYTES, f"{what}: {count} own rows"
            zeros = torch.zeros_like(out[0])
            for _ in range(2):
                buf.combine(zeros, out[4], topk_weights=out[2])
            for stage in range(2):
                back = combine(buf, case, n, ctx.rank, out, ctx.device)
                check_combine(back, reference_combine(case, n, refs, ctx.rank), case, f"{what}, stage {stage}")


def test_staged_combines_of_changing_shapes(ctx):
    """An eager combine enqueues its copies and launches as one graph, made
    once per shape (how many copies, which kernels, how many blocks) and set
    anew each call: one buffer takes combines of up to six shapes in turn (one
    copy or two, on 4, 8 or the default SMs), more than it keeps graphs of,
    twice over, each against the reference, so that graphs are made, set with
    other addresses and sizes, dropped and made again."""
    small = Case("uniform", 64, 2048, 8, 64, biases=1)
    large = Case("uniform", 1024, 2048, 8, 64)
    configs = (turnout.Config(4, 4, 64), turnout.Config(8, 4, 64), None)
    for n, g in ctx.each_group():
        room = nvl_bytes(HIDDEN_MAX, n) + stage_room(large.tokens, large.hidden, n)
        with ctx.buffer(g, num_nvl_bytes=room) as buf:
            for i in range(2):
                for case in (small, large):
                    for config in configs:
                        sms = config.num_sms if config else "default"
                        what = f"n={n} {case}, {sms} SMs, round {i}"
                        round_trip(ctx, buf, case, n, what, config=config)


def test_combine_stage_weights_at_any_address(ctx):
    """The check step copies combine's top-k weights into the stage in fours
    where their address allows (the other tests), else one by one: weights
    four bytes past a 16-byte boundary, doubled so that none the copy missed
    could pass for the stage's earlier ones, sum to twice the reference's, from
    both stages."""
    case = Case("uniform", 127, 2048, 6, 64, biases=1)
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(HIDDEN_MAX, n) + stage_room(case.tokens, case.hidden, n)) as buf:
            what = f"n={n} {case}"
            _, refs, out = round_trip(ctx, buf, case, n, what)
            weights = out[2]
            shifted = torch.empty(weights.numel() + 1, dtype=weights.dtype, device=weights.device)[1:]
            shifted = shifted.view(weights.shape).copy_(weights * 2)
            assert shifted.data_ptr() % 16 == 4, f"{what}: weights at {shifted.data_ptr() % 16} past 16 bytes"
            x, biases = combine_inputs(case, n, ctx.rank, weights.shape[0])
            ref_x, ref_w = reference_combine(case, n, refs, ctx.rank)
            for stage in range(2):
                back = buf.combine(x.to(ctx.device), out[4], topk_weights=shifted, bias=biases[0].to(ctx.device))
                check_combine(back, (ref_x, 2 * ref_w), case, f"{what}, doubled weights, stage {stage}")


def test_worst_tokens_with_stages(ctx):
    """An eager dispatch with num_worst_tokens (outputs of the worst rows; the
    host knows neither the receive count nor where the rows from itself lie)
    and its combine with top-k weights, on a buffer with room for the stages:
    combine stages every row of x, padding included, three calls in turn
    (both stages, then the first again), each against the reference."""
    for n, g in ctx.each_group():
        case = Case("skip_rank", 512, 4096, 8, 64, biases=1)
        worst = case.tokens * n
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(case.hidden, n) + stage_room(case.tokens, case.hidden, n)) as buf:
            for i in range(3):
                it_case = Case("skip_rank", 512, 4096, 8, 64, biases=1, seed=i)
                inputs = [inputs_of(it_case, n, r) for r in range(n)]
                refs = reference_dispatch(it_case, n, inputs, only_rank=ctx.rank)
                what = f"n={n} {it_case}, num_worst_tokens {worst}, call {i}"
                out = dispatch(buf, it_case, inputs[ctx.rank], ctx.device, num_worst_tokens=worst)
                check_dispatch(out, refs[ctx.rank], it_case, what, worst=worst)
                assert out[4]._own_rows == (-1, 0), f"{what}: own rows {out[4]._own_rows}"
                back = combine(buf, it_case, n, ctx.rank, out, ctx.device, worst=worst)
                check_combine(back, reference_combine(it_case, n, refs, ctx.rank), it_case, what)


def test_one_launch_with_ranks_sharing(ctx):
    """The launch of a rank with its GPU to itself, run by two ranks sharing
    one (TURNOUT_ONE_LAUNCH=1): dispatch with num_worst_tokens (counts and data
    step in one kernel), a cached dispatch (so too), and combine (handle check
    and combine in one kernel) staged and on the rings, each against the
    reference."""
    if not ctx.shares_gpu:
        ctx.skip("ranks have GPUs of their own: every other test runs this launch")
    os.environ["TURNOUT_ONE_LAUNCH"] = "1"
    try:
        for n, g in ctx.each_group():
            if n != 2:
                continue
            rings_only = nvl_bytes(HIDDEN_MAX, n)
            for room in (stage_room(8192, HIDDEN_MAX, n), 0):
                with ctx.buffer(g, num_nvl_bytes=rings_only + room) as buf:
                    assert buf._native.one_launch, f"n={n}: TURNOUT_ONE_LAUNCH=1 left two launches"
                    for case in CASES:
                        what = f"n={n} {case}, {'stages' if room else 'rings'}"
                        inputs, _, out = round_trip(ctx, buf, case, n, what)
                        new_x = [torch.randn(case.tokens_of(r), case.hidden,
                                             generator=torch.Generator().manual_seed(100 + r)).bfloat16()
                                 for r in range(n)]
                        if not case.fp8:
                            cached = reference_dispatch(case, n, inputs, x_override=new_x, only_rank=ctx.rank)
                            recv_x = buf.dispatch(x_on_device(new_x[ctx.rank], ctx.device), handle=out[4])[0]
                            assert_equal(recv_x.view(torch.uint8), cached[ctx.rank].recv_x,
                                         f"{what}: cached dispatch recv_x")
                        if case.topk:
                            worst = case.tokens * n
                            refs = reference_dispatch(case, n, inputs, only_rank=ctx.rank)
                            what += f", num_worst_tokens {worst}"
                            out = dispatch(buf, case, inputs[ctx.rank], ctx.device, num_worst_tokens=worst)
                            check_dispatch(out, refs[ctx.rank], case, what, worst=worst)
                            back = combine(buf, case, n, ctx.rank, out, ctx.device, worst=worst)
                            check_combine(back, reference_combine(case, n, refs, ctx.rank), case, what)
    finally:
        del os.environ["TURNOUT_ONE_LAUNCH"]


test_one_launch_with_ranks_sharing.timeout = 300


def test_stream_options_and_cached_dispatch(ctx):
    case = Case("uniform", 2048, 4096, 8, 128, biases=2)
    # Past 20 SMs combine sends a rank's rows for itself through a ring too.
    wide = turnout.Config(24, 6, 256)
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=max(nvl_bytes(case.hidden, n), nvl_bytes(case.hidden, n, wide))) as buf:
            round_trip(ctx, buf, case, n, f"n={n} async", async_finish=True)
            round_trip(ctx, buf, case, n, f"n={n} previous_event", previous_event=turnout.Buffer.capture())
            round_trip(ctx, buf, case, n, f"n={n} comm-stream outputs", previous_event=turnout.Buffer.capture(),
                       async_finish=True, allocate_on_comm_stream=True)
            # Fewer SMs than the default, and a config of its own.
            round_trip(ctx, buf, case, n, f"n={n} 4 SMs", config=turnout.Config(4, 4, 64))
            round_trip(ctx, buf, case, n, f"n={n} 24 SMs", config=wide)
            inputs, refs, out = round_trip(ctx, buf, case, n, f"n={n} plain")
            # The caller on a stream of its own: the joins name it (the default stream's handle is 0).
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                round_trip(ctx, buf, case, n, f"n={n} side stream")
            torch.cuda.current_stream().wait_stream(side)

            # Cached: same routing, new x, from the handle.
            new_x = [torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(100 + r)).bfloat16()
                     for r in range(n)]
            cached_refs = reference_dispatch(case, n, inputs, x_override=new_x, only_rank=ctx.rank)
            recv_x, a, b, c, d, _ = buf.dispatch(x_on_device(new_x[ctx.rank], ctx.device), handle=out[4])
            assert a is None and b is None and c is None and d is None, "cached dispatch returns only recv_x"
            assert_equal(recv_x.view(torch.uint8), cached_refs[ctx.rank].recv_x, f"n={n}: cached dispatch recv_x")


test_stream_options_and_cached_dispatch.timeout = 300


def test_ops_on_two_streams_order_themselves(ctx):
    """The ops of one buffer issued on two side streams in turn, the test
    joining neither: each layout and dispatch on one, its combine (of the
    dispatch's outputs) on the other, then the other way round. The buffer
    makes each op's stream wait for the last op's, so every result matches
    the reference once the GPU is synchronized at the end. Without that
    order a combine would read a dispatch's outputs before they were written,
    or two ops would use the buffer's region at once."""
    cases = (Case("uniform", 1024, 2048, 8, 64, biases=1), Case("holes", 512, 4096, 8, 64, fp8=True))
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(4096, n)) as buf:
            streams = (torch.cuda.Stream(), torch.cuda.Stream())
            torch.cuda.synchronize()
            rounds = []
            for i in range(6):
                case = cases[i % 2]
                inputs = [inputs_of(case, n, r) for r in range(n)]
                with torch.cuda.stream(streams[i % 2]):
                    out = dispatch(buf, case, inputs[ctx.rank], ctx.device)
                with torch.cuda.stream(streams[1 - i % 2]):
                    back = combine(buf, case, n, ctx.rank, out, ctx.device)
                rounds.append((case, inputs, out, back))
            torch.cuda.synchronize()
            for i, (case, inputs, out, back) in enumerate(rounds):
                refs = reference_dispatch(case, n, inputs, only_rank=ctx.rank)
                check_dispatch(out, refs[ctx.rank], case, f"n={n} round {i}: dispatch")
                check_combine(back, reference_combine(case, n, refs, ctx.rank), case, f"n={n} round {i}: combine")


test_ops_on_two_streams_order_themselves.timeout = 300


def test_same_seed_gives_same_bits(ctx):
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(1024, n)) as buf:
            for seed in range(20):
                case = Case("uniform", 300, 1024, 8, 64, biases=1, seed=seed)
                inputs = inputs_of(case, n, ctx.rank)
                runs = []
                for _ in range(2):
                    out = dispatch(buf, case, inputs, ctx.device)
                    back = combine(buf, case, n, ctx.rank, out, ctx.device)
                    runs.append((out[0].clone(), out[2].clone(), back[0].clone(), back[1].clone()))
                for i, name in enumerate(("recv_x", "recv_topk_weights", "combined_x", "combined_topk_weights")):
                    assert_equal(runs[1][i].view(torch.int16 if i in (0, 2) else torch.int32),
                                 runs[0][i].view(torch.int16 if i in (0, 2) else torch.int32),
                                 f"n={n} seed={seed}: {name} of two runs")
            # And one of them against the reference.
            round_trip(ctx, buf, Case("uniform", 300, 1024, 8, 64, biases=1, seed=19), n, f"n={n} seed 19")


test_same_seed_gives_same_bits.timeout = 300


def test_worst_tokens_in_cuda_graph(ctx):
    """dispatch(num_worst_tokens) + combine captured once, replayed 100 times
    (20 in the smaller subgroups) with new routings and data copied into the
    captured inputs."""
    case = Case("uniform", 256, 1024, 4, 32, biases=1)
    for n, g in ctx.each_group():
        worst = case.tokens * n
        with ctx.buffer(g, num_nvl_bytes=nvl_bytes(case.hidden, n)) as buf:
            dev = ctx.device
            first = inputs_of(case, n, ctx.rank)
            x = first.x.to(dev)
            topk_idx = first.topk_idx.to(dev)
            weights = first.topk_weights.to(dev)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, case.experts)
            comb_x = torch.zeros(worst, case.hidden, dtype=torch.bfloat16, device=dev)
            bias = torch.zeros(case.tokens, case.hidden, dtype=torch.bfloat16, device=dev)

            def step():
                out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights,
                                   num_worst_tokens=worst)
                back = buf.combine(comb_x, out[4], topk_weights=out[2], bias=bias)
                return out, back

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()  # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, back = step()
            # 100 replays on the whole group, 20 on its smaller subgroups.
            replays = 100 if n == max(ctx.sizes()) else 20
            for it in range(replays):
                it_case = Case("uniform", 256, 1024, 4, 32, biases=1, seed=1000 + it)
                inputs = [inputs_of(it_case, n, r) for r in range(n)]
                refs = reference_dispatch(it_case, n, inputs)
                mine = inputs[ctx.rank]
                x.copy_(mine.x)
                topk_idx.copy_(mine.topk_idx)
                weights.copy_(mine.topk_weights)
                in_rank.copy_(torch.from_numpy(mine.is_token_in_rank.astype(bool)))
                num_recv = refs[ctx.rank].num_recv
                cx, biases = combine_inputs(it_case, n, ctx.rank, num_recv)
                comb_x[:num_recv].copy_(cx)
                bias.copy_(biases[0])
                graph.replay()
                torch.cuda.synchronize()
                what = f"n={n} replay {it}"
                check_dispatch(out, refs[ctx.rank], it_case, what, worst=worst)
                check_combine(back, reference_combine(it_case, n, refs, ctx.rank), it_case, what)
            del graph


test_worst_tokens_in_cuda_graph.timeout = 300
