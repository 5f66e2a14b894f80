"""The normal ops' output tensors (turnout.ops.outputs): the native module
built against this torch and its new_empty fallback make the same tensors,
the module is used only under the torch it was built against, and dispatch
and combine hand the native calls the tensors they return."""
import os
import subprocess
import sys

import pytest
import torch
from test_normal_checks import FAST, FULL, Inputs, buffer_on, caller_stream  # noqa: F401 (autouse: stand-in streams)

from turnout import torch_ext
from turnout.ops import outputs

CPU = torch.device("cpu")
SPECS = [
    (outputs.BF16, 5, 64), (outputs.FP8_E4M3, 5, 64), (outputs.F32, 5, 2), (outputs.I32, 4, -1),
    (outputs.I64, 3, 8), (outputs.BOOL, 6, 4), (outputs.U8, 7, -1), (outputs.I32, 0, 4), (outputs.BF16, 0, -1),
]


def built_module():
    try:
        from turnout import _torch_ext, _torch_ext_build
    except ImportError:
        return None
    return _torch_ext, _torch_ext_build


def flat(specs):
    return [v for spec in specs for v in spec]


def test_the_module_built_against_this_torch_is_used():
    built = built_module()
    if built is None:
        pytest.skip("turnout._torch_ext was not built (torch was not importable at build time)")
    module, build = built
    assert build.torch_version == torch.__version__
    assert outputs.NATIVE and outputs.empty is module.empty


@pytest.mark.parametrize("make", ["native", "python"])
def test_empty_makes_each_tensor_of_its_type_and_shape_on_the_cpu(make):
    if make == "native" and not outputs.NATIVE:
        pytest.skip("turnout._torch_ext is not in use here")
    empty = outputs.empty if make == "native" else outputs.empty_from_python
    made = empty(CPU, *flat(SPECS))
    assert len(made) == len(SPECS)
    for tensor, (code, rows, cols) in zip(made, SPECS):
        assert tensor.dtype == outputs.TYPES[code]
        assert tuple(tensor.shape) == ((rows,) if cols < 0 else (rows, cols))
        assert tensor.device == torch.device("cpu") and tensor.is_contiguous()
    # Each call makes new storage: the first call's tensors are still alive.
    again = empty(CPU, *flat(SPECS))
    live = [t for t in made if t.numel()]
    assert not {t.data_ptr() for t in live} & {t.data_ptr() for t in again if t.numel()}


def assert_packed(alone, packed):
    """Each of ``alone`` has storage of its own; ``packed`` share one other
    storage, each from a 128-byte boundary of it, none overlapping another."""
    storages = [t.untyped_storage().data_ptr() for t in alone]
    shared = {t.untyped_storage().data_ptr() for t in packed}
    assert len(shared) == 1 and len(set(storages)) == len(storages) and not shared & set(storages)
    base = packed[0].untyped_storage()
    # (A tensor of no elements has no data pointer.)
    spans = sorted((t.data_ptr() - base.data_ptr(), t.numel() * t.element_size()) for t in packed if t.numel())
    for (start, size), (after, _) in zip(spans, spans[1:] + [(base.nbytes(), 0)]):
        assert start % 128 == 0 and start + size <= after


@pytest.mark.parametrize("separate", [0, 2, len(SPECS)])
def test_empty_packed_shares_one_allocation_after_the_separate_ones(separate):
    if not outputs.NATIVE:
        pytest.skip("turnout._torch_ext is not in use here")
    made = outputs.empty_packed(CPU, separate, *flat(SPECS))
    python_made = outputs.empty_packed_from_python(CPU, separate, *flat(SPECS))
    assert [(t.dtype, t.shape) for t in made] == [(t.dtype, t.shape) for t in python_made]
    assert all(t.is_contiguous() and t.device == CPU for t in made)
    if separate < len(SPECS):
        assert_packed(made[:separate], made[separate:])
    # Each tensor holds what is written to it after the others are written.
    for i, t in enumerate(made):
        t.view(torch.uint8).fill_(i + 1)
    for i, t in enumerate(made):
        assert bool((t.view(torch.uint8) == i + 1).all()), i


def test_the_native_empty_names_what_is_wrong():
    if not outputs.NATIVE:
        pytest.skip("turnout._torch_ext is not in use here")
    with pytest.raises(TypeError, match="wrong number of arguments"):
        outputs.empty(CPU, outputs.I32, 4)
    with pytest.raises(ValueError, match="code 7"):
        outputs.empty(CPU, 7, 4, -1)
    with pytest.raises(ValueError, match="rows -1"):
        outputs.empty(CPU, outputs.I32, -1, 4)
    with pytest.raises(TypeError):
        outputs.empty(CPU, outputs.I32, 4.0, -1)
    with pytest.raises(RuntimeError):
        outputs.empty(CPU, outputs.U8, 1 << 62, 1 << 10)
    with pytest.raises(TypeError, match="device must be a torch.device"):
        outputs.empty(-1, outputs.I32, 4, -1)
    with pytest.raises(ValueError, match="separate must be >= 0"):
        outputs.empty_packed(CPU, -1, outputs.I32, 4, -1)
    with pytest.raises(TypeError, match="empty_packed: wrong number of arguments"):
        outputs.empty_packed(CPU, 0, outputs.I32, 4)
    with pytest.raises(RuntimeError, match="fits 63 bits"):
        outputs.empty_packed(CPU, 0, outputs.U8, 1 << 62, 1 << 10)
    with pytest.raises(RuntimeError, match="over 63 bits"):
        outputs.empty_packed(CPU, 0, outputs.U8, 1 << 62, -1, outputs.U8, 1 << 62, -1)


