"""Internode mode's Python layer on the CPU: DeepEP's methods and arguments,
the size hint of the declared domain size, the routing of dispatch and
combine, the ten-entry handle and its checks, and what reaches the native
calls (against the binding's parameter names)."""
import inspect
import re
import types

import pytest
import torch

from low_latency_standin import patch_streams
from turnout import _C, Buffer, Config, InternodeHandle
from turnout.ops import internode, intranode
from turnout.ops.context import OpContext
from turnout.ops.internode_handle import ENTRY_NAMES, check_handle

HIDDEN = 256


def binding_names(method):
    doc = getattr(_C.Buffer, method).__doc__
    inside = re.match(rf"{method}\(self, (.*)\) -> ", doc, re.S).group(1)
    return [p.split(":")[0].strip() for p in re.split(r", (?=\w+: )", inside)]


class InternodeNative:
    """Records each call by keyword after checking its names against the
    binding; the counts step answers ``answer`` (num_recv, num_forward, per expert, parts)."""

    def __init__(self, sm_budget=132, answer=(7, 5, [3, 4], 1), channels_per_block=1):
        self.sm_budget = sm_budget
        self.internode_channels_per_block = channels_per_block
        self.answer = answer
        self.calls = []
        self.destroyed = False

    def _record(self, method, kwargs):
        assert list(kwargs) == binding_names(method), method
        self.calls.append((method, kwargs))

    def internode_dispatch_counts(self, **kwargs):
        self._record("internode_dispatch_counts", kwargs)
        return self.answer

    def internode_dispatch(self, **kwargs):
        self._record("internode_dispatch", kwargs)

    def internode_combine(self, **kwargs):
        self._record("internode_combine", kwargs)

    def join(self, waiter, waited):
        self.calls.append(("join", {}))


def make_context(num_ranks=8, num_domains=2, native=None):
    context = types.SimpleNamespace(native=native or InternodeNative(), device=torch.device("cpu"), device_index=0,
                                    num_ranks=num_ranks, num_rdma_ranks=num_domains, comm_stream=None,
                                    comm_raw=0x2000, handle_owner=object(), low_latency=None, tail=None)
    assert set(vars(context)) == set(OpContext.__slots__)
    return context


def handle_entries(num_tokens=6, num_ranks=8, num_domains=2, channels=10, num_recv=7, num_forward=5):
    d = num_ranks // num_domains
    i32 = torch.int32
    return [torch.zeros(num_tokens, num_ranks, dtype=torch.bool), torch.zeros(num_domains, channels, dtype=i32),
            torch.zeros(num_ranks, channels, dtype=i32), torch.zeros(num_domains, channels, dtype=i32),
            torch.zeros(num_domains, dtype=i32), torch.zeros(num_ranks, channels, dtype=i32),
            torch.zeros(num_ranks, dtype=i32), torch.zeros(num_recv, 2, dtype=i32),
            torch.zeros(num_tokens, num_domains, dtype=i32), torch.zeros(num_forward, d, dtype=i32)]


def fresh_inputs(num_tokens=6, num_ranks=8, num_domains=2, num_experts=16, topk=3):
    x = torch.zeros(num_tokens, HIDDEN, dtype=torch.bfloat16)
    return dict(x=x, handle=None, num_tokens_per_rank=torch.zeros(num_ranks, dtype=torch.int32),
                num_tokens_per_rdma_rank=torch.zeros(num_domains, dtype=torch.int32),
                is_token_in_rank=torch.zeros(num_tokens, num_ranks, dtype=torch.bool),
                num_tokens_per_expert=torch.zeros(num_experts, dtype=torch.int32),
                topk_idx=torch.zeros(num_tokens, topk, dtype=torch.int64),
                topk_weights=torch.zeros(num_tokens, topk, dtype=torch.float32))


