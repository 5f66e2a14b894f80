"""Internode normal mode across declared NVL domains, as its own job: fresh
processes whose environment declares the domain size (TURNOUT_NVL_DOMAIN_SIZE),
so the Buffer spans domains and opens its network region over NVSHMEM (its
P2P transport: this machine has no NIC). Run by test_internode_domains.py.

    python internode_domains_job.py RANKS DOMAIN_SIZE TEST...

TEST is one of TESTS below. Prints one line per test (PASS / SKIP / FAIL) and
exits non-zero if any failed. With TURNOUT_JOB_PROGRESS set, each rank says
when a test starts, and after TURNOUT_JOB_STACKS_AFTER_S (600) seconds prints
every rank's Python stack and exits: what a hung collective looks like."""
import os
import sys
import time
import traceback

TIMEOUT_S = 3.0
HOST_GRACE_S = 2.0


def make_context(rank: int, world_size: int):
    import torch
    import torch.distributed as dist

    import harness

    class DomainContext(harness.Context):
        """The harness's context with one group, all ranks (a smaller group
        would not hold whole domains)."""

        def __init__(self) -> None:
            self.rank = rank
            self.world_size = world_size
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.num_devices = torch.cuda.device_count()
            self.groups = {world_size: dist.group.WORLD}

    return DomainContext()


def domain_size() -> int:
    return int(os.environ["TURNOUT_NVL_DOMAIN_SIZE"])


def internode_buffer(ctx, hidden: int, **kwargs):
    from internode_cases import buffer_bytes

    nvl, rdma = buffer_bytes(hidden, ctx.world_size, domain_size())
    return ctx.buffer(ctx.groups[ctx.world_size], nvl, rdma, **kwargs)


def dispatch_and_combine(ctx) -> None:
    """BF16 and FP8 (column-major scales), with and without top-k, expert
    alignment, skewed routing (every token to one rank), -1 slots, a rank no
    token goes to, a rank with no tokens, and biases: rows and handle entries
    bitwise, combine within the reference's tolerance."""
    from internode_cases import round_trip
    from intranode_cases import Case

    n, d = ctx.world_size, domain_size()
    cases = (Case("uniform", 256, 1024, 8, 64, biases=2),
             Case("uniform", 256, 1024, 8, 64, fp8=True, alignment=4),
             Case("one_rank", 300, 512, 4, 32, biases=1, empty_rank=n - 1),
             Case("holes", 128, 512, 6, 32),
             Case("skip_rank", 128, 512, 4, 32),
             Case("uniform", 64, 512, 0, 32))
    with internode_buffer(ctx, 1024) as buf:
        assert buf.num_rdma_bytes > 0
        for case in cases:
            round_trip(ctx, buf, case, n, d, f"{n} ranks as {n // d} domains of {d}, {case}")


def cached_dispatch(ctx) -> None:
    """A cached dispatch of other rows with a fresh dispatch's handle lands
    them where the fresh one landed its rows."""
    import torch

    from internode_cases import check_rows, config, dispatch, reference_dispatch
    from intranode_cases import Case, inputs_of

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    case = Case("uniform", 200, 1024, 8, 64)
    inputs = [inputs_of(case, n, r) for r in range(n)]
    with internode_buffer(ctx, 1024) as buf:
        out = dispatch(buf, case, inputs[me], dev)
        channels = out[4][1].shape[1]
        other = [torch.randn(case.tokens_of(r), case.hidden, generator=torch.Generator().manual_seed(r)).bfloat16()
                 for r in range(n)]
        refs = reference_dispatch(case, n, d, inputs, channels, x_override=other)
        recv_x, *rest = buf.dispatch(other[me].to(dev), handle=out[4], config=config())
        assert rest[:4] == [None, None, None, None], "a cached dispatch returns only recv_x and the event"
        no_topk = Case("uniform", 200, 1024, 0, 64)
        check_rows(recv_x, None, None, refs[me], no_topk, f"n={n}: cached dispatch")


def worst_tokens(ctx) -> None:
    """num_worst_tokens: no host wait, outputs of that many rows, padding
    marked -1, combine of the padded rows."""
    from internode_cases import round_trip
    from intranode_cases import Case

    n, d = ctx.world_size, domain_size()
    case = Case("uniform", 128, 512, 8, 64)
    with internode_buffer(ctx, 512) as buf:
        round_trip(ctx, buf, case, n, d, f"n={n}: num_worst_tokens", worst=case.tokens * n)


