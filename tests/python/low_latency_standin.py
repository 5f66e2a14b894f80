"""A stand-in for the native low-latency buffer and its event ring, and the
OpContext and inputs that drive the Python layer
(python/turnout/ops/low_latency.py) over them on the CPU; and one for the
normal ops' native calls (NormalNativeStandIn). Each native call is checked
against the real binding's signature, so what passes here is what the
module would accept."""
import re
import types

import torch

from turnout import _C, event
from turnout.ops import low_latency as ll
from turnout.ops import streams
from turnout.ops.context import OpContext


def binding_parameters(method):
    """(name, type) of each parameter of a bound _C.Buffer method, from its
    signature (a default, " = 1", left off the type)."""
    doc = getattr(_C.Buffer, method).__doc__
    inside = re.match(rf"{method}\(self, (.*)\) -> ", doc).group(1)
    return [tuple(p.split(" = ")[0].split(": ")) for p in inside.split(", ")]


class FakeEvent:
    """A turnout._C.CommEvent: complete once a test sets ``done`` (a new record
    clears it); keeps the streams made to wait for it and counts its queries
    and host waits (which complete it)."""

    def __init__(self, index):
        self.index = index
        self.done = False
        self.waits = []
        self.queries = 0
        self.synchronized = 0

    def query(self):
        self.queries += 1
        return self.done

    def synchronize(self):
        self.synchronized += 1
        self.done = True

    def wait(self, stream):
        self.waits.append(stream)

    def __repr__(self):
        return f"FakeEvent({self.index})"


class FakeRing:
    """A turnout._C.EventRing: hands out its events in turn; keeps each
    (event, stream) it recorded."""

    def __init__(self, size=8):
        self.events = [FakeEvent(i) for i in range(size)]
        self.next = 0
        self.records = []
        # Whether the stream of the last record was capturing (tests set it).
        self.captured = False

    def record(self, stream):
        event = self.events[self.next]
        self.next = (self.next + 1) % len(self.events)
        event.done = False
        self.records.append((event, stream))
        return event


def conforms(value, kind):
    if kind.endswith(" | None"):
        return value is None or conforms(value, kind[:-len(" | None")])
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "turnout._C.EventRing":
        return isinstance(value, FakeRing)
    return f"{type(value).__module__}.{type(value).__qualname__}" == kind


class NativeStandIn:
    """Records each call by parameter name after checking it against the
    binding's signature: what the real module would accept. A launch given a
    ring records its next event on the launch's stream and returns it, as the
    module does; ``fail_next``, if set, is raised by the next launch once it
    has been recorded (a launch that raises after queueing its work)."""

    def __init__(self):
        self.calls = []
        self.destroyed = False
        self.fail_next = None

    def _record(self, method, args):
        params = binding_parameters(method)
        assert len(args) == len(params), f"{method}: {len(args)} arguments for {len(params)} parameters"
        for value, (name, kind) in zip(args, params):
            assert conforms(value, kind), f"{method}: {name}={value!r} is no {kind}"
        call = dict(zip((n for n, _ in params), args))
        self.calls.append((method, call))
        return call

    def _launch(self, method, args):
        call = self._record(method, args)
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        return None if call["ring"] is None else call["ring"].record(call["stream"])

    def low_latency_dispatch(self, *args):
        return self._launch("low_latency_dispatch", args)

    def low_latency_combine(self, *args):
        return self._launch("low_latency_combine", args)

    def clean_low_latency_buffer(self, *args):
        self._record("clean_low_latency_buffer", args)

    def join(self, waiter, waited):
        self.calls.append(("join", {"waiter": waiter, "waited": waited}))

    # What follow returns: False as the module does across a capture's boundary.
    follow_waits = True

    def follow(self, waiter, waited):
        self.calls.append(("follow", {"waiter": waiter, "waited": waited}))
        return self.follow_waits

    def destroy(self):
        self.destroyed = True
        self.calls.append(("destroy", {}))


class NormalNativeStandIn(NativeStandIn):
    """The normal ops' native calls (get_dispatch_layout, intranode dispatch
    and combine), recorded and failing (``fail_next``) as NativeStandIn's
    launches do. A dispatch that waits for its counts receives
    ``counts(call)``: by default what this rank sends, no token per expert."""

    # Where the counts place this rank's rows from itself, (begin, count).
    own_rows = (-1, 0)

    def counts(self, call):
        return (call["num_tokens"], [0] * call["num_experts"]) + self.own_rows

    def _call(self, method, args):
        call = self._record(method, args)
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        return call

    def get_dispatch_layout(self, *args):
        self._call("get_dispatch_layout", args)

    def dispatch_counts(self, *args):
        return self.counts(self._call("dispatch_counts", args))

    def dispatch(self, *args):
        self._call("dispatch", args)

    def dispatch_known_rows(self, *args):
        self._call("dispatch_known_rows", args)

    def combine(self, *args):
        self._call("combine", args)


CALLER_STREAM = 0x1000
COMM_STREAM = 0x2000


def patch_streams(monkeypatch):
    """Makes the ops (and EventOverlap) read the caller's stream from a list
    (tests change it there), which is not capturing; returns the list."""
    current = [CALLER_STREAM]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ll, "current_raw_stream", lambda device_index: current[0])
    monkeypatch.setattr(streams, "current_raw_stream", lambda device_index: current[0])
    monkeypatch.setattr(event, "current_stream_handle", lambda: current[0])
    return current


def make_context(num_ranks=4, low_latency_mode=True, device="cpu", device_index=0):
    """What an OpContext holds, on a device without a GPU."""
    context = types.SimpleNamespace(native=NativeStandIn(), device=torch.device(device), device_index=device_index,
                                    num_ranks=num_ranks, num_rdma_ranks=1, comm_stream=None, comm_raw=COMM_STREAM,
                                    handle_owner=object(), low_latency=None, tail=None)
    assert set(vars(context)) == set(OpContext.__slots__)
    if low_latency_mode:
        context.low_latency = ll.LowLatencyState(FakeRing())
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