def test_a_module_built_against_another_torch_or_turned_off_is_not_used(monkeypatch):
    if built_module() is None:
        pytest.skip("turnout._torch_ext was not built (torch was not importable at build time)")
    assert torch_ext._load() is not None
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert torch_ext._load() is None
    monkeypatch.undo()
    monkeypatch.setenv("TURNOUT_TORCH_EXT", "0")
    assert torch_ext._load() is None
    out = subprocess.run([sys.executable, "-c", "import turnout.ops.outputs as o; print(o.NATIVE)"],
                         capture_output=True, text=True, env={**os.environ, "TURNOUT_TORCH_EXT": "0"})
    assert out.stdout.strip() == "False", out.stderr


def call_pointers(buf, method):
    calls = [call for name, call in buf._context.native.calls if name == method]
    assert calls, f"no {method} call"
    return {v for v in calls[-1].values() if type(v) is int}


@pytest.mark.parametrize("device_index", [FAST, FULL], ids=["fast path", "full checks"])
@pytest.mark.parametrize("make", ["native", "python"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_dispatch_and_combine_return_the_tensors_they_hand_the_native_calls(device_index, make, fp8, monkeypatch):
    if make == "native" and not outputs.NATIVE:
        pytest.skip("turnout._torch_ext is not in use here")
    if make == "python":
        from turnout.ops import intranode
        monkeypatch.setattr(intranode, "_empty", outputs.empty_from_python)
        monkeypatch.setattr(intranode, "_empty_packed", outputs.empty_packed_from_python)
    buf = buffer_on(device_index)
    inputs = Inputs(buf)
    R, T, H = 4, inputs.x.shape[0], inputs.x.shape[1]
    K = inputs.topk_idx.shape[1]
    x = inputs.x
    if fp8:
        x = (inputs.x.float().to(torch.float8_e4m3fn), torch.rand(T, H // 128 or 1))
    for worst in (0, 9):
        recv_x, recv_idx, recv_weights, per_expert, handle, _ = inputs.dispatch(buf, x=x, num_worst_tokens=worst)
        rows = worst or T
        data = recv_x[0] if fp8 else recv_x
        assert data.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16) and tuple(data.shape) == (rows, H)
        assert recv_idx.dtype == torch.int64 and tuple(recv_idx.shape) == (rows, K)
        assert recv_weights.dtype == torch.float32 and tuple(recv_weights.shape) == (rows, K)
        rank_prefix, source_tokens, _, src_idx, _, _ = handle
        assert tuple(rank_prefix.shape) == (R, R) and tuple(source_tokens.shape) == (R,)
        assert tuple(src_idx.shape) == (rows,) and src_idx.dtype == torch.int32
        made = [data, recv_idx, recv_weights, rank_prefix, source_tokens, src_idx] + ([recv_x[1]] if fp8 else [])
        if fp8:
            assert recv_x[1].dtype == torch.float32 and tuple(recv_x[1].shape) == (rows, x[1].shape[1])
        given = call_pointers(buf, "dispatch_known_rows" if worst else "dispatch")
        assert {t.data_ptr() for t in made} <= given
        assert len({t.data_ptr() for t in made}) == len(made)
        if make == "native":  # (without num_worst_tokens the prefix sums come before the counts)
            alone, packed = [data] + ([recv_x[1]] if fp8 else []), [recv_idx, recv_weights, source_tokens, src_idx]
            (packed if worst else alone).append(rank_prefix)
            assert_packed(alone, packed)
        cached_x, *_ = buf.dispatch(x=x, handle=handle)
        cached = cached_x[0] if fp8 else cached_x
        assert tuple(cached.shape) == (rows, H) and cached.dtype == data.dtype
        assert cached.data_ptr() in call_pointers(buf, "dispatch_known_rows")
    for weights in (recv_weights, None):
        combined, combined_weights, _ = buf.combine(torch.zeros(rows, H, dtype=torch.bfloat16), handle,
                                                    topk_weights=weights)
        assert combined.dtype == torch.bfloat16 and tuple(combined.shape) == (T, H)
        given = call_pointers(buf, "combine")
        assert combined.data_ptr() in given
        if weights is None:
            assert combined_weights is None
        else:
            assert combined_weights.dtype == torch.float32 and tuple(combined_weights.shape) == (T, K)
            assert combined_weights.data_ptr() in given