def worst_tokens_in_graph(ctx) -> None:
    """dispatch(num_worst_tokens) + combine captured once in a CUDA graph,
    replayed with new routings and data copied into the captured inputs."""
    import torch

    from internode_cases import check_combine, check_dispatch, config, reference_combine, reference_dispatch
    from intranode_cases import Case, combine_inputs, inputs_of

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    case = Case("uniform", 128, 512, 4, 32, biases=1)
    worst = case.tokens * n
    with internode_buffer(ctx, 512) as buf:
        first = inputs_of(case, n, me)
        x, topk_idx, weights = first.x.to(dev), first.topk_idx.to(dev), first.topk_weights.to(dev)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, case.experts)
        comb_x = torch.zeros(worst, case.hidden, dtype=torch.bfloat16, device=dev)
        bias = torch.zeros(case.tokens, case.hidden, dtype=torch.bfloat16, device=dev)

        def step():
            out = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                               topk_weights=weights, num_worst_tokens=worst, config=config())
            return out, buf.combine(comb_x, out[4], topk_weights=out[2], bias=bias, config=config())

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, back = step()
        channels = out[4][1].shape[1]
        for it in range(5):
            it_case = Case("uniform", 128, 512, 4, 32, biases=1, seed=1000 + it)
            inputs = [inputs_of(it_case, n, r) for r in range(n)]
            refs = reference_dispatch(it_case, n, d, inputs, channels)
            mine = inputs[me]
            x.copy_(mine.x)
            topk_idx.copy_(mine.topk_idx)
            weights.copy_(mine.topk_weights)
            in_rank.copy_(torch.from_numpy(mine.is_token_in_rank.astype(bool)))
            num_recv = refs[me].num_recv
            cx, biases = combine_inputs(it_case, n, me, num_recv)
            comb_x[:num_recv].copy_(cx)
            bias.copy_(biases[0])
            graph.replay()
            torch.cuda.synchronize()
            buf.check_errors()
            what = f"n={n} replay {it}"
            check_dispatch(out, refs[me], it_case, what, worst=worst)
            check_combine(back, reference_combine(it_case, n, refs, me), it_case, what)
        del graph


def bad_input(ctx) -> None:
    """Rank 0 passes an expert id out of range: every rank's dispatch raises
    ValueError; the next good round trip is right."""
    import torch

    from harness import assert_raises
    from internode_cases import config, round_trip
    from intranode_cases import Case, inputs_of

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    case = Case("uniform", 64, 512, 4, 32)
    with internode_buffer(ctx, 512) as buf:
        inp = inputs_of(case, n, me)
        topk_idx = inp.topk_idx.to(dev)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, case.experts)
        if me == 0:
            topk_idx = topk_idx.clone()
            topk_idx[3, 1] = case.experts + 5
        assert_raises(ValueError, lambda: buf.dispatch(
            inp.x.to(dev), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=inp.topk_weights.to(dev),
            config=config()), "invalid input" if me != 0 else "expert")
        torch.cuda.synchronize()
        round_trip(ctx, buf, case, n, d, f"n={n}: after a bad input")


def absent_rank(ctx) -> None:
    """Every rank but the last dispatches: each raises TimeoutError within
    timeout_s (+ grace); those that wait on the last rank directly (its NVL
    domain, its local index in other domains) name it."""
    import torch

    from internode_cases import dispatch
    from intranode_cases import Case, inputs_of

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    absent = n - 1
    case = Case("uniform", 64, 512, 4, 32)
    with internode_buffer(ctx, 512, timeout_s=TIMEOUT_S) as buf:
        if me != absent:
            start = time.monotonic()
            error = None
            try:
                dispatch(buf, case, inputs_of(case, n, me), dev)
                torch.cuda.synchronize()
                buf.check_errors()
            except TimeoutError as e:
                error = e
            elapsed = time.monotonic() - start
            assert error is not None, f"n={n}: rank {absent} never called, and no TimeoutError came"
            if me // d == absent // d or me % d == absent % d:
                assert f"{absent}" in str(error), f"n={n}: the error does not name rank {absent}: {error}"
            assert elapsed <= TIMEOUT_S + HOST_GRACE_S, f"n={n}: TimeoutError after {elapsed:.2f} s"
            assert torch.arange(10, device=dev).sum().item() == 45, f"n={n}: the CUDA context is broken"
        ctx.all_gather(None)