def run_dispatch(context, num_worst_tokens=0, config=None, **inputs):
    args = fresh_inputs() | inputs
    return internode.dispatch(context, args["x"], args["handle"], args["num_tokens_per_rank"],
                              args["num_tokens_per_rdma_rank"], args["is_token_in_rank"],
                              args["num_tokens_per_expert"], args["topk_idx"], args["topk_weights"], 1,
                              num_worst_tokens, config or Config(20, 8, 256, 16, 128), None, False, False)


@pytest.mark.parametrize("method, deepep", [
    ("internode_dispatch", ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                            "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment",
                            "num_worst_tokens", "config", "previous_event", "async_finish",
                            "allocate_on_comm_stream"]),
    ("internode_combine", ["x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
                           "allocate_on_comm_stream"]),
])
def test_methods_take_deepeps_arguments_in_deepeps_order(method, deepep):
    assert list(inspect.signature(getattr(Buffer, method)).parameters)[1:] == deepep


def test_rdma_size_hint_follows_the_domain_size(monkeypatch):
    config = Config(20, 8, 256, 16, 128)
    monkeypatch.delenv("TURNOUT_NVL_DOMAIN_SIZE", raising=False)
    assert config.get_rdma_buffer_size_hint(HIDDEN * 2, 8) == 0
    assert config.get_rdma_buffer_size_hint(HIDDEN * 2, 8, 2) > 0
    monkeypatch.setenv("TURNOUT_NVL_DOMAIN_SIZE", "2")
    assert config.get_rdma_buffer_size_hint(HIDDEN * 2, 8) == config.get_rdma_buffer_size_hint(HIDDEN * 2, 8, 2)
    # Four domains of 2 hold more rings than two of 4.
    assert config.get_rdma_buffer_size_hint(HIDDEN * 2, 8, 2) > config.get_rdma_buffer_size_hint(HIDDEN * 2, 8, 4)
    with pytest.raises(ValueError, match="num_nvl_ranks"):
        config.get_rdma_buffer_size_hint(HIDDEN * 2, 8, 9)
    with pytest.raises(ValueError, match="multiple"):
        config.get_rdma_buffer_size_hint(HIDDEN * 2, 6, 4)


def routed(monkeypatch, num_domains):
    """A Buffer over a stand-in context, and the mode each op went to."""
    buffer = Buffer.__new__(Buffer)
    buffer._context = make_context(num_domains=num_domains)
    buffer.group_size = 8
    seen = []
    for module, name in ((internode, "internode"), (intranode, "intranode")):
        for op in ("dispatch", "combine"):
            monkeypatch.setattr(module, op, lambda *a, mode=name, op=op: seen.append((mode, op)))
    buffer.dispatch(None)
    buffer.combine(None, None)
    return seen


def test_dispatch_and_combine_go_internode_when_the_group_spans_domains(monkeypatch):
    assert routed(monkeypatch, 2) == [("internode", "dispatch"), ("internode", "combine")]
    assert routed(monkeypatch, 1) == [("intranode", "dispatch"), ("intranode", "combine")]


def test_internode_ops_refuse_a_buffer_of_one_domain():
    context = make_context(num_domains=1)
    with pytest.raises(ValueError, match="one NVL domain"):
        run_dispatch(context)
    with pytest.raises(ValueError, match="one NVL domain"):
        internode.combine(context, torch.zeros(7, HIDDEN, dtype=torch.bfloat16), tuple(handle_entries()), None,
                          None, Config(20, 8, 256, 16, 128), None, False, False)


def test_fresh_dispatch_needs_num_tokens_per_rdma_rank():
    with pytest.raises(TypeError, match="num_tokens_per_rdma_rank"):
        run_dispatch(make_context(), num_tokens_per_rdma_rank=None)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank"):
        run_dispatch(make_context(), num_tokens_per_rdma_rank=torch.zeros(3, dtype=torch.int32))


