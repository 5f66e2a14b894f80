"""The GPU harness's host-side helpers (tests/gpu/harness.py), no GPU: a
rank's share of the host's cores for its torch thread pool."""
import pytest
import torch
from gpu_modules import load_gpu_module

harness = load_gpu_module("gpu_harness", "harness.py")


@pytest.fixture
def keep_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def test_each_rank_gets_its_share_of_the_cores(keep_threads, monkeypatch):
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 16)
    assert harness.share_cpu_cores(4) == 4 and torch.get_num_threads() == 4
    assert harness.share_cpu_cores(3) == 5 and torch.get_num_threads() == 5
    assert harness.share_cpu_cores(32) == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(harness.os, "cpu_count", lambda: None)
    assert harness.share_cpu_cores(2) == 1