def megatron_and_torchtitan(ctx) -> None:
    """Megatron-LM's and torchtitan's forward and backward calls
    (framework_calls, as test_frameworks.py runs them in one domain) over a
    buffer spanning the domains, sized as Megatron's get_buffer sizes it (the
    default dispatch and combine configs' hints; the network hint from the
    declared domain size), every call without a config: dispatch and the
    handle bitwise, the weighted combine within tolerance, the cached
    dispatch's rows bitwise."""
    import torch

    import turnout
    from framework_calls import megatron_calls
    from internode_cases import check_combine, check_dispatch, check_rows, reference_combine, reference_dispatch
    from intranode_cases import Case, combine_inputs, inputs_of, x_on_device

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    case = Case("uniform", 256, 1024, 8, 64)
    configs = (turnout.Buffer.get_dispatch_config(n), turnout.Buffer.get_combine_config(n))
    nvl = max(c.get_nvl_buffer_size_hint(case.hidden * 2, n) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(case.hidden * 2, n) for c in configs)
    inputs = [inputs_of(case, n, r) for r in range(n)]
    grad_out = [torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(300 + r)).bfloat16()
                for r in range(n)]
    what = f"{n} ranks as {n // d} domains of {d}, megatron"
    with ctx.buffer(ctx.groups[n], nvl, rdma) as buf:
        assert buf.num_rdma_bytes == rdma > 0, f"{what}: the network hint gave {rdma} bytes"
        # Ranks sharing a GPU get a share of its SMs: the default config's
        # block pairs within that budget, each of the library's channels per block.
        channels = min(configs[0].num_sms, buf._native.sm_budget) // 2 * buf._native.internode_channels_per_block
        refs = reference_dispatch(case, n, d, inputs, channels)
        grad, _ = combine_inputs(case, n, me, refs[me].num_recv)
        cached_refs = reference_dispatch(case, n, d, inputs, channels, x_override=grad_out)
        mine = inputs[me]
        out, back, cached = megatron_calls(buf, x_on_device(mine.x, dev), mine.topk_idx.to(dev),
                                           mine.topk_weights.to(dev), case.experts, grad.to(dev), grad_out[me].to(dev))
        check_dispatch(out, refs[me], case, f"{what} dispatch")
        check_combine(back, reference_combine(case, n, refs, me), case, f"{what} combine")
        no_topk = Case("uniform", 256, 1024, 0, 64)
        check_rows(cached[0], None, None, cached_refs[me], no_topk, f"{what} cached dispatch")


def shrink_refused(ctx) -> None:
    """Shrink mode across domains needs no opt-in; what it still refuses, it
    refuses by name on every rank before any launch: a config whose network
    ring holds less than a slot per column a rank may forward for (not at one
    rank a domain, where that is the all-live bound). The buffer's next
    dispatch matches the reference, and so does one with num_worst_tokens
    (every rank live: one part each, the rest of [3] and [4]'s rows parts
    with no tokens); nothing is masked, so its destroy finalizes NVSHMEM and
    the checks after it open it again."""
    import torch

    import turnout
    from harness import assert_raises
    from internode_cases import CONFIG, check_dispatch, dispatch, reference_dispatch
    from intranode_cases import Case, inputs_of

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    case = Case("uniform", 64, 512, 4, 32)
    inputs = [inputs_of(case, n, r) for r in range(n)]
    with internode_buffer(ctx, 512, enable_shrink=True) as buf:
        if d > 1:
            k = buf._native.internode_channels_per_block
            # One slot short of a slot per part, yet within the all-live bounds.
            slots = k * d - 1
            small = turnout.Config(**{**CONFIG, "num_max_rdma_chunked_send_tokens": min(slots, 16),
                                      "num_max_rdma_chunked_recv_tokens": slots})
            assert_raises(ValueError, lambda: dispatch(buf, case, inputs[me], dev, config=small),
                          "num_max_rdma_chunked_recv_tokens", "shrink mode")
        # Started together: a shrink-mode dispatch drops a rank a shrink timeout late.
        ctx.all_gather(None)
        out = dispatch(buf, case, inputs[me], dev)
        torch.cuda.synchronize()
        refs = reference_dispatch(case, n, d, inputs, out[4][1].shape[1], live=[True] * n)
        what = f"{n} ranks as {n // d} domains of {d}: shrink mode"
        check_dispatch(out, refs[me], case, f"{what}, after the refusals", shrink=True)
        worst = case.tokens * n
        ctx.all_gather(None)
        out = dispatch(buf, case, inputs[me], dev, num_worst_tokens=worst)
        torch.cuda.synchronize()
        check_dispatch(out, refs[me], case, f"{what}, num_worst_tokens {worst}", worst=worst, shrink=True)


