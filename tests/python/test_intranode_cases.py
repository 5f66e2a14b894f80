"""The GPU tests' intranode inputs and references (tests/gpu/intranode_cases.py),
checked on the CPU: the combine reference that makes only the rows holding a
rank's tokens gives the C++ reference's sums over every rank's whole input,
bit for bit, and no two rows of a rank's combine input are equal."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"


def load_cases():
    """tests/gpu/intranode_cases.py under a name of its own, with tests/gpu on
    the path only while it loads."""
    spec = importlib.util.spec_from_file_location("gpu_intranode_cases", GPU_TESTS / "intranode_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(GPU_TESTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(GPU_TESTS))
    return module


ic = load_cases()
ref = pytest.importorskip("turnout_reference")


def full_reference_combine(case, n, refs, rank):
    """The C++ reference over every rank's whole combine input."""
    xs, ws, b0, b1 = [], [], [], []
    for r in range(n):
        x, biases = ic.combine_inputs(case, n, r, refs[r].num_recv, with_biases=r == rank)
        xs.append(x.view(torch.int16).numpy().view(np.uint16))
        ws.append(refs[r].recv_topk_weights if case.topk else None)
        b0.append(biases[0].view(torch.int16).numpy().view(np.uint16) if len(biases) > 0 else None)
        b1.append(biases[1].view(torch.int16).numpy().view(np.uint16) if len(biases) > 1 else None)
    return ref.normal_combine(xs, ws, b0, b1, refs, case.hidden, case.topk, only_rank=rank)[rank]


@pytest.mark.parametrize("case,n", [
    (ic.Case("uniform", 96, 256, 8, 48, biases=2), 3),
    (ic.Case("holes", 64, 128, 6, 16, biases=1, empty_rank=1), 4),
    (ic.Case("one_rank", 50, 512, 4, 16, fp8=True), 2),
    (ic.Case("uniform", 40, 128, 0, 8), 2),
])
def test_combine_reference_of_one_ranks_rows_matches_the_full_reference(case, n):
    inputs = [ic.inputs_of(case, n, r) for r in range(n)]
    for rank in range(n):
        refs = ic.reference_dispatch(case, n, inputs, only_rank=rank)
        got_x, got_w = ic.reference_combine(case, n, refs, rank)
        want_x, want_w = full_reference_combine(case, n, refs, rank)
        assert got_x.shape == want_x.shape == (case.tokens_of(rank), case.hidden)
        np.testing.assert_array_equal(got_x, want_x)
        if case.topk:
            np.testing.assert_array_equal(got_w, want_w)
        assert np.abs(got_x).sum() > 0 or case.tokens_of(rank) == 0


def test_combine_rows_of_a_rank_are_distinct_and_repeatable():
    case = ic.Case("uniform", 64, 256, 8, 32)
    rows = ic.combine_rows(case, 4, 1, np.arange(4096))
    assert len({row.tobytes() for row in rows}) == len(rows)
    np.testing.assert_array_equal(ic.combine_rows(case, 4, 1, np.array([7, 4095])), rows[[7, 4095]])
    # Another rank's pool: other rows at the same indices.
    assert not np.array_equal(ic.combine_rows(case, 4, 2, np.arange(8)), rows[:8])
