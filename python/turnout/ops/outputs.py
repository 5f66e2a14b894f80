"""Output tensors of the normal ops, several in one call:
``empty(device, code, rows, cols, code, rows, cols, ...)`` returns a tuple of
new tensors on ``device`` (a ``torch.device``; the ops pass their buffer's),
of element type ``code`` (one of the constants below) and shape
``(rows, cols)``, or ``(rows,)`` where ``cols`` is -1.
``empty_packed(device, separate, code, rows, cols, ...)`` makes the same
tensors; those after the first ``separate`` share one allocation where the
native module makes them (each at a 128-byte boundary): an allocation and
its free cost about 3 us of host time on CUDA, so an op's small outputs
come in one.

Where ``turnout._torch_ext`` can be used (``turnout.torch_ext``) it makes
them in one call into torch's C++ allocator: a tensor made from Python costs
its argument parsing and dispatch on top (about 1 us of host time a tensor).
Elsewhere the same tensors come from ``new_empty`` of a tensor of each type
kept per device. Either way they are allocated as ``torch.empty`` allocates
them: on the device's current stream."""
import torch

from .. import torch_ext

BF16, FP8_E4M3, F32, I32, I64, BOOL, U8 = range(7)
TYPES = torch_ext.TYPES
CODES = {dtype: code for code, dtype in enumerate(TYPES)}


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


def empty_packed_from_python(device: torch.device, separate: int, *specs: int) -> tuple:
    """``empty_packed`` without the native module: each tensor its own
    allocation (a view made in Python costs what an allocation saves)."""
    return empty_from_python(device, *specs)


NATIVE = torch_ext.MODULE is not None
empty = torch_ext.MODULE.empty if NATIVE else empty_from_python
empty_packed = torch_ext.MODULE.empty_packed if NATIVE else empty_packed_from_python
