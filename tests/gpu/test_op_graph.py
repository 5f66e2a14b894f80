"""An op's graph on one GPU (tests/gpu/op_graph_test.cu), run by rank 0:
copies of many sizes and alignments through one graph set anew each call,
against memcmp, and the count of graphs it made."""
import os
import subprocess
from importlib import resources


def test_op_graph_copies_and_updates(ctx):
    if ctx.rank != 0:
        return
    path = os.environ.get("TURNOUT_GPU_OP_GRAPH_TEST") or str(
        resources.files("turnout") / "bin" / "turnout_gpu_op_graph_test")
    if not os.path.exists(path):
        raise AssertionError(f"op graph test binary not found at {path}: build with TURNOUT_BUILD_TESTS=ON")
    out = subprocess.run([path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert ", 0 failed" in out.stdout and "FAIL" not in out.stdout, out.stdout


test_op_graph_copies_and_updates.timeout = 150
