"""The GPU domains test's choice of jobs (tests/gpu/test_low_latency_domains.py):
by the run's ranks, and as the environment narrows it."""
from gpu_modules import load_gpu_module

domains = load_gpu_module("gpu_low_latency_domains", "test_low_latency_domains.py")


def shapes(jobs):
    return [(ranks, domain, nvlink) for ranks, domain, nvlink, _ in jobs]


def test_jobs_by_rank_count(monkeypatch):
    monkeypatch.delenv("TURNOUT_DOMAIN_TESTS", raising=False)
    monkeypatch.delenv("TURNOUT_DOMAIN_JOBS", raising=False)
    assert shapes(domains.configurations(4, 1)) == [(4, 2, True), (4, 1, True), (4, 4, False)]
    jobs = domains.configurations(4, 4)
    assert shapes(jobs) == [(4, 2, True), (4, 1, True), (4, 4, False), (8, 4, True), (8, 2, True)]
    assert jobs[0][3] == domains.TESTS and jobs[-1][3] == domains.SHORT_TESTS
    assert shapes(domains.configurations(8, 1))[-1] == (16, 8, True)
    assert domains.configurations(3, 1) == []


def test_environment_narrows_the_jobs(monkeypatch):
    monkeypatch.setenv("TURNOUT_DOMAIN_TESTS", "short")
    monkeypatch.setenv("TURNOUT_DOMAIN_JOBS", "4:2 4:4")
    jobs = domains.configurations(4, 1)
    assert shapes(jobs) == [(4, 2, True), (4, 4, False)]
    assert all(tests == domains.SHORT_TESTS for *_, tests in jobs)
