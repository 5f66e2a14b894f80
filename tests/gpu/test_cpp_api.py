"""The C++ API alone (TCP bootstrap, no Python in the ranks), run by rank 0."""
import os
import subprocess
from importlib import resources


def find_binary() -> str:
    path = os.environ.get("TURNOUT_GPU_CPP_TEST") or str(resources.files("turnout") / "bin" / "turnout_gpu_cpp_test")
    if not os.path.exists(path):
        raise AssertionError(f"C++ GPU test binary not found at {path}: build with TURNOUT_BUILD_TESTS=ON")
    return path


def test_cpp_api_on_all_gpus(ctx):
    if ctx.rank != 0:
        return
    from turnout.launch import free_port

    out = subprocess.run([find_binary(), str(ctx.world_size), str(free_port())], capture_output=True, text=True,
                         timeout=150)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert f"{ctx.world_size} passed, 0 failed" in out.stdout, out.stdout


test_cpp_api_on_all_gpus.timeout = 180
