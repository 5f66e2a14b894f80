"""turnout: Mixture-of-Experts dispatch and combine over NVLink (and RDMA).

A drop-in for DeepEP's ``Buffer`` API: ``from turnout import Buffer``.
"""
import torch

from . import _C
from .buffer import Buffer, DispatchHandle
from .event import EventOverlap

Config = _C.Config

# The dtype of expert indices (``topk_idx``) every op takes.
topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "DispatchHandle", "EventOverlap", "topk_idx_t"]