# The checks that leave NVSHMEM initialized in their processes (a rank is
# masked, so no destroy finalizes it): each must run last in a job of its own.
SHRINK_CHECKS = ("shrink_masked", "shrink_worst_tokens", "shrink_stops_at_dispatch", "shrink_stops_before_combine")

# Holds the shrink check that left NVSHMEM initialized in this process: no
# later Buffer of the job may open it again.
_nvshmem_left = []


def leave_nvshmem_initialized(ctx, name: str) -> None:
    """Skips `name` where an earlier shrink check of this job left NVSHMEM
    initialized; else records that `name` will."""
    if _nvshmem_left:
        ctx.skip(f"{_nvshmem_left[0]} left NVSHMEM initialized in this job; run it alone: "
                 f"TURNOUT_DOMAIN_TESTS={name}")
    _nvshmem_left.append(name)


def shrink_masked_set(n: int, d: int):
    """The ranks shrink_masked masks, and what that exercises.
    TURNOUT_SHRINK_MASKED="1,2" names others."""
    named = os.environ.get("TURNOUT_SHRINK_MASKED")
    if named:
        return {int(r) for r in named.split(",")}, f"TURNOUT_SHRINK_MASKED={named}"
    if d == 1:
        return {0}, "a domain's only rank: no token reaches domain 0"
    if n // d == 2 and d == 2:
        return {1, 2}, "a forwarder of column 1 and one of column 0: each domain's only survivor forwards both"
    return {1, n - d}, "the forwarder of column 1 in domain 0 and of column 0 in the last domain"


def shrink_masked(ctx) -> None:
    """Shrink mode across domains, ranks masked by the API before the calls
    (low_latency_update_mask_buffer on every rank, the masked ones too, so
    that every rank's destroy leaves NVSHMEM alike): the masked ranks make no
    call; each survivor's dispatch (rows and handle, [10] the live set), a
    cached dispatch of the same rows, and combine against the reference with
    live=, whose substitute forwarders the kernels must match. NVSHMEM stays
    initialized after it (a peer was masked), so it runs last in its job,
    one masked set a job."""
    leave_nvshmem_initialized(ctx, "shrink_masked")
    import torch

    from harness import assert_equal
    from internode_cases import (
        buffer_bytes,
        check_combine,
        check_dispatch,
        combine,
        config,
        dispatch,
        reference_combine,
        reference_dispatch,
    )
    from intranode_cases import Case, inputs_of, x_on_device

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    masked, role = shrink_masked_set(n, d)
    live = [r not in masked for r in range(n)]
    cases = (Case("uniform", 128, 512, 8, 64, biases=1), Case("holes", 96, 512, 6, 32),
             Case("uniform", 64, 512, 8, 64, fp8=True, alignment=4))
    nvl, rdma = buffer_bytes(1024, n, d)
    with ctx.buffer(ctx.groups[n], nvl, rdma, enable_shrink=True) as buf:
        for r in sorted(masked):
            buf.low_latency_update_mask_buffer(r, mask=True)
        torch.cuda.synchronize()
        for case in cases:
            # Every rank meets here on the host, so the survivors start each
            # dispatch together: a fresh dispatch drops a rank that comes a
            # shrink timeout late (the agreement), and their host checks
            # between cases may take unlike times.
            ctx.all_gather(None)
            if me not in masked:
                what = f"{n} ranks as {n // d} domains of {d}, masked {sorted(masked)} ({role}), {case}"
                inputs = [inputs_of(case, n, r) for r in range(n)]
                out = dispatch(buf, case, inputs[me], dev)
                torch.cuda.synchronize()
                channels = out[4][1].shape[1]
                refs = reference_dispatch(case, n, d, inputs, channels, live=live)
                check_dispatch(out, refs[me], case, f"{what}: dispatch", shrink=True)
                again = buf.dispatch(x_on_device(inputs[me].x, dev), handle=out[4], config=config())
                torch.cuda.synchronize()
                first, second = (out[0][0], again[0][0]) if case.fp8 else (out[0], again[0])
                assert_equal(second.view(torch.uint8), first.view(torch.uint8), f"{what}: cached dispatch rows")
                back = combine(buf, case, n, me, out, dev, refs[me].num_recv)
                torch.cuda.synchronize()
                check_combine(back, reference_combine(case, n, refs, me), case, f"{what}: combine")
        # The masked ranks wait here while the survivors run.
        ctx.all_gather(None)


