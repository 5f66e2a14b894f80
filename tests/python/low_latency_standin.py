"""A stand-in for the native low-latency buffer, and the OpContext and inputs
that drive the Python layer (python/turnout/ops/low_latency.py) over it on
the CPU. Each native call is checked against the real binding's signature, so
what passes here is what the module would accept."""
import re
import types

import torch

from turnout import _C
from turnout.ops import low_latency as ll
from turnout.ops import streams
from turnout.ops.context import OpContext


def binding_parameters(method):
    """(name, type) of each parameter of a bound _C.Buffer method, from its signature."""
    doc = getattr(_C.Buffer, method).__doc__
    inside = re.match(rf"{method}\(self, (.*)\) -> None", doc).group(1)
    return [tuple(p.split(": ")) for p in inside.split(", ")]


def conforms(value, kind):
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "int | None":
        return value is None or conforms(value, "int")
    if kind == "bool":
        return isinstance(value, bool)
    return f"{type(value).__module__}.{type(value).__qualname__}" == kind


class NativeStandIn:
    """Records each call by parameter name after checking it against the
    binding's signature: what the real module would accept."""

    destroyed = False

    def __init__(self):
        self.calls = []

    def _record(self, method, args):
        params = binding_parameters(method)
        assert len(args) == len(params), f"{method}: {len(args)} arguments for {len(params)} parameters"
        for value, (name, kind) in zip(args, params):
            assert conforms(value, kind), f"{method}: {name}={value!r} is no {kind}"
        self.calls.append((method, dict(zip((n for n, _ in params), args))))

    def low_latency_dispatch(self, *args):
        self._record("low_latency_dispatch", args)

    def low_latency_combine(self, *args):
        self._record("low_latency_combine", args)

    def clean_low_latency_buffer(self, *args):
        self._record("clean_low_latency_buffer", args)

    def join(self, waiter, waited):
        self.calls.append(("join", {"waiter": waiter, "waited": waited}))


CALLER_STREAM = 0x1000
COMM_STREAM = 0x2000


def patch_streams(monkeypatch):
    """Makes the ops read the caller's stream from a list (tests change it there); returns the list."""
    current = [CALLER_STREAM]
    monkeypatch.setattr(ll, "current_raw_stream", lambda device_index: current[0])
    monkeypatch.setattr(streams, "current_raw_stream", lambda device_index: current[0])
    return current


def make_context(num_ranks=4, low_latency_mode=True, device="cpu", device_index=0):
    """What an OpContext holds, on a device without a GPU."""
    context = types.SimpleNamespace(native=NativeStandIn(), device=torch.device(device), device_index=device_index,
                                    num_ranks=num_ranks, num_rdma_ranks=1, comm_stream=None, comm_raw=COMM_STREAM,
                                    handle_owner=object(), low_latency=None)
    assert set(vars(context)) == set(OpContext.__slots__)
    if low_latency_mode:
        context.low_latency = ll.LowLatencyState(COMM_STREAM)
    return context


R, M, H, E, T, K = 4, 8, 256, 16, 5, 3


def inputs(tokens=T, hidden=H, topk=K, experts=E, device="cpu"):
    g = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x = torch.randn(tokens, hidden, generator=g, device="cpu").to(device, torch.bfloat16)
    topk_idx = torch.randint(-1, experts, (tokens, topk), generator=g, device="cpu").to(device)
    return x, topk_idx


def dispatch(context, x, topk_idx, max_tokens=M, experts=E, cumulative=None, wait=None, use_fp8=True,
             round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False, topk_weights=None):
    return ll.dispatch(context, x, topk_idx, max_tokens, experts, cumulative, wait, use_fp8, round_scale, use_ue8m0,
                       async_finish, return_recv_hook, topk_weights)


def combine(context, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False,
            return_recv_hook=False, out=None, wait=None):
    return ll.combine(context, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                      return_recv_hook, out, wait)


def expert_rows(context, hidden=H, experts=E, max_tokens=M):
    return torch.zeros(experts // context.num_ranks, max_tokens * context.num_ranks, hidden, dtype=torch.bfloat16,
                       device=context.device)
