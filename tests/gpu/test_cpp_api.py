"""The C++ API alone (TCP bootstrap, no Python in the ranks), run by rank 0;
and its low-latency mode across NVL domains of one rank (NVSHMEM over P2P)."""
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


def test_cpp_api_low_latency_across_domains(ctx):
    from test_nvshmem_window import find_library, smoke_env

    if ctx.world_size < 2:
        ctx.skip(f"needs at least 2 ranks; this run has {ctx.world_size}")
    if not os.path.exists(find_library()):
        ctx.skip(f"turnout was built without NVSHMEM (no {find_library()})")
    if ctx.shares_gpu and not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        ctx.skip("ranks share a GPU and no MPS daemon serves them: NVSHMEM then supports only some of its calls")
    if ctx.rank != 0:
        return
    from turnout.launch import free_port

    # Domains of one rank: every peer is reached through NVSHMEM.
    out = subprocess.run([find_binary(), str(ctx.world_size), str(free_port()), "1"], capture_output=True, text=True,
                         timeout=150, env=smoke_env(ctx.world_size, ctx.num_devices))
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr[-6000:]}"
    assert f"{ctx.world_size} passed, 0 failed" in out.stdout, out.stdout


test_cpp_api_low_latency_across_domains.timeout = 180
