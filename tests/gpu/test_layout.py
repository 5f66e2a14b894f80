"""get_dispatch_layout against the host reference, bitwise: routings of every
shape, NVL domains smaller than the group, the stream options and CUDA graphs."""
import itertools

import torch

import routing
import turnout
from harness import assert_equal, assert_layout_matches, generator

NVL_BYTES = 1 << 20
KINDS = ("uniform", "one_expert", "skip_rank", "holes")
TOKENS = (1, 4096, 8192)
TOPKS = (1, 6, 8)
LONG_ROWS = (9, 32)  # a token takes 16 and 32 lanes of the kernel's warps


def experts_for(n: int):
    return (8 * n, 64, 256)  # all multiples of n for n in 2, 4, 8


def make_routing(kind: str, num_tokens: int, num_experts: int, num_topk: int, n: int, gen, device):
    if kind == "skip_rank":
        return routing.skip_rank(num_tokens, num_experts, num_topk, n, gen, device)
    return getattr(routing, kind)(num_tokens, num_experts, num_topk, gen, device)


def check_layout(out, topk_idx, num_ranks: int, num_experts: int, num_nvl_ranks: int, what: str) -> None:
    per_rank, per_rdma, per_expert, in_rank, _ = out
    assert per_rank.dtype == per_expert.dtype == torch.int32, \
        f"{what}: count dtypes {per_rank.dtype}, {per_expert.dtype}"
    assert in_rank.dtype == torch.bool, f"{what}: is_token_in_rank dtype {in_rank.dtype}"
    ref = assert_layout_matches(out, topk_idx, num_ranks, num_experts, what, num_nvl_ranks)
    if num_nvl_ranks == num_ranks:
        assert per_rdma is None, f"{what}: num_tokens_per_rdma_rank must be None in one NVL domain"
    else:
        assert per_rdma is not None and per_rdma.dtype == torch.int32, f"{what}: num_tokens_per_rdma_rank {per_rdma}"
        assert_equal(per_rdma, ref[1], f"{what}: num_tokens_per_rdma_rank")


def test_layout_matches_reference(ctx):
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
            cases = itertools.chain(itertools.product(KINDS, TOKENS, TOPKS, experts_for(n)),
                                    itertools.product(KINDS, (1, 4096), LONG_ROWS, (256,)))
            for case, (kind, num_tokens, num_topk, num_experts) in enumerate(cases):
                gen = generator("layout", n, ctx.rank, case)
                topk_idx = make_routing(kind, num_tokens, num_experts, num_topk, n, gen, ctx.device)
                what = f"n={n} {kind} T={num_tokens} K={num_topk} E={num_experts}"
                check_layout(buf.get_dispatch_layout(topk_idx, num_experts), topk_idx, n, num_experts, n, what)


def test_layout_with_a_rank_of_zero_tokens(ctx):
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
            for case, (num_topk, num_experts) in enumerate(itertools.product(TOPKS, experts_for(n))):
                # One rank (a different one per case) has no tokens; the others 4096.
                num_tokens = 0 if ctx.rank == case % n else 4096
                gen = generator("zero", n, ctx.rank, case)
                topk_idx = routing.uniform(num_tokens, num_experts, num_topk, gen, ctx.device)
                out = buf.get_dispatch_layout(topk_idx, num_experts)
                what = f"n={n} T={num_tokens} K={num_topk} E={num_experts}"
                assert tuple(out[3].shape) == (num_tokens, n), f"{what}: is_token_in_rank shape {tuple(out[3].shape)}"
                check_layout(out, topk_idx, n, num_experts, n, what)


