"""turnout: Mixture-of-Experts dispatch and combine over NVLink (and RDMA).

A drop-in for DeepEP's ``Buffer`` API: ``from turnout import Buffer``.
"""
# Before _C: torch loads the CUDA runtime that _C links against.
import torch

from . import _C
from .buffer import Buffer
from .checks import TOPK_IDX_DTYPE
from .event import EventOverlap
from .ops.handle import DispatchHandle
from .ops.internode_handle import InternodeHandle
from .ops.low_latency import LowLatencyHandle

Config = _C.Config

# The dtype of expert indices (``topk_idx``) every op takes.
topk_idx_t: torch.dtype = TOPK_IDX_DTYPE

__all__ = ["Buffer", "Config", "DispatchHandle", "EventOverlap", "InternodeHandle", "LowLatencyHandle", "topk_idx_t"]
