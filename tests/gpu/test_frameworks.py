"""The training and serving frameworks' calls, written the way each framework
writes them, against the host reference. Normal mode: Megatron-LM / torchtitan
(deep_ep.utils events, async ops on the communication stream, weighted combine
and cached dispatch in backward), vLLM (the deep_ep alias found by find_spec,
keyword construction, a WeakValueDictionary, set_num_sms, capture()) and SGLang
(positional sizes, Config(**kwargs), expert_alignment=128). Low-latency mode:
vLLM (through the deep_ep alias: a Buffer on the Gloo CPU group with
num_qps_per_rank = local experts, allow_mnnvl=False, explicitly_destroy=True;
dispatch with a receive hook called at once, combine into `out` with and
without a hook; a DeepEP fork's use_nvfp4 refused by name) and SGLang
(clean_low_latency_buffer, low_latency_mode / group_size read, async_finish =
not return_recv_hook)."""
import contextlib
import importlib
import importlib.util
import sys
import tempfile
import weakref

import torch

import low_latency_cases as ll
import turnout
from framework_calls import megatron_calls
from harness import assert_equal
from intranode_cases import (
    Case,
    check_combine,
    check_dispatch,
    combine_inputs,
    inputs_of,
    nvl_bytes,
    reference_combine,
    reference_dispatch,
    x_on_device,
)

CASE = Case("uniform", 512, 2048, 8, 64)


def group_inputs(ctx, case: Case, n: int):
    inputs = [inputs_of(case, n, r) for r in range(n)]
    return inputs, reference_dispatch(case, n, inputs)


def test_megatron_and_torchtitan_calls(ctx):
    for n, g in ctx.each_group():
        size = nvl_bytes(CASE.hidden, n)
        with ctx.buffer(g, num_nvl_bytes=size) as buf:
            assert buf.group is g and buf.num_nvl_bytes == size and buf.num_rdma_bytes == 0, \
                f"group/num_nvl_bytes/num_rdma_bytes: {buf.group}, {buf.num_nvl_bytes}, {buf.num_rdma_bytes}"
            inputs, refs = group_inputs(ctx, CASE, n)
            mine = inputs[ctx.rank]
            grad, _ = combine_inputs(CASE, n, ctx.rank, refs[ctx.rank].num_recv)
            new_x = [torch.randn(CASE.tokens, CASE.hidden, generator=torch.Generator().manual_seed(300 + r)).bfloat16()
                     for r in range(n)]
            cached_refs = reference_dispatch(CASE, n, inputs, x_override=new_x)
            out, back, cached = megatron_calls(buf, x_on_device(mine.x, ctx.device), mine.topk_idx.to(ctx.device),
                                               mine.topk_weights.to(ctx.device), CASE.experts,
                                               grad.to(ctx.device), new_x[ctx.rank].to(ctx.device))
            check_dispatch(out, refs[ctx.rank], CASE, f"n={n} megatron dispatch")
            # The backward of dispatch: a combine weighted by the received top-k weights.
            check_combine(back, reference_combine(CASE, n, refs, ctx.rank), CASE, f"n={n} megatron combine")
            # The backward of combine: a cached dispatch of the output gradient from the handle.
            assert_equal(cached[0].view(torch.uint8), cached_refs[ctx.rank].recv_x, f"n={n}: cached dispatch")


test_megatron_and_torchtitan_calls.timeout = 300


@contextlib.contextmanager
def deep_ep_alias_module():
    """`import deep_ep` giving turnout, through the alias installed in a
    temporary folder (found by find_spec, as vLLM looks for DeepEP)."""
    from turnout import deep_ep_alias

    with tempfile.TemporaryDirectory() as target:
        deep_ep_alias.install(target)
        sys.path.insert(0, target)
        importlib.invalidate_caches()
        try:
            assert importlib.util.find_spec("deep_ep") is not None, "find_spec must see the alias"
            deep_ep = importlib.import_module("deep_ep")
            assert deep_ep.Buffer is turnout.Buffer, "deep_ep.Buffer is not turnout's"
            yield deep_ep
        finally:
            sys.path.remove(target)
            for name in [m for m in sys.modules if m == "deep_ep" or m.startswith("deep_ep.")]:
                del sys.modules[name]


def test_vllm_calls_through_the_deep_ep_alias(ctx):
    with deep_ep_alias_module() as deep_ep:
        run_vllm_calls(ctx, deep_ep)


