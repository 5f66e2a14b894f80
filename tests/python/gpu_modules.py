"""Loads a module of tests/gpu for a CPU test, under a name of its own and with
tests/gpu on the path only while it loads (tests/gpu has modules named like
this folder's, test_low_latency.py among them)."""
import importlib.util
import sys
from pathlib import Path

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"


def load_gpu_module(name: str, filename: str):
    spec = importlib.util.spec_from_file_location(name, GPU_TESTS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(GPU_TESTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(GPU_TESTS))
    return module
