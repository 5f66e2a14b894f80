"""The GPU harness's host-side helpers (tests/gpu/harness.py), no GPU: a
rank's share of the host's cores for its torch thread pool, and HostTimes,
the seconds behind the domain jobs' TIME lines."""
import pytest
import torch
from gpu_modules import load_gpu_module

import turnout

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


def test_host_times_counts_every_call_and_puts_the_originals_back(monkeypatch):
    def refused(self, *args, **kwargs):
        raise ValueError("refused")

    # Stand-ins with no GPU behind them, wrapped as the real ones would be.
    monkeypatch.setattr(turnout.Buffer, "__init__", refused)
    monkeypatch.setattr(turnout.Buffer, "low_latency_dispatch", lambda self, *a, **k: ("out", a, k))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    before = {attr: turnout.Buffer.__dict__[attr] for attr, _ in harness.HostTimes.BUFFER_METHODS}
    sync = torch.cuda.synchronize
    buf = object.__new__(turnout.Buffer)
    with harness.HostTimes() as times:
        assert turnout.Buffer.low_latency_dispatch is not before["low_latency_dispatch"]
        with pytest.raises(ValueError, match="refused"):
            turnout.Buffer(None)  # a call that raises is counted and raises as before
        assert buf.low_latency_dispatch(1, k=2) == ("out", (1,), {"k": 2})
        buf.low_latency_dispatch(3)
        torch.cuda.synchronize()
    assert {attr: turnout.Buffer.__dict__[attr] for attr, _ in harness.HostTimes.BUFFER_METHODS} == before
    assert torch.cuda.synchronize is sync
    assert {label: calls for label, (calls, _) in times.times.items()} == \
        {"Buffer()": 1, "dispatch": 2, "synchronize": 1}
    assert all(seconds >= 0 for _, seconds in times.times.values())


def test_host_times_line_names_each_part_and_the_rest():
    times = harness.HostTimes()
    times.times = {"Buffer()": [1, 2.5], "dispatch": [80, 0.25], "synchronize": [160, 1.25]}
    line = times.line("mod::test", 10.0)
    assert line.startswith("TIME mod::test: 10.0 s: Buffer() 2.50 s (1), dispatch 0.25 s (80), "
                           "synchronize 1.25 s (160), rest 6.00 s; torch threads ")


class FakeGpu:
    """One GPU of 80 GiB, its free memory and nvidia-smi's answers given in turn."""

    def __init__(self, monkeypatch, *answers, free=()):
        from turnout.bench import gpu_processes

        self.answers, self.free = list(answers), list(free)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"uuid": "abc"}))
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda device: (self.free.pop(0) if self.free else 10 << 30, 80 << 30))
        monkeypatch.setattr(gpu_processes, "query", self.query)

    def query(self, own, gpus):
        assert gpus == ["abc"]
        return self.answers.pop(0)


def process(pid, mib):
    return {"pid": pid, "name": "p", "used_mib": mib, "gpu": "GPU-abc", "mps_server": False}


ME, PEER, SERVER = harness.os.getpid(), -2, -3


def test_memory_in_use_leaves_out_other_processes(monkeypatch):
    ranks = [process(ME, 300), process(PEER, 300)]
    FakeGpu(monkeypatch, ranks + [process(SERVER, 68)], ranks + [process(SERVER, 68)])
    assert harness.memory_in_use(0, {ME, PEER}) == ((70 << 30) - (68 << 20), frozenset({SERVER}))


def test_memory_in_use_asks_again_when_a_process_starts_meanwhile(monkeypatch):
    gpu = FakeGpu(monkeypatch, [process(ME, 300)], [process(ME, 300), process(SERVER, 68)],
                  [process(ME, 300), process(SERVER, 68)], [process(ME, 300), process(SERVER, 68)])
    assert harness.memory_in_use(0, {ME}) == ((70 << 30) - (68 << 20), frozenset({SERVER}))
    assert not gpu.answers


@pytest.mark.parametrize("answer", ["unknown (nvidia-smi not found)",
                                    [process(-5, 300)],  # this process not listed: another pid namespace
                                    [process(ME, 300), process(SERVER, None)]])
def test_memory_in_use_falls_back_to_the_whole_gpu(monkeypatch, answer):
    FakeGpu(monkeypatch, answer)
    assert harness.memory_in_use(0, {ME}) == (70 << 30, None)


def test_memory_in_use_gives_up_on_processes_that_keep_changing(monkeypatch):
    FakeGpu(monkeypatch, *[[process(ME, 300), process(SERVER, mib)] for mib in range(10)])
    assert harness.memory_in_use(0, {ME}) == (70 << 30, None)


class OneRank:
    """The context of a run of one rank, for memory_kept."""

    def all_gather(self, obj, group=None):
        return [obj]


@pytest.fixture
def no_gpu_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_memory_kept_runs_the_window_again_when_another_process_starts(monkeypatch, no_gpu_sync):
    quiet, busy = [process(ME, 300)], [process(ME, 300), process(SERVER, 66)]
    # First window: a server starts (71 MiB taken, 66 listed), a leak-free body; second window steady.
    FakeGpu(monkeypatch, quiet, quiet, busy, busy, busy, busy, busy, busy,
            free=[10 << 30, (10 << 30) - (71 << 20), (10 << 30) - (71 << 20), (10 << 30) - (71 << 20)])
    calls = []
    window = harness.memory_kept(OneRank(), None, {ME}, lambda: calls.append(1))
    assert len(calls) == 2 and window.kept == 0 and "left out (1 of them)" in window.note


def test_memory_kept_sees_a_leak_in_a_steady_window(monkeypatch, no_gpu_sync):
    busy = [process(ME, 300), process(SERVER, 66)]
    FakeGpu(monkeypatch, *[busy] * 4, free=[10 << 30, (10 << 30) - (5 << 20)])
    window = harness.memory_kept(OneRank(), None, {ME}, lambda: None)
    assert window.kept == 5 << 20 and window.before == (70 << 30) - (66 << 20)


def test_memory_kept_says_when_no_window_was_steady(monkeypatch, no_gpu_sync):
    FakeGpu(monkeypatch, *[[process(ME, 300)] + [process(-10 - i, 66) for i in range(w // 2)] for w in range(12)])
    window = harness.memory_kept(OneRank(), None, {ME}, lambda: None, tries=3)
    assert "each of 3 tries" in window.note and "started [-14], ended []" in window.note