def shrink_worst_tokens(ctx) -> None:
    """Shrink mode across domains with num_worst_tokens, shrink_masked's
    ranks masked by the API before the calls (on every rank, the masked ones
    too): each survivor's dispatch, eager and then captured in a CUDA graph
    (with its combine and a cached dispatch of its handle) and replayed with
    new routings, matches the reference with live= (rows past the received
    ones are padding as in worst_tokens; [3] and [4] hold a row per part a
    rank may have, those past the parts it serves with no tokens), and so do
    its combine and the cached dispatch's rows. NVSHMEM stays initialized
    after it (a peer was masked), so it runs last in its job."""
    leave_nvshmem_initialized(ctx, "shrink_worst_tokens")
    import torch

    from harness import assert_equal
    from internode_cases import (
        buffer_bytes,
        check_combine,
        check_dispatch,
        combine,
        config,
        dispatch,
        reference_combine,
        reference_dispatch,
    )
    from intranode_cases import Case, combine_inputs, inputs_of, x_on_device

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    masked, role = shrink_masked_set(n, d)
    live = [r not in masked for r in range(n)]
    survivor = me not in masked
    eager = Case("uniform", 128, 512, 8, 64, biases=1)
    worst = eager.tokens * n
    what = f"{n} ranks as {n // d} domains of {d}, masked {sorted(masked)} ({role}), num_worst_tokens {worst}"

    def check_cached(again, out, num_recv: int, label: str) -> None:
        # A cached dispatch leaves the padding rows as they were: only the received ones compare.
        assert again.shape[0] == worst, f"{label}: the cached dispatch has {again.shape[0]} rows, expected {worst}"
        assert_equal(again[:num_recv].view(torch.uint8), out[0][:num_recv].view(torch.uint8),
                     f"{label}: cached dispatch rows")

    nvl, rdma = buffer_bytes(512, n, d)
    with ctx.buffer(ctx.groups[n], nvl, rdma, enable_shrink=True) as buf:
        for r in sorted(masked):
            buf.low_latency_update_mask_buffer(r, mask=True)
        torch.cuda.synchronize()
        # Survivors start each call together (a fresh dispatch drops a rank a
        # shrink timeout late); the masked ranks only join these meetings.
        ctx.all_gather(None)
        label = f"{what}, eager {eager}"
        if survivor:
            inputs = [inputs_of(eager, n, r) for r in range(n)]
            out = dispatch(buf, eager, inputs[me], dev, num_worst_tokens=worst)
            torch.cuda.synchronize()
            refs = reference_dispatch(eager, n, d, inputs, out[4][1].shape[1], live=live)
            check_dispatch(out, refs[me], eager, f"{label}: dispatch", worst=worst, shrink=True)
        # A shrink-mode combine masks a peer a shrink timeout late: the
        # survivors' host checks above may take unlike times.
        ctx.all_gather(None)
        if survivor:
            back = combine(buf, eager, n, me, out, dev, refs[me].num_recv)
            torch.cuda.synchronize()
            check_combine(back, reference_combine(eager, n, refs, me), eager, f"{label}: combine")
            again = buf.dispatch(x_on_device(inputs[me].x, dev), handle=out[4], config=config())
            torch.cuda.synchronize()
            check_cached(again[0], out, refs[me].num_recv, label)

        graphed = Case("uniform", 128, 512, 4, 32, biases=1)
        ctx.all_gather(None)
        if survivor:
            first = inputs_of(graphed, n, me)
            x, topk_idx, weights = first.x.to(dev), first.topk_idx.to(dev), first.topk_weights.to(dev)
            per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, graphed.experts)
            comb_x = torch.zeros(worst, graphed.hidden, dtype=torch.bfloat16, device=dev)
            bias = torch.zeros(graphed.tokens, graphed.hidden, dtype=torch.bfloat16, device=dev)

            def step():
                out = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                   topk_weights=weights, num_worst_tokens=worst, config=config())
                back = buf.combine(comb_x, out[4], topk_weights=out[2], bias=bias, config=config())
                return out, back, buf.dispatch(x, handle=out[4], config=config())[0]

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()  # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, back, again = step()
            channels = out[4][1].shape[1]
        for it in range(3):
            it_case = Case("uniform", 128, 512, 4, 32, biases=1, seed=2000 + it)
            if survivor:
                inputs = [inputs_of(it_case, n, r) for r in range(n)]
                refs = reference_dispatch(it_case, n, d, inputs, channels, live=live)
                mine = inputs[me]
                x.copy_(mine.x)
                topk_idx.copy_(mine.topk_idx)
                weights.copy_(mine.topk_weights)
                in_rank.copy_(torch.from_numpy(mine.is_token_in_rank.astype(bool)))
                num_recv = refs[me].num_recv
                cx, biases = combine_inputs(it_case, n, me, num_recv)
                comb_x[:num_recv].copy_(cx)
                bias.copy_(biases[0])
                torch.cuda.synchronize()
            # The host work above done, the survivors replay together.
            ctx.all_gather(None)
            if not survivor:
                continue
            graph.replay()
            torch.cuda.synchronize()
            buf.check_errors()
            label = f"{what}, replay {it}"
            check_dispatch(out, refs[me], it_case, f"{label}: dispatch", worst=worst, shrink=True)
            check_combine(back, reference_combine(it_case, n, refs, me), it_case, f"{label}: combine")
            check_cached(again, out, num_recv, label)
        if survivor:
            del graph
        # The masked ranks wait here while the survivors run.
        ctx.all_gather(None)


