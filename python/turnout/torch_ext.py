"""``turnout._torch_ext``, the parts of the Python layer built against torch's
C++ API (its outputs in one call into torch's allocator; the common intranode
dispatch and combine and the low-latency combine, each in one call), where it
can be used: ``MODULE`` is the module, or None where it was not built (torch
was not importable at build time), was built against another torch than the
one running, or ``TURNOUT_TORCH_EXT=0`` turns it off. Every caller has a
pure-Python path for None."""
import os

import torch

from . import _C

#: Element type codes of ``_torch_ext.empty``, in the module's order.
TYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64, torch.bool, torch.uint8)
TYPE_NAMES = ("BF16", "FP8_E4M3", "F32", "I32", "I64", "BOOL", "U8")


def _load():
    if os.environ.get("TURNOUT_TORCH_EXT", "1") == "0":
        return None
    try:
        from ._torch_ext_build import torch_version
    except ImportError:
        return None
    if torch_version != torch.__version__:
        return None
    from . import _torch_ext

    if tuple(getattr(_torch_ext, name) for name in TYPE_NAMES) != tuple(range(len(TYPES))):
        raise ImportError("turnout._torch_ext numbers its element types otherwise than turnout.torch_ext")
    _torch_ext.set_intranode_entry(_C.Buffer.intranode_entry)
    _torch_ext.set_low_latency_entry(_C.Buffer.low_latency_entry)
    return _torch_ext


MODULE = _load()