def run_vllm_calls(ctx, deep_ep):
    buffers = weakref.WeakValueDictionary()
    before = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(16)
        for n, g in ctx.each_group():
            # Built by hand, not by ctx.buffer: vLLM's keyword call through the alias is what is tested.
            buf = deep_ep.Buffer(group=g, num_nvl_bytes=nvl_bytes(CASE.hidden, n), num_rdma_bytes=0,
                                 low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
            buffers[n] = buf
            try:
                assert deep_ep.Buffer.get_dispatch_config(n).num_sms == 16, "set_num_sms must reach the configs"
                inputs, refs = group_inputs(ctx, CASE, n)
                mine = inputs[ctx.rank]
                x = x_on_device(mine.x, ctx.device)
                topk_idx = mine.topk_idx.to(ctx.device)
                previous_event = buf.capture()
                assert isinstance(previous_event.event, torch.cuda.Event), "capture() holds a CUDA event"
                per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
                    topk_idx=topk_idx, num_experts=CASE.experts, previous_event=previous_event,
                    async_finish=False, allocate_on_comm_stream=False)
                out = buf.dispatch(x=x, handle=None, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                   topk_weights=mine.topk_weights.to(ctx.device), expert_alignment=1,
                                   config=deep_ep.Buffer.get_dispatch_config(n), previous_event=previous_event,
                                   async_finish=True, allocate_on_comm_stream=False)
                out[5].current_stream_wait()
                check_dispatch(out, refs[ctx.rank], CASE, f"n={n} vllm dispatch")
                y, _ = combine_inputs(CASE, n, ctx.rank, refs[ctx.rank].num_recv)
                back = buf.combine(x=y.to(ctx.device), handle=out[4], topk_weights=out[2],
                                   config=deep_ep.Buffer.get_combine_config(n), previous_event=buf.capture(),
                                   async_finish=True, allocate_on_comm_stream=False)
                torch.cuda.current_stream().wait_event(back[2].event)
                check_combine(back, reference_combine(CASE, n, refs, ctx.rank), CASE, f"n={n} vllm combine")
            finally:
                buf.destroy()
            assert n in buffers, "a live buffer must stay in the WeakValueDictionary"
    finally:
        deep_ep.Buffer.num_sms = before


test_vllm_calls_through_the_deep_ep_alias.timeout = 300


def test_sglang_calls(ctx):
    case = Case("uniform", 512, 2048, 8, 64, alignment=128)
    for n, g in ctx.each_group():
        config = turnout.Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6,
                                   "num_max_nvl_chunked_recv_tokens": 256, "num_max_rdma_chunked_send_tokens": 6,
                                   "num_max_rdma_chunked_recv_tokens": 128})
        with ctx.buffer(g, config.get_nvl_buffer_size_hint(case.hidden * 2, n), 0, low_latency_mode=False,
                        num_qps_per_rank=1) as buf:
            inputs, refs = group_inputs(ctx, case, n)
            mine = inputs[ctx.rank]
            topk_idx = mine.topk_idx.to(ctx.device)
            previous_event = turnout.Buffer.capture()
            per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
                topk_idx, case.experts, previous_event=previous_event, async_finish=True,
                allocate_on_comm_stream=True)
            out = buf.dispatch(x_on_device(mine.x, ctx.device), topk_idx=topk_idx,
                               topk_weights=mine.topk_weights.to(ctx.device), num_tokens_per_rank=per_rank,
                               num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, previous_event=event, async_finish=True,
                               allocate_on_comm_stream=True, expert_alignment=128, config=config)
            out[5].current_stream_wait()
            check_dispatch(out, refs[ctx.rank], case, f"n={n} sglang dispatch")
            assert all(c % 128 == 0 for c in out[3]), f"counts not aligned to 128: {out[3]}"


test_sglang_calls.timeout = 300


# ---------------------------------------------------------------------------------------------------------------
# Low-latency mode