def test_layout_with_nvl_domains_of_two(ctx):
    if max(ctx.sizes()) < 4:
        ctx.skip(f"needs a group of 4 ranks (two NVL domains of two); this run has {ctx.world_size}")
    for n, g in ctx.each_group(min_size=4):
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES, nvl_domain_size=2) as buf:
            for case, kind in enumerate(KINDS):
                gen = generator("domains", n, ctx.rank, case)
                topk_idx = make_routing(kind, 4096, 64, 8, n, gen, ctx.device)
                out = buf.get_dispatch_layout(topk_idx, 64)
                assert out[1] is not None and tuple(out[1].shape) == (n // 2,), f"n={n} {kind}: rdma counts {out[1]}"
                check_layout(out, topk_idx, n, 64, 2, f"n={n} nvl_domain_size=2 {kind}")


def late_routing(host: torch.Tensor, device):
    """`host` copied to the GPU on a side stream that first sleeps, with the
    event of the copy: an op that does not wait for it reads garbage."""
    topk_idx = torch.full(host.shape, -1, dtype=torch.int64, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        topk_idx.copy_(host, non_blocking=True)
        event = turnout.Buffer.capture()
    return topk_idx, event


def test_layout_stream_options(ctx):
    num_tokens, num_topk, num_experts = 4096, 8, 64
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
            routings = [routing.uniform(num_tokens, num_experts, num_topk, generator("streams", n, ctx.rank, i), "cpu")
                        for i in range(3)]

            # async_finish: an event to wait for, on the communication stream.
            topk_idx = routings[0].to(ctx.device)
            out = buf.get_dispatch_layout(topk_idx, num_experts, async_finish=True)
            assert out[4].event is not None, "async_finish=True must return an event"
            out[4].current_stream_wait()
            check_layout(out, routings[0], n, num_experts, n, f"n={n} async_finish")

            # previous_event: the op waits for a write made on another stream.
            topk_idx, event = late_routing(routings[1].pin_memory(), ctx.device)
            out = buf.get_dispatch_layout(topk_idx, num_experts, previous_event=event)
            assert out[4].event is None, "a synchronous op returns no event"
            check_layout(out, routings[1], n, num_experts, n, f"n={n} previous_event")

            # All three: the outputs belong to the communication stream.
            topk_idx, event = late_routing(routings[2].pin_memory(), ctx.device)
            out = buf.get_dispatch_layout(topk_idx, num_experts, previous_event=event, async_finish=True,
                                          allocate_on_comm_stream=True)
            assert out[4].event is not None, "async_finish=True must return an event"
            out[4].current_stream_wait()
            assert torch.cuda.current_stream() != buf.get_comm_stream(), "the caller's stream must be restored"
            check_layout(out, routings[2], n, num_experts, n, f"n={n} allocate_on_comm_stream")


def test_layout_in_cuda_graph(ctx):
    num_tokens, num_topk, num_experts = 4096, 8, 64
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
            topk_idx = routing.uniform(num_tokens, num_experts, num_topk, generator("graph", n, ctx.rank), ctx.device)
            buf.get_dispatch_layout(topk_idx, num_experts)  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = buf.get_dispatch_layout(topk_idx, num_experts)
            # Each replay sees a new routing through the same input tensor.
            for replay, kind in enumerate(KINDS * 2):
                gen = generator("graph", n, ctx.rank, replay)
                new = make_routing(kind, num_tokens, num_experts, num_topk, n, gen, "cpu")
                topk_idx.copy_(new)
                graph.replay()
                torch.cuda.synchronize()
                check_layout(out, new, n, num_experts, n, f"n={n} graph replay {replay} ({kind})")


def test_eager_layout_beside_a_replaying_graph(ctx):
    """Layout keeps no count between calls: a graph of layout calls replays on
    one stream while eager calls run on the buffer's stream, each call on its
    own routing, and every result is the reference's."""
    num_tokens, num_topk, num_experts = 8192, 8, 256
    for n, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
            captured = routing.uniform(num_tokens, num_experts, num_topk, generator("beside", n, ctx.rank), ctx.device)
            buf.get_dispatch_layout(captured, num_experts)  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_out = buf.get_dispatch_layout(captured, num_experts)
            replay_stream = torch.cuda.Stream()
            for it in range(10):
                kind = KINDS[it % len(KINDS)]
                graph_ids = make_routing(kind, num_tokens, num_experts, num_topk, n,
                                         generator("beside graph", n, ctx.rank, it), "cpu")
                eager_ids = make_routing("uniform", num_tokens, num_experts, num_topk, n,
                                         generator("beside eager", n, ctx.rank, it), ctx.device)
                captured.copy_(graph_ids)
                replay_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(replay_stream):
                    graph.replay()
                eager_out = buf.get_dispatch_layout(eager_ids, num_experts, async_finish=True)
                torch.cuda.synchronize()
                check_layout(graph_out, graph_ids, n, num_experts, n, f"n={n} graph replay {it} ({kind})")
                check_layout(eager_out, eager_ids, n, num_experts, n, f"n={n} eager call beside replay {it}")
