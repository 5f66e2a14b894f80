"""The NVSHMEM transport's window and device path (turnout_nvshmem_smoke: TCP bootstrap, no Python in the ranks),
run by rank 0 with the run's rank count; skipped where turnout was built without NVSHMEM."""
import os
import subprocess
from importlib import resources


def find_library() -> str:
    return os.environ.get("TURNOUT_NVSHMEM_LIB") or str(resources.files("turnout") / "libturnout_nvshmem.so")


def find_binary() -> str:
    return os.environ.get("TURNOUT_NVSHMEM_SMOKE") or str(resources.files("turnout") / "bin" / "turnout_nvshmem_smoke")


def smoke_env(world_size: int, num_devices: int) -> dict:
    from turnout.gpu_sharing import find_mps_control, ranks_per_device

    env = dict(os.environ,
               # The binary sits in turnout/bin, the library one folder up.
               TURNOUT_NVSHMEM_LIB=find_library(),
               # No NIC on the test machines: every PE is on this host.
               NVSHMEM_REMOTE_TRANSPORT="none")
    most = max(ranks_per_device(world_size, num_devices))
    if most > 1:
        # NVSHMEM's full support for PEs sharing a GPU needs their MPS shares to sum to at most 100.
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // most)
        # NVSHMEM asks nvidia-cuda-mps-control on PATH whether MPS runs.
        control = find_mps_control()
        if control:
            env["PATH"] = os.path.dirname(control) + os.pathsep + env.get("PATH", "")
    return env


def test_nvshmem_window_on_all_gpus(ctx):
    if not os.path.exists(find_library()):
        ctx.skip(f"turnout was built without NVSHMEM (no {find_library()}; pip install nvidia-nvshmem-cu13==3.4.5 "
                 "and rebuild)")
    if ctx.shares_gpu and not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        ctx.skip("ranks share a GPU and no MPS daemon serves them: NVSHMEM then supports only some of its calls")
    if ctx.rank != 0:
        return
    from turnout.launch import free_port

    binary = find_binary()
    assert os.path.exists(binary), f"NVSHMEM smoke binary not found at {binary}: build with TURNOUT_BUILD_TESTS=ON"
    out = subprocess.run([binary, str(ctx.world_size), str(free_port()), "120"], capture_output=True, text=True,
                         timeout=150, env=smoke_env(ctx.world_size, ctx.num_devices))
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert f"{ctx.world_size} passed, 0 failed" in out.stdout, out.stdout


test_nvshmem_window_on_all_gpus.timeout = 180
