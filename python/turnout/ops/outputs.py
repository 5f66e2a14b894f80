"""Output tensors of the normal ops, several in one call:
``empty(device, code, rows, cols, code, rows, cols, ...)`` returns a tuple of
new tensors on ``device`` (a ``torch.device``; the ops pass their buffer's),
of element type ``code`` (one of the constants below) and shape
``(rows, cols)``, or ``(rows,)`` where ``cols`` is -1.

Where the package was built against the torch it runs under, the native
module ``turnout._torch_outputs`` makes them in one call into torch's C++
allocator: a tensor made from Python costs its argument parsing and dispatch
on top (about 1 us of host time a tensor). Elsewhere, or with
``TURNOUT_TORCH_OUTPUTS=0``, the same tensors come from ``new_empty`` of a
tensor of each type kept per device. Either way they are allocated as
``torch.empty`` allocates them: on the device's current stream."""
import os

import torch

BF16, FP8_E4M3, F32, I32, I64, BOOL, U8 = range(7)
TYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64, torch.bool, torch.uint8)
CODES = {dtype: code for code, dtype in enumerate(TYPES)}


def _native_module():
    """turnout._torch_outputs where it was built against this torch, else None."""
    if os.environ.get("TURNOUT_TORCH_OUTPUTS", "1") == "0":
        return None
    try:
        from .._torch_outputs_build import torch_version
    except ImportError:
        return None
    if torch_version != torch.__version__:
        return None
    from .. import _torch_outputs
    if (_torch_outputs.BF16, _torch_outputs.FP8_E4M3, _torch_outputs.F32, _torch_outputs.I32, _torch_outputs.I64,
            _torch_outputs.BOOL, _torch_outputs.U8) != tuple(range(7)):
        raise ImportError("turnout._torch_outputs numbers its element types otherwise than turnout.ops.outputs")
    return _torch_outputs


# One empty tensor of each type per device: what new_empty is called on.
_templates = {}


def _templates_of(device: torch.device) -> tuple:
    templates = _templates.get(device)
    if templates is None:
        templates = _templates[device] = tuple(torch.empty(0, dtype=dtype, device=device) for dtype in TYPES)
    return templates


def empty_from_python(device: torch.device, *specs: int) -> tuple:
    """What the native module's ``empty`` does, with ``new_empty``."""
    if len(specs) % 3:
        raise TypeError("empty(device, (code, rows, cols) ...): wrong number of arguments")
    templates = _templates.get(device) or _templates_of(device)
    out = []
    for i in range(0, len(specs), 3):
        template, rows, cols = templates[specs[i]], specs[i + 1], specs[i + 2]
        out.append(template.new_empty(rows) if cols < 0 else template.new_empty(rows, cols))
    return tuple(out)


_native = _native_module()
NATIVE = _native is not None
empty = _native.empty if NATIVE else empty_from_python