def test_vllm_low_latency_through_the_deep_ep_alias(ctx):
    """vLLM's DeepEP low-latency all2all manager and prepare/finalize: BF16, FP8
    and FP8 with UE8M0 dispatch, as vLLM calls them."""
    n, cpu_group = ll.world(ctx)  # the run's groups are Gloo (CPU) groups, as vLLM's cpu_group
    cases = [ll.LLCase("uniform", 48, 64, 7168, 8, 64, mode, empty_rank=1) for mode in ("bf16", "fp8", "ue8m0")]
    if cases[0].unfit(n):
        ctx.skip(f"{cases[0]}: {cases[0].unfit(n)}")
    dev, me = ctx.device, ctx.rank
    M, H, E = cases[0].max_tokens, cases[0].hidden, cases[0].experts
    with deep_ep_alias_module() as deep_ep:
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, n, E)
        buffer = deep_ep.Buffer(group=cpu_group, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes,
                                low_latency_mode=True, num_qps_per_rank=E // n, allow_nvlink_for_low_latency_mode=True,
                                allow_mnnvl=False, explicitly_destroy=True)
        try:
            for case in cases:
                use_fp8, ue8m0 = case.use_fp8, case.use_ue8m0
                inputs = [ll.inputs_of(case, n, r) for r in range(n)]
                refs = ll.reference_dispatch(case, n, inputs)
                mine = inputs[me]
                a1 = mine.x.to(dev)
                topk_ids = mine.topk_idx.to(dev).to(deep_ep.topk_idx_t)
                topk_weights = mine.topk_weights.to(dev)
                what = f"n={n} vllm {case.mode}"
                # A DeepEP fork's argument is refused by name, before anything moves.
                raised = None
                try:
                    buffer.low_latency_dispatch(a1, topk_ids, M, E, use_fp8=use_fp8, use_nvfp4=True)
                except TypeError as e:
                    raised = e
                assert raised is not None and "use_nvfp4" in str(raised), \
                    f"{what}: use_nvfp4=True must raise TypeError naming it, got {raised!r}"

                expert_x, expert_num_tokens, handle, _, hook = buffer.low_latency_dispatch(
                    a1, topk_ids, M, E, use_fp8=use_fp8, round_scale=ue8m0, use_ue8m0=ue8m0, async_finish=False,
                    return_recv_hook=True)
                hook()
                torch.cuda.synchronize()
                out = (expert_x, expert_num_tokens, handle, None, None)
                ll.check_dispatch(out, refs[me], case, n, f"{what} dispatch", dev)
                canon = ll.canonical(handle, expert_num_tokens, what)
                fused_expert_output = ll.expert_outputs(canon, ll.all_x(inputs, case), case, n, me, dev)
                rows = ll.MyRows(refs, me, mine.x)
                for do_recv_hook in (False, True):
                    output = torch.empty(a1.shape, dtype=torch.bfloat16, device=dev)
                    _, _, recv_hook = buffer.low_latency_combine(fused_expert_output, topk_ids, topk_weights, handle,
                                                                 async_finish=False, zero_copy=False,
                                                                 return_recv_hook=do_recv_hook, out=output)
                    assert (recv_hook is not None) == do_recv_hook, f"{what}: combine's hook with {do_recv_hook}"
                    if recv_hook is not None:
                        recv_hook()
                    torch.cuda.synchronize()
                    ll.check_combine(output, rows, mine.topk_idx, mine.topk_weights, case, n,
                                     f"{what} combine (recv hook {do_recv_hook})")
        finally:
            buffer.destroy()


test_vllm_low_latency_through_the_deep_ep_alias.timeout = 300


def test_sglang_low_latency_calls(ctx):
    """SGLang's DeepEPBuffer and low-latency dispatcher: positional sizes,
    clean_low_latency_buffer before use, async_finish = not return_recv_hook,
    then hook() or the event's current_stream_wait()."""
    n, group = ll.world(ctx)
    case = ll.LLCase("holes", 64, 128, 7168, 8, 64, "fp8")
    if case.unfit(n):
        ctx.skip(f"{case}: {case.unfit(n)}")
    dev, me = ctx.device, ctx.rank
    M, H, E = case.max_tokens, case.hidden, case.experts
    num_rdma_bytes = turnout.Buffer.get_low_latency_rdma_size_hint(M, H, n, E)
    with ctx.buffer(group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=E // n) as buffer:
        assert buffer.low_latency_mode is True, "SGLang reads low_latency_mode"
        assert buffer.group_size == n, f"SGLang reads group_size: {buffer.group_size}, expected {n}"
        buffer.clean_low_latency_buffer(M, H, E)
        for return_recv_hook in (False, True):
            what = f"n={n} sglang return_recv_hook={return_recv_hook}"
            inputs = [ll.inputs_of(case, n, r) for r in range(n)]
            refs = ll.reference_dispatch(case, n, inputs)
            mine = inputs[me]
            hidden_states, topk_idx = mine.x.to(dev), mine.topk_idx.to(dev)
            packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
                hidden_states, topk_idx, M, E, use_fp8=True, async_finish=not return_recv_hook,
                return_recv_hook=return_recv_hook, round_scale=False, use_ue8m0=False)
            hook() if return_recv_hook else event.current_stream_wait()
            torch.cuda.synchronize()
            ll.check_dispatch((packed_recv_hidden, packed_recv_count, handle, event, hook), refs[me], case, n,
                              f"{what} dispatch", dev)
            canon = ll.canonical(handle, packed_recv_count, what)
            expert_out = ll.expert_outputs(canon, ll.all_x(inputs, case), case, n, me, dev)
            combined_hidden_states, event, hook = buffer.low_latency_combine(
                x=expert_out, topk_idx=topk_idx, topk_weights=mine.topk_weights.to(dev), handle=handle,
                async_finish=not return_recv_hook, zero_copy=False, return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else event.current_stream_wait()
            torch.cuda.synchronize()
            ll.check_combine(combined_hidden_states, ll.MyRows(refs, me, mine.x), mine.topk_idx, mine.topk_weights,
                             case, n, f"{what} combine")


test_sglang_low_latency_calls.timeout = 300
