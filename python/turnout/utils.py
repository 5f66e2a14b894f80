"""DeepEP's ``deep_ep.utils`` names, for code that imports them from there
(Megatron-LM and torchtitan build ``EventOverlap(EventHandle())``)."""
from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
