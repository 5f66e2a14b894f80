"""EventOverlap: an optional CUDA event with the tensors that must outlive it;
EventHandle: DeepEP's event recorded where it is made.

An EventOverlap's event is a ``torch.cuda.Event`` (the normal-mode ops,
EventHandle, ``Buffer.capture``) or, from a low-latency op with
``async_finish``, a ``turnout._C.CommEvent``: one of the buffer's reused
events, which waits on a raw stream handle (``wait(stream)``, ``query()``)."""
from typing import Any, Optional, Tuple

import torch

# torch.cuda.current_stream() builds a Python object each call (microseconds);
# the raw getters return its handle.
_raw_stream_getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _current_stream_handle(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# The handle of device_index's current stream. Chosen once: a wrapper would
# cost a Python call per op.
current_raw_stream = _raw_stream_getter if _raw_stream_getter is not None else _current_stream_handle


def current_stream_handle() -> int:
    """The handle of the current CUDA stream of the current device."""
    return current_raw_stream(_current_device())


class EventHandle(torch.cuda.Event):
    """DeepEP's ``EventHandle``: a CUDA event recorded on the current stream when
    it is made (``EventOverlap(EventHandle())`` marks "everything issued so
    far"). It is a ``torch.cuda.Event``, so every op takes it where it takes one."""

    def __init__(self) -> None:
        self.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event."""
        torch.cuda.current_stream().wait_event(self)


class EventOverlap:
    """Returned by every op. With ``async_finish=True`` it holds the event the op
    recorded on the communication stream; otherwise ``event`` is None.

    Used as a context manager, leaving the block makes the current stream wait
    for the event (a no-op when there is none).
    """

    def __init__(self, event=None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        # Kept alive until the event is waited for: the op may still read them.
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the op."""
        event = self.event
        if event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: no event (the op was not async)")
        if isinstance(event, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(event)
        else:
            event.wait(current_stream_handle())

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if self.event is not None:
            self.current_stream_wait()
