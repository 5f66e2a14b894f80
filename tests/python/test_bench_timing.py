"""The bench's back-to-back timing (turnout.bench.timing.time_back_to_back)
with a stand-in clock for CUDA events: no GPU."""
import torch

from turnout.bench import timing


class Clock:
    """Each call of the timed function moves the time by its cost in ms."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.synced = 0


def fake_cuda(monkeypatch, clock: Clock) -> None:
    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            self.at = clock.now_ms

        def synchronize(self) -> None:
            clock.synced += 1

        def elapsed_time(self, end: "Event") -> float:
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: setattr(clock, "synced", clock.synced + 1))


def test_back_to_back_divides_the_timed_calls_only(monkeypatch):
    clock = Clock()
    fake_cuda(monkeypatch, clock)
    costs = iter([100.0] * 7 + [0.002 * (i + 1) for i in range(4)])

    def call() -> None:
        clock.now_ms += next(costs)

    us = timing.time_back_to_back(call, calls=4, warmup=7)
    # The warm-up calls (100 ms each) fall outside the events; the four timed
    # ones cost 2 + 4 + 6 + 8 us.
    assert abs(us - 5.0) < 1e-9, us
    assert next(costs, None) is None, "every warm-up and timed call ran once"
    assert clock.synced >= 2, "the warm-up is synced before the start event, and the end event waited for"