def shrink_stopped_rank(n: int, d: int, before_combine: bool = False):
    """The rank shrink_stops_at_dispatch (or, before_combine,
    shrink_stops_before_combine) stops, and what that exercises.
    TURNOUT_SHRINK_STOPPED=r names another."""
    named = os.environ.get("TURNOUT_SHRINK_STOPPED")
    if named:
        return int(named), f"TURNOUT_SHRINK_STOPPED={named}"
    if d == 1:
        if before_combine:
            return 1, "a domain's only rank: domain 1's partials, its own rows, are lost"
        return 1, "a domain's only rank: no token reaches domain 1"
    if before_combine:
        return 1, (f"the forwarder of column 1 into domain 0 for the other {n // d - 1} domain(s): the partials "
                   "it forwarded are lost")
    return 1, f"the forwarder of column 1 into domain 0 for the other {n // d - 1} domain(s): a substitute takes over"


def mask_of(buf, n: int, device) -> set:
    import torch

    status = torch.full((n,), -1, dtype=torch.int32, device=device)
    buf.low_latency_query_mask_buffer(status)
    return set(status.cpu().nonzero().flatten().tolist())


# shrink_stops_at_dispatch's shrink timeout: survivors start each dispatch
# together (a gloo all_gather first), so a rank is late only if it stopped.
STOP_SHRINK_S = 2.0
STOP_MARGIN_S = 3.0


def shrink_stops_at_dispatch(ctx) -> None:
    """Shrink mode across domains, a rank that stops calling at its dispatch
    (rank 1: a forwarder for the other domains' column 1, or at one rank a
    domain a whole domain): the survivors' counts step judges every rank
    under the shrink timeout and agrees on the live set (both rounds), so
    their first dispatch completes within the shrink timeout (+ a margin),
    matches the reference with live= leaving the rank out (rows, handle with
    [10], per-expert counts), and masks it; a cached dispatch and a combine
    of that handle match too; the next dispatch (FP8) does not wait. The
    stopped rank joins the host-side meetings only, then masks itself so that
    every rank's destroy leaves NVSHMEM alike. Last in its job, and not in a
    job where another shrink check ran (each leaves NVSHMEM initialized): the
    runner gives it a job of its own."""
    leave_nvshmem_initialized(ctx, "shrink_stops_at_dispatch")
    import torch

    from harness import assert_equal
    from internode_cases import (
        buffer_bytes,
        check_combine,
        check_dispatch,
        combine,
        config,
        dispatch,
        reference_combine,
        reference_dispatch,
    )
    from intranode_cases import Case, inputs_of, x_on_device

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    stopped, role = shrink_stopped_rank(n, d)
    live = [r != stopped for r in range(n)]
    cases = (Case("uniform", 128, 512, 8, 64, biases=1), Case("uniform", 64, 512, 8, 64, fp8=True, alignment=4))
    nvl, rdma = buffer_bytes(1024, n, d)
    with ctx.buffer(ctx.groups[n], nvl, rdma, enable_shrink=True, shrink_timeout_s=STOP_SHRINK_S) as buf:
        for i, case in enumerate(cases):
            what = f"{n} ranks as {n // d} domains of {d}, rank {stopped} stopped ({role}), {case}"
            inputs = [inputs_of(case, n, r) for r in range(n)]
            # Every rank, the stopped one too, meets here on the host: the
            # survivors start their dispatch together.
            ctx.all_gather(None)
            if me == stopped:
                continue
            start = time.monotonic()
            out = dispatch(buf, case, inputs[me], dev)
            torch.cuda.synchronize()
            took = time.monotonic() - start
            if i == 0:
                assert 0.9 * STOP_SHRINK_S <= took <= STOP_SHRINK_S + STOP_MARGIN_S, \
                    f"{what}: the dispatch gave up on rank {stopped} after {took:.2f} s, timeout {STOP_SHRINK_S} s"
            else:
                assert took < STOP_SHRINK_S, f"{what}: the dispatch took {took:.2f} s: it waited for the masked rank"
            got = mask_of(buf, n, dev)
            assert got == {stopped}, f"{what}: the mask holds {sorted(got)}, expected [{stopped}]"
            channels = out[4][1].shape[1]
            refs = reference_dispatch(case, n, d, inputs, channels, live=live)
            check_dispatch(out, refs[me], case, f"{what}: dispatch", shrink=True)
            again = buf.dispatch(x_on_device(inputs[me].x, dev), handle=out[4], config=config())
            torch.cuda.synchronize()
            first, second = (out[0][0], again[0][0]) if case.fp8 else (out[0], again[0])
            assert_equal(second.view(torch.uint8), first.view(torch.uint8), f"{what}: cached dispatch rows")
            back = combine(buf, case, n, me, out, dev, refs[me].num_recv)
            torch.cuda.synchronize()
            check_combine(back, reference_combine(case, n, refs, me), case, f"{what}: combine")
        ctx.all_gather(None)
        if me == stopped:
            # As the survivors' masks hold it, so that every destroy leaves NVSHMEM alike.
            buf.low_latency_update_mask_buffer(stopped, mask=True)
            torch.cuda.synchronize()


