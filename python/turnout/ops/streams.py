"""Which stream an op runs on and what it waits for first.

A plain op (no previous_event, async_finish or allocate_on_comm_stream) runs
on the caller's stream, as low-latency mode's do; the others run on the
Buffer's communication stream: DeepEP's previous_event, async_finish and
allocate_on_comm_stream, and the way back when the op fails part way.

Every op of one Buffer shares its regions, so each waits for the one before
it, whatever stream that was issued on: ``context.tail`` is that stream. An op
issued on the same stream needs no wait; one on another stream joins it
first (``follow``), except across a CUDA-graph capture's boundary."""
from typing import Optional, Tuple

import torch

from ..checks import fail
from ..event import EventOverlap, current_raw_stream
from .context import OpContext, require_alive


def follow(context: OpContext, stream: int) -> None:
    """Before an op issued on ``stream`` (the caller's current stream): waits
    for the buffer's last op, which was issued on another stream, and makes
    ``stream`` the tail. The callers test ``context.tail != stream`` first,
    the common case inline.

    Across a CUDA-graph capture's boundary the native call skips the wait (a
    capture may not wait on work outside it). The tail stays the eager one
    then: an op being captured does not become it, so the next eager op
    still waits for the last eager one, while an eager op after a captured
    one does. What orders a graph's replay against eager ops of the buffer is
    the stream it is launched on, as in DeepEP."""
    tail = context.tail
    if tail is not None and not context.native.follow(stream, tail) and torch.cuda.is_current_stream_capturing():
        return
    context.tail = stream


def normal_op_streams(context: OpContext, op: str, previous_event: Optional[EventOverlap], async_finish: bool,
                      allocate_on_comm_stream: bool) -> Tuple[Optional["OpStreams"], Optional[int], Optional[int], int]:
    """A normal op's ``(streams, wait_for, join_to, stream)``: a plain op (no
    previous_event, async_finish or allocate_on_comm_stream) makes no
    OpStreams and runs on the caller's stream, after the buffer's last op,
    with no joins; the others make an OpStreams and run on the communication
    stream."""
    if previous_event is None and not async_finish and not allocate_on_comm_stream:
        native = context.native
        if native.destroyed:
            require_alive(native, op)
        stream = current_raw_stream(context.device_index)
        if context.tail != stream:
            follow(context, stream)
        return None, None, None, stream
    streams = OpStreams(context, op, previous_event, async_finish, allocate_on_comm_stream)
    return streams, streams.wait_for, streams.join_to, context.comm_raw


def unwind(context: OpContext, streams: Optional["OpStreams"]) -> None:
    """After an op failed part way: the streams as they were before it.
    ``streams`` is the op's OpStreams, or None for a plain op, which queued
    its work on the caller's stream alone: nothing to put back."""
    if streams is not None:
        streams.unwind()


class OpStreams:
    """The streams of one op: a context manager around its allocations and
    native calls, then ``finish`` for its EventOverlap.

    The communication stream waits for the caller's stream before the op:
    the op's first native call does it (``wait_for``; None when
    previous_event was waited for instead). It also waits for the stream of
    the buffer's last op (``follow``) unless that is one of those two; with
    previous_event that may be the caller's stream, which it then waits for
    whole, not only up to the event. Without async_finish the caller's
    stream waits for the op after it: the op's last native call does it
    (``join_to``; None with async_finish, whose event does it). With
    allocate_on_comm_stream torch allocates on the communication stream inside
    the block. An error inside the block puts the streams back as they were."""

    __slots__ = ("_context", "_compute_raw", "_compute", "_async_finish", "_eager_tail", "wait_for", "join_to")

    def __init__(self, context: OpContext, op: str, previous_event: Optional[EventOverlap], async_finish: bool,
                 allocate_on_comm_stream: bool) -> None:
        require_alive(context.native, op)
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            fail(op, "previous_event", "an EventOverlap or None", type(previous_event).__name__, TypeError)
        if allocate_on_comm_stream and not (previous_event is not None and async_finish):
            fail(op, "allocate_on_comm_stream", "used with previous_event and async_finish=True",
                 f"previous_event={previous_event}, async_finish={async_finish}")
        compute_raw = current_raw_stream(context.device_index)
        self.wait_for = compute_raw
        if previous_event is not None and previous_event.event is not None:
            event = previous_event.event
            if isinstance(event, torch.cuda.Event):
                context.comm_stream.wait_event(event)
            else:
                event.wait(context.comm_raw)  # a low-latency op's CommEvent
            self.wait_for = None
        # The caller's stream object: only allocate_on_comm_stream needs it back.
        self._compute = None
        if allocate_on_comm_stream:
            self._compute = torch.cuda.current_stream()
            torch.cuda.set_stream(context.comm_stream)
        comm_raw = context.comm_raw
        tail = context.tail
        if tail is not None and tail != comm_raw and (tail != compute_raw or self.wait_for is None):
            context.native.follow(comm_raw, tail)
        # Without async_finish the caller's stream waits for the op after it (or unwind does).
        self._eager_tail = tail
        context.tail = comm_raw if async_finish else compute_raw
        self._context = context
        self._compute_raw = compute_raw
        self._async_finish = async_finish
        self.join_to = None if async_finish else compute_raw

    def __enter__(self) -> "OpStreams":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            self.unwind()

    def unwind(self) -> None:
        """After an error inside the block: the streams as they were before the
        op, and the caller's stream the tail: it waits for the communication
        stream here, and it or the communication stream waited for the old
        tail (an op that failed before its first native call never made the
        communication stream wait for the caller's)."""
        if self._compute is not None:
            torch.cuda.set_stream(self._compute)
        # The caller's stream may not have been joined back by the op's last call.
        self._context.native.join(self._compute_raw, self._context.comm_raw)
        self._context.tail = self._compute_raw

    def finish(self, tensors: Tuple[Optional[torch.Tensor], ...]) -> EventOverlap:
        """The op's EventOverlap, after its launches; ``tensors``: its inputs and outputs."""
        compute = self._compute
        if compute is not None:
            torch.cuda.set_stream(compute)
        if torch.cuda.is_current_stream_capturing():
            # A captured op is no step of the eager order: the tail stays the eager one.
            self._context.tail = self._eager_tail
        if not self._async_finish:
            return EventOverlap()
        comm_stream = self._context.comm_stream
        event = torch.cuda.Event()
        event.record(comm_stream)
        # Inputs and outputs live on both streams until the op is done.
        for t in tensors:
            if t is not None:
                t.record_stream(comm_stream)
                if compute is not None:
                    t.record_stream(compute)
        return EventOverlap(event, tensors)
