"""scripts/low_latency_timeline.py --stamps: the reading of the kernels'
stamp lines (src/kernels/low_latency/stamps.cuh's format), on made-up lines
whose times are known."""
import os
import types

import pytest
from script_modules import load_script


@pytest.fixture(scope="module")
def timeline():
    return load_script("low_latency_timeline")


def line(block, start_ns, end_ns, cycles, call=7, phases=3, op="dispatch"):
    steps = " ".join(str(c) for c in cycles)
    return f"turnout-stamps {op} 0 {call} {block} {phases} {start_ns} {end_ns} {steps}"


def test_steps_from_the_block_start_and_the_kernel_start(timeline):
    # 2 cycles a nanosecond: block 0 starts at 1000 ns and ends 10 us later
    # (20000 cycles); block 1 starts 500 ns after it, runs 8 us, skips step 7.
    n = timeline.NUM_STEPS - 1
    b0 = [2000 * (k + 1) for k in range(n - 1)] + [20000]
    b1 = [1000 * (k + 1) for k in range(n - 1)] + [16000]
    b1[6] = -1
    out = timeline.block_steps([line(0, 1000, 11000, b0), line(1, 1500, 9500, b1)])
    assert list(out) == [(7, 3)]
    launch = out[(7, 3)]
    assert launch["blocks"] == 2
    assert launch["span_us"] == pytest.approx(10.0)
    own, kernel = launch["steps"][1]
    assert own == pytest.approx([1.0, 0.5])
    assert kernel == pytest.approx([1.0, 1.0])
    own, kernel = launch["steps"][7]
    assert own == pytest.approx([7.0])  # block 1 did not reach it
    assert kernel == pytest.approx([7.0])
    own, kernel = launch["steps"][n]
    assert own == pytest.approx([10.0, 8.0])
    assert kernel == pytest.approx([10.0, 8.5])


def test_other_lines_and_launches_apart(timeline):
    n = timeline.NUM_STEPS - 1
    cycles = [1000] * (n - 1) + [8000]
    lines = [line(0, 0, 4000, cycles, call=1, phases=1), line(0, 5000, 9000, cycles, call=1, phases=2),
             line(0, 0, 4000, cycles, op="combine"), "turnout-stamps dispatch 0 1 0 3 0 4000 1 2 3"]
    out = timeline.block_steps(lines)
    assert sorted(out) == [(1, 1), (1, 2)]
    assert out[(1, 2)]["steps"][n][0] == pytest.approx([4.0])
    assert list(timeline.block_steps(lines, "combine")) == [(7, 3)]


def test_the_lines_printed_during_the_calls_are_read(timeline, monkeypatch, capfd):
    # A stand-in Setup whose calls write stamp lines to fd 1, as device printf
    # does: the warm-up calls' lines are dropped (and kept off the script's
    # output), the timed calls' read.
    n = timeline.NUM_STEPS - 1

    class Setup:
        def __init__(self, *args, **kwargs):
            self.buffer = types.SimpleNamespace(check_errors=lambda: None)
            self.calls = 0

        def aligned_start(self):
            pass

    def builder(op):
        def build(s):
            def call():
                s.calls += 1
                os.write(1, (line(0, 0, 4000, [100] * (n - 1) + [8000], call=s.calls, op=op) + "\n").encode())
            return call
        return build

    monkeypatch.setattr(timeline.bench, "Setup", Setup)
    stamped = [("d", "dispatch", builder("dispatch")), ("c", "combine", builder("combine"))]
    monkeypatch.setattr(timeline, "STAMPED", stamped)
    monkeypatch.setattr(timeline.torch.cuda, "synchronize", lambda: None)
    out = timeline.measure_stamps(0, 1, 8, 128, 2)
    assert sorted(out["d"]) == [(4, 3), (5, 3)]
    assert sorted(out["c"]) == [(9, 3), (10, 3)]
    assert "turnout-stamps" not in capfd.readouterr().out