def shrink_stops_before_combine(ctx) -> None:
    """Shrink mode across domains, a rank that stops calling between a
    dispatch and its combine (rank 1: the forwarder of the other domains'
    column 1 into domain 0, or at one rank a domain a whole domain). Every
    rank dispatches (checked against the reference); the survivors start the
    combine together, judge every peer under the shrink timeout, mask the
    rank and complete within the shrink timeout (+ a margin), matching the
    reference with live= leaving the rank out and drop_lost_partials (its
    rows and the partials it forwarded are lost: those tokens get the other
    domains' sums). A second combine of the same handle does not wait and
    gives the same bits; the next dispatch (FP8) and its combine do not wait
    and match the reference without the rank. The stopped rank joins the
    host-side meetings only, then masks itself so that every rank's destroy
    leaves NVSHMEM alike. Last in its job, and not in a job where another
    shrink check ran (each leaves NVSHMEM initialized): the runner gives it a
    job of its own."""
    leave_nvshmem_initialized(ctx, "shrink_stops_before_combine")
    import torch

    from harness import assert_equal
    from internode_cases import (
        buffer_bytes,
        check_combine,
        check_dispatch,
        combine,
        dispatch,
        reference_combine,
        reference_dispatch,
    )
    from intranode_cases import Case, inputs_of

    n, d, me, dev = ctx.world_size, domain_size(), ctx.rank, ctx.device
    stopped, role = shrink_stopped_rank(n, d, before_combine=True)
    survivors = [r != stopped for r in range(n)]
    first = Case("uniform", 128, 512, 8, 64, biases=1)
    second = Case("uniform", 64, 512, 8, 64, fp8=True, alignment=4)
    nvl, rdma = buffer_bytes(1024, n, d)
    with ctx.buffer(ctx.groups[n], nvl, rdma, enable_shrink=True, shrink_timeout_s=STOP_SHRINK_S) as buf:
        what = f"{n} ranks as {n // d} domains of {d}, rank {stopped} stopped before combine ({role})"
        inputs = [inputs_of(first, n, r) for r in range(n)]
        # Every rank meets here on the host, then dispatches.
        ctx.all_gather(None)
        out = dispatch(buf, first, inputs[me], dev)
        torch.cuda.synchronize()
        channels = out[4][1].shape[1]
        refs = reference_dispatch(first, n, d, inputs, channels, live=[True] * n)
        check_dispatch(out, refs[me], first, f"{what}, {first}: dispatch", shrink=True)
        # Again, the stopped rank too: the survivors start their combine together.
        ctx.all_gather(None)
        if me != stopped:
            def timed(call):
                start = time.monotonic()
                result = call()
                torch.cuda.synchronize()
                return result, time.monotonic() - start

            back, took = timed(lambda: combine(buf, first, n, me, out, dev, refs[me].num_recv))
            assert 0.9 * STOP_SHRINK_S <= took <= STOP_SHRINK_S + STOP_MARGIN_S, \
                f"{what}: the combine gave up on rank {stopped} after {took:.2f} s, timeout {STOP_SHRINK_S} s"
            got = mask_of(buf, n, dev)
            assert got == {stopped}, f"{what}: the mask holds {sorted(got)}, expected [{stopped}]"
            want = reference_combine(first, n, refs, me, live=survivors, drop_lost_partials=True)
            check_combine(back, want, first, f"{what}, {first}: combine without rank {stopped}")
            # The same combine again: the masked rank is not waited for, and the sums are the same bits.
            again, took = timed(lambda: combine(buf, first, n, me, out, dev, refs[me].num_recv))
            assert took < STOP_SHRINK_S, f"{what}: the second combine took {took:.2f} s: it waited for rank {stopped}"
            assert_equal(again[0].view(torch.int16), back[0].view(torch.int16), f"{what}: second combine's rows")
            assert_equal(again[1].view(torch.int32), back[1].view(torch.int32), f"{what}: second combine's weights")
            # The next dispatch leaves the rank out from the start, and so does its combine.
            what = f"{what}, {second}"
            inputs = [inputs_of(second, n, r) for r in range(n)]
            out, took = timed(lambda: dispatch(buf, second, inputs[me], dev))
            assert took < STOP_SHRINK_S, f"{what}: the dispatch took {took:.2f} s: it waited for rank {stopped}"
            refs = reference_dispatch(second, n, d, inputs, out[4][1].shape[1], live=survivors)
            check_dispatch(out, refs[me], second, f"{what}: dispatch", shrink=True)
            back, took = timed(lambda: combine(buf, second, n, me, out, dev, refs[me].num_recv))
            assert took < STOP_SHRINK_S, f"{what}: the combine took {took:.2f} s: it waited for rank {stopped}"
            check_combine(back, reference_combine(second, n, refs, me), second, f"{what}: combine")
        ctx.all_gather(None)
        if me == stopped:
            # As the survivors' masks hold it, so that every destroy leaves NVSHMEM alike.
            buf.low_latency_update_mask_buffer(stopped, mask=True)
            torch.cuda.synchronize()