def test_handle_checks_name_the_entry():
    context = make_context()
    good = handle_entries()
    parts = check_handle(context, "combine", tuple(good), 10)
    assert (parts.num_tokens, parts.num_channels, parts.num_recv, parts.num_forward) == (6, 10, 7, 5)
    with pytest.raises(TypeError, match="ten-entry handle"):
        check_handle(context, "combine", tuple(good[:6]), 10)
    with pytest.raises(ValueError, match="config"):
        check_handle(context, "combine", tuple(good), 12)
    for i in range(1, 10):
        bad = list(good)
        bad[i] = bad[i].to(torch.int64)
        with pytest.raises(TypeError, match=re.escape(f"handle[{i}] ({ENTRY_NAMES[i]})")):
            check_handle(context, "combine", tuple(bad), 10)
    bad = list(good)
    bad[8] = torch.zeros(5, 2, dtype=torch.int32)  # not the tokens of [0]
    with pytest.raises(ValueError, match=re.escape("handle[8] (send_rdma_head)")):
        check_handle(context, "combine", tuple(bad), 10)
    other = InternodeHandle(good)
    other._owner = object()
    with pytest.raises(ValueError, match="another Buffer"):
        check_handle(context, "combine", other, 10)


def test_fresh_dispatch_returns_a_ten_entry_handle_sized_from_the_counts(monkeypatch):
    patch_streams(monkeypatch)
    context = make_context()
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, _ = run_dispatch(context)
    assert isinstance(handle, InternodeHandle) and len(handle) == 10
    assert recv_x.shape == (7, HIDDEN) and recv_topk_idx.shape == (7, 3) and per_expert == [3, 4]
    assert [tuple(t.shape) for t in handle[1:]] == [(2, 10), (8, 10), (2, 10), (2,), (8, 10), (8,), (7, 2), (6, 2),
                                                    (5, 4)]
    (counts_call, counts), (data_call, data) = context.native.calls[:2]
    assert (counts_call, data_call) == ("internode_dispatch_counts", "internode_dispatch")
    assert counts["num_channels"] == 10 and not counts["cached"] and counts["handle"][7:] == [0, 0, 0, 0]
    assert data["handle"] == [t.data_ptr() for t in handle] + [0]
    assert (data["num_recv"], data["num_forward"]) == (7, 5)
    # The handle serves a cached dispatch and a combine of this buffer.
    recv_x, *rest = run_dispatch(context, handle=handle, topk_idx=None, topk_weights=None)
    assert recv_x.shape == (7, HIDDEN) and rest[:4] == [None, None, None, None]
    assert context.native.calls[-2][1]["cached"] and context.native.calls[-1][1]["cached"]
    combined, weights, _ = internode.combine(context, torch.zeros(7, HIDDEN, dtype=torch.bfloat16), handle, None,
                                             None, Config(20, 8, 256, 16, 128), None, False, False)
    assert combined.shape == (6, HIDDEN) and weights is None
    assert context.native.calls[-1][0] == "internode_combine"


def test_num_worst_tokens_sizes_the_outputs_without_the_counts(monkeypatch):
    patch_streams(monkeypatch)
    context = make_context(native=InternodeNative(answer=(-1, -1, [], 1)))
    recv_x, _, _, per_expert, handle, _ = run_dispatch(context, num_worst_tokens=32)
    assert recv_x.shape == (32, HIDDEN) and per_expert == []
    assert handle[7].shape == (32, 2) and handle[9].shape == (4 * 32, 4)


def test_shrink_mode_handles_carry_the_live_set_and_a_row_per_part(monkeypatch):
    patch_streams(monkeypatch)
    native = InternodeNative(answer=(7, 5, [3, 4], 2))
    native.shrink_enabled = True
    context = make_context(native=native)
    handle = run_dispatch(context)[4]
    # 8 ranks as 2 domains of 4; this rank forwards for 2 columns: [3] and [4] get 2 x 2 rows.
    assert isinstance(handle, InternodeHandle) and len(handle) == 11
    assert [tuple(t.shape) for t in handle[1:]] == [(2, 10), (8, 10), (4, 10), (4,), (8, 10), (8,), (7, 2), (6, 2),
                                                    (5, 4), (1,)]
    (_, counts), (_, data) = context.native.calls[:2]
    assert counts["handle"][10] == handle[10].data_ptr() != 0
    assert data["handle"] == [t.data_ptr() for t in handle]
    # The same handle serves a cached dispatch and a combine; one without [10] is refused.
    run_dispatch(context, handle=handle, topk_idx=None, topk_weights=None)
    assert context.native.calls[-1][1]["handle"][10] == handle[10].data_ptr()
    internode.combine(context, torch.zeros(7, HIDDEN, dtype=torch.bfloat16), handle, None, None,
                      Config(20, 8, 256, 16, 128), None, False, False)
    assert context.native.calls[-1][1]["handle"][10] == handle[10].data_ptr()
    with pytest.raises(TypeError, match="eleven-entry handle"):
        check_handle(context, "combine", tuple(handle[:10]), 10)
    bad = list(handle)
    bad[4] = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape("handle[4] (recv_rdma_rank_prefix_sum)")):
        check_handle(context, "combine", tuple(bad), 10)


