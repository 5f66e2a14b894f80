"""The internode domain job's list of checks (tests/gpu/internode_domains_job.py)
on the CPU: the runner and the job name the same checks, the four shrink checks
last (each leaves NVSHMEM initialized in its processes); the runner splits a
configuration's checks into job processes so that every shrink check runs, last
and alone of its kind; a shrink check skips where another one ran before it in
its job, and needs no opt-in; the stopped rank forwards for others."""
import itertools

import pytest
from gpu_modules import load_gpu_module

job = load_gpu_module("internode_domains_job_cpu", "internode_domains_job.py")
runner = load_gpu_module("test_internode_domains_cpu", "test_internode_domains.py")


class Skip(Exception):
    pass


class Ctx:
    world_size, rank = 4, 0

    def skip(self, reason):
        raise Skip(reason)


SHRINK_CHECKS = ("shrink_masked", "shrink_worst_tokens", "shrink_stops_at_dispatch", "shrink_stops_before_combine")


def test_the_runner_and_the_job_name_the_same_checks_the_shrink_ones_last():
    assert set(job.TESTS) == set(runner.TESTS) and len(job.TESTS) == len(runner.TESTS)
    assert tuple(job.TESTS)[-4:] == runner.TESTS[-4:] == SHRINK_CHECKS
    assert job.SHRINK_CHECKS == runner.SHRINK_CHECKS == SHRINK_CHECKS


def test_a_default_run_starts_a_job_per_shrink_check(monkeypatch):
    monkeypatch.delenv("TURNOUT_DOMAIN_TESTS", raising=False)
    others = [t for t in runner.TESTS if t not in SHRINK_CHECKS]
    assert runner.job_lists(runner.selected_tests()) == [
        others + ["shrink_masked"], ["shrink_worst_tokens"], ["shrink_stops_at_dispatch"],
        ["shrink_stops_before_combine"]]


@pytest.mark.parametrize("named,lists", [
    ("shrink_stops_before_combine", [["shrink_stops_before_combine"]]),
    ("shrink_stops_at_dispatch shrink_masked", [["shrink_masked"], ["shrink_stops_at_dispatch"]]),
    ("shrink_stops_at_dispatch absent_rank", [["absent_rank", "shrink_stops_at_dispatch"]]),
    ("shrink_worst_tokens", [["shrink_worst_tokens"]]),
    ("shrink_worst_tokens worst_tokens_in_graph shrink_masked",
     [["worst_tokens_in_graph", "shrink_masked"], ["shrink_worst_tokens"]]),
    ("shrink_refused bad_input", [["shrink_refused", "bad_input"]]),
])
def test_turnout_domain_tests_picks_the_checks_and_their_jobs(monkeypatch, named, lists):
    monkeypatch.setenv("TURNOUT_DOMAIN_TESTS", named)
    assert runner.job_lists(runner.selected_tests()) == lists


def test_turnout_domain_tests_must_name_a_check(monkeypatch):
    monkeypatch.setenv("TURNOUT_DOMAIN_TESTS", "shrink_opt_in")
    with pytest.raises(AssertionError, match="names none of"):
        runner.selected_tests()


def test_every_selection_runs_each_check_once_and_each_shrink_check_last_in_a_job_of_its_own():
    for size in range(1, len(runner.TESTS) + 1):
        for tests in itertools.combinations(runner.TESTS, size):
            lists = runner.job_lists(list(tests))
            assert [t for checks in lists for t in checks] == list(tests)
            assert all(checks for checks in lists)
            for checks in lists:
                shrink = [t for t in checks if t in SHRINK_CHECKS]
                assert len(shrink) <= 1 and (not shrink or checks[-1] == shrink[0]), checks
            assert len(lists) == max(1, sum(t in SHRINK_CHECKS for t in tests))


@pytest.mark.parametrize("name", SHRINK_CHECKS)
@pytest.mark.parametrize("before", SHRINK_CHECKS)
def test_a_shrink_check_skips_where_another_one_ran_in_its_job(monkeypatch, name, before):
    monkeypatch.setenv("TURNOUT_NVL_DOMAIN_SIZE", "2")
    monkeypatch.delenv("TURNOUT_EXPERIMENTAL_INTERNODE_SHRINK", raising=False)
    monkeypatch.setattr(job, "_nvshmem_left", [before])
    with pytest.raises(Skip, match=f"{before} left NVSHMEM initialized.*TURNOUT_DOMAIN_TESTS={name}"):
        job.TESTS[name](Ctx())


def test_the_first_shrink_check_of_a_job_records_itself(monkeypatch):
    monkeypatch.setattr(job, "_nvshmem_left", [])
    job.leave_nvshmem_initialized(Ctx(), "shrink_stops_at_dispatch")
    assert job._nvshmem_left == ["shrink_stops_at_dispatch"]
    with pytest.raises(Skip, match="shrink_stops_at_dispatch left NVSHMEM"):
        job.leave_nvshmem_initialized(Ctx(), "shrink_masked")


@pytest.mark.parametrize("before_combine", [False, True])
@pytest.mark.parametrize("n,d", [(2, 1), (4, 2), (4, 1), (8, 4), (8, 2), (16, 8)])
def test_the_stopped_rank_forwards_for_the_other_domains(monkeypatch, n, d, before_combine):
    monkeypatch.delenv("TURNOUT_SHRINK_STOPPED", raising=False)
    stopped, role = job.shrink_stopped_rank(n, d, before_combine=before_combine)
    assert stopped == 1 and role
    # Stopped before its combine, its forwarded partials are lost; at its dispatch a substitute forwards.
    assert ("lost" in role) == before_combine
    if d > 1:
        # Column 1 of domain 0: the forwarder of every other domain's column 1 into it.
        assert stopped // d == 0 and stopped % d == 1
    monkeypatch.setenv("TURNOUT_SHRINK_STOPPED", "3")
    assert job.shrink_stopped_rank(n, d, before_combine=before_combine)[0] == 3


def test_the_configurations_by_rank_count(monkeypatch):
    monkeypatch.delenv("TURNOUT_DOMAIN_JOBS", raising=False)
    assert runner.configurations(2, 1) == [(2, 1)]
    assert runner.configurations(2, 2) == [(2, 1), (4, 2), (4, 1)]
    assert runner.configurations(4, 1) == [(4, 2), (4, 1)]
    assert runner.configurations(4, 4) == [(4, 2), (4, 1), (8, 4), (8, 2)]
    assert runner.configurations(8, 1) == [(8, 4), (8, 2), (16, 8)]
    assert runner.configurations(3, 1) == []
    monkeypatch.setenv("TURNOUT_DOMAIN_JOBS", "2:1 8:2")
    assert runner.configurations(2, 2) == [(2, 1)]
