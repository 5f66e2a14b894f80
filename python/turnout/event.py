"""EventOverlap: an optional CUDA event with the tensors that must outlive it;
EventHandle: DeepEP's event recorded where it is made."""
from typing import Any, Optional, Tuple

import torch


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

    def __init__(self, event: Optional[torch.cuda.Event] = None,
                 extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        # Kept alive until the event is waited for: the op may still read them.
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the op."""
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: no event (the op was not async)")
        torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if self.event is not None:
            self.current_stream_wait()