TESTS = {"shrink_refused": shrink_refused, "dispatch_and_combine": dispatch_and_combine,
         "cached_dispatch": cached_dispatch, "worst_tokens": worst_tokens,
         "worst_tokens_in_graph": worst_tokens_in_graph, "bad_input": bad_input,
         "absent_rank": absent_rank, "megatron_and_torchtitan": megatron_and_torchtitan,
         # SHRINK_CHECKS, last: each leaves NVSHMEM initialized in its
         # processes (so each skips where one before it ran).
         "shrink_masked": shrink_masked, "shrink_worst_tokens": shrink_worst_tokens,
         "shrink_stops_at_dispatch": shrink_stops_at_dispatch,
         "shrink_stops_before_combine": shrink_stops_before_combine}


def job(rank: int, world_size: int, tests):
    import harness

    if os.environ.get("TURNOUT_JOB_PROGRESS"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ.get("TURNOUT_JOB_STACKS_AFTER_S", "600")), exit=True)
    # The host references run in every rank at once, as in the runner's workers.
    harness.share_cpu_cores(world_size)
    ctx = make_context(rank, world_size)
    lines = []
    for name in tests:
        start = time.monotonic()
        if os.environ.get("TURNOUT_JOB_PROGRESS"):
            print(f"[rank {rank}] start {name}", file=sys.stderr, flush=True)
        try:
            TESTS[name](ctx)
            lines.append(f"PASS {name} ({time.monotonic() - start:.1f} s)")
        except harness.Skipped as e:
            lines.append(f"SKIP {name}: {e}")
        except Exception:
            lines.append(f"FAIL {name}:\n{traceback.format_exc()}")
            break  # the others may wait for this rank in a collective
    return lines


def main() -> int:
    from turnout.launch import run_on_local_gpus

    num_ranks, domain = int(sys.argv[1]), int(sys.argv[2])
    tests = sys.argv[3:]
    assert os.environ.get("TURNOUT_NVL_DOMAIN_SIZE") == str(domain), "the caller declares the domain size"
    try:
        results = run_on_local_gpus(job, (tests,), num_ranks, "gloo", timeout_s=900)
    except RuntimeError as e:
        print(f"FAIL job: {e}")
        return 1
    failed = False
    for rank, lines in enumerate(results):
        for line in lines:
            if rank == 0 or not line.startswith(("PASS", "SKIP")):
                print(f"[rank {rank}] {line}")
            failed |= line.startswith("FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
