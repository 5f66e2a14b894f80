"""The GPU suite's runner (tests/gpu/run.py) reads its ranks' reports through
one thread per rank, so the reports of different ranks arrive in any order.
Driven here with made-up reports, no GPU or worker process."""
import queue
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import run  # noqa: E402  (tests/gpu/run.py)

TESTS = [("mod", "test_a", 5.0), ("mod", "test_b", 5.0), ("mod", "test_c", 5.0)]


class Placement:
    daemon = None


def start(rank, test):
    return rank, {"event": "start", "test": test}


def end(rank, test, **extra):
    return rank, dict({"event": "end", "test": test, "ok": True, "seconds": 0.0, "checks": 1}, **extra)


def exit_(rank, code=0):
    return rank, {"event": "exit", "code": code}


def results(monkeypatch, reports, tests=TESTS, world_size=2):
    def launch(world_size, tests_arg, start_index, placement):
        events = queue.Queue()
        for item in reports:
            events.put(item)
        return [], events

    monkeypatch.setattr(run, "launch", launch)
    return [(name, status, message) for name, status, _, message in run.run_tests(tests, world_size, Placement())]


def test_a_rank_ahead_by_two_tests_is_held_back_not_lost(monkeypatch):
    # Rank 1's reader lags: rank 0's reports of tests b and c arrive before
    # rank 1's report of test a ends.
    reports = [start(0, 0), end(0, 0), start(0, 1), end(0, 1), start(0, 2), end(0, 2),
               start(1, 0), end(1, 0), start(1, 1), end(1, 1), start(1, 2), end(1, 2), exit_(0), exit_(1)]
    got = results(monkeypatch, reports)
    assert [(name, status) for name, status, _ in got] == [
        ("mod::test_a", "PASS"), ("mod::test_b", "PASS"), ("mod::test_c", "PASS")], got


def test_a_skip_reported_early_still_counts(monkeypatch):
    reports = [start(1, 0), end(1, 0), start(1, 1), end(1, 1, skipped="no second GPU"), start(0, 0), end(0, 0),
               start(0, 1), end(0, 1, skipped="no second GPU"), start(0, 2), end(0, 2), start(1, 2), end(1, 2)]
    got = results(monkeypatch, reports)
    assert [status for _, status, _ in got] == ["PASS", "SKIP", "PASS"], got
    assert got[1][2] == "no second GPU"


def test_an_exit_names_the_rank_and_its_last_report(monkeypatch):
    reports = [start(0, 0), start(1, 0), end(0, 0), exit_(1, code=0)]
    got = results(monkeypatch, reports, tests=TESTS[:1])
    (name, status, message), = got
    assert status == "FAIL"
    assert "rank 1 exited with code 0" in message and "start of test 0" in message, message


@pytest.mark.parametrize("checks, status", [(0, "FAIL"), (3, "PASS")])
def test_a_test_whose_ranks_checked_nothing_fails(monkeypatch, checks, status):
    reports = [start(0, 0), start(1, 0), end(0, 0, checks=0), end(1, 0, checks=checks)]
    (_, got, message), = results(monkeypatch, reports, tests=TESTS[:1])
    assert got == status, message