def test_shrink_mode_with_num_worst_tokens_keeps_a_row_per_part_a_rank_may_have(monkeypatch):
    patch_streams(monkeypatch)
    # No host wait: the counts step answers the binding's defaults, one part.
    native = InternodeNative(answer=(-1, -1, [], 1))
    native.shrink_enabled = True
    context = make_context(native=native)
    recv_x, _, _, per_expert, handle, _ = run_dispatch(context, num_worst_tokens=32)
    # 8 ranks as 2 domains of 4: [3] and [4] get 2 x 4 rows, the most parts a rank may serve.
    assert recv_x.shape == (32, HIDDEN) and per_expert == []
    assert [tuple(t.shape) for t in handle[1:]] == [(2, 10), (8, 10), (8, 10), (8,), (8, 10), (8,), (32, 2), (6, 2),
                                                    (4 * 32, 4), (1,)]
    (_, counts), (_, data) = context.native.calls[:2]
    assert counts["num_worst_tokens"] == data["num_worst_tokens"] == 32
    assert counts["handle"][3:5] == [handle[3].data_ptr(), handle[4].data_ptr()]
    assert data["handle"] == [t.data_ptr() for t in handle]
    assert (data["num_recv"], data["num_forward"]) == (32, 4 * 32)
    # Its cached dispatch and its combine take the handle as it is.
    parts = check_handle(context, "combine", handle, 10)
    assert (parts.num_recv, parts.num_forward) == (32, 4 * 32)
    recv_x, *_ = run_dispatch(context, handle=handle, topk_idx=None, topk_weights=None)
    assert recv_x.shape == (32, HIDDEN)
    cached_counts, cached_data = context.native.calls[-2][1], context.native.calls[-1][1]
    assert cached_counts["cached"] and cached_counts["num_worst_tokens"] == cached_data["num_worst_tokens"] == 0
    assert cached_data["handle"] == [t.data_ptr() for t in handle]
    combined, _, _ = internode.combine(context, torch.zeros(32, HIDDEN, dtype=torch.bfloat16), handle, None, None,
                                       Config(20, 8, 256, 16, 128), None, False, False)
    assert combined.shape == (6, HIDDEN)
    assert (context.native.calls[-1][1]["num_recv"], context.native.calls[-1][1]["num_forward"]) == (32, 4 * 32)


def test_channels_follow_the_sm_budget(monkeypatch):
    patch_streams(monkeypatch)
    context = make_context(native=InternodeNative(sm_budget=8))
    handle = run_dispatch(context)[4]
    assert handle[1].shape == (2, 4)
    # Block pairs of three channels each: three times the channels.
    context = make_context(native=InternodeNative(sm_budget=8, channels_per_block=3))
    handle = run_dispatch(context)[4]
    assert handle[1].shape == (2, 12) and context.native.calls[0][1]["num_channels"] == 12
    # A combine config of other channels than the dispatch's is refused by name.
    context.native.sm_budget = 132
    with pytest.raises(ValueError, match="config"):
        internode.combine(context, torch.zeros(7, HIDDEN, dtype=torch.bfloat16), handle, None, None,
                          Config(20, 8, 256, 16, 128), None, False, False)
