"""Internode normal mode across declared NVL domains (NVSHMEM; its P2P
transport on this machine, which has no NIC), against the host reference, in
jobs of their own (fresh processes: NVSHMEM is set up per process, with the
domain size declared in the environment). Configurations by the run's rank
count: 2 ranks as 2 domains of 1; 4 as 2 domains of 2 and 4 of 1; 8 as 2 of 4 and 4 of 2; and where
the run has a GPU per rank, twice its ranks (8 ranks on 4 GPUs); with 8 ranks,
16 as 2 domains of 8. Ranks that
share a GPU run under an MPS daemon of the job's own, their shares summing to
100. TURNOUT_DOMAIN_JOBS="4:2 8:4" keeps only the jobs of those ranks:domain
size; TURNOUT_DOMAIN_TESTS="shrink_masked" only those of TESTS. Each
configuration runs in one job process per shrink check (job_lists)."""
import os
import subprocess
import sys
from pathlib import Path

from test_nvshmem_window import find_library, smoke_env

TESTS = ("shrink_refused", "dispatch_and_combine", "cached_dispatch", "worst_tokens", "worst_tokens_in_graph",
         "megatron_and_torchtitan", "bad_input", "absent_rank", "shrink_masked", "shrink_worst_tokens",
         "shrink_stops_at_dispatch", "shrink_stops_before_combine")
# Each leaves NVSHMEM initialized in its job's processes (a rank is masked),
# so no later Buffer of that job can open it: one a job, last.
SHRINK_CHECKS = ("shrink_masked", "shrink_worst_tokens", "shrink_stops_at_dispatch", "shrink_stops_before_combine")


def job_lists(tests):
    """The checks of each job process a configuration runs: the others and
    the first shrink check in one, each further shrink check alone (a job
    process costs tens of seconds to start, so no more of them)."""
    shrink = [t for t in tests if t in SHRINK_CHECKS]
    first = [t for t in tests if t not in SHRINK_CHECKS] + shrink[:1]
    return [first] + [[t] for t in shrink[1:]]


def selected_tests():
    """TESTS, or those of them TURNOUT_DOMAIN_TESTS names, in TESTS' order."""
    keep = os.environ.get("TURNOUT_DOMAIN_TESTS")
    tests = [t for t in TESTS if t in keep.split()] if keep else list(TESTS)
    assert tests, f"TURNOUT_DOMAIN_TESTS={keep!r} names none of {TESTS}"
    return tests


def configurations(world_size: int, num_devices: int):
    """(ranks, domain size) of the jobs this run makes."""
    by_ranks = {2: [(2, 1)], 4: [(4, 2), (4, 1)], 8: [(8, 4), (8, 2)]}
    jobs = list(by_ranks.get(world_size, []))
    if world_size == num_devices and 2 * world_size in by_ranks:
        jobs += by_ranks[2 * world_size]
    if world_size == 8:
        # DeepEP's deployment shape: two full domains of 8.
        jobs.append((16, 8))
    keep = os.environ.get("TURNOUT_DOMAIN_JOBS")
    if keep:
        jobs = [job for job in jobs if f"{job[0]}:{job[1]}" in keep.split()]
    return jobs


def test_internode_across_domains(ctx):
    if not os.path.exists(find_library()):
        ctx.skip(f"turnout was built without NVSHMEM (no {find_library()}; pip install nvidia-nvshmem-cu13==3.4.5 "
                 "and rebuild)")
    jobs = configurations(ctx.world_size, ctx.num_devices)
    if not jobs:
        ctx.skip(f"no internode configuration for {ctx.world_size} ranks")
    if ctx.rank != 0:
        return
    script = Path(__file__).resolve().parent / "internode_domains_job.py"
    tests = selected_tests()
    for ranks, domain in jobs:
        env = smoke_env(ranks, ctx.num_devices)
        # The job starts an MPS daemon of its own where its ranks share GPUs.
        env = {k: v for k, v in env.items() if not k.startswith("CUDA_MPS_")}
        env["TURNOUT_NVL_DOMAIN_SIZE"] = str(domain)
        for checks in job_lists(tests):
            what = f"{ranks} ranks as {ranks // domain} domains of {domain}, job {' '.join(checks)}"
            out = subprocess.run([sys.executable, str(script), str(ranks), str(domain), *checks],
                                 capture_output=True, text=True, timeout=900, env=env)
            print(f"{what}:\n{out.stdout}", flush=True)
            assert out.returncode == 0, f"{what}: job exit {out.returncode}\n{out.stdout}\n{out.stderr[-6000:]}"
            # No check skips where job_lists put it: a skip is a failure too.
            missing = [t for t in checks if f"[rank 0] PASS {t} " not in out.stdout]
            assert not missing, f"{what}: no PASS from {missing}\n{out.stdout}"


# Up to 16 job processes (4 GPUs: four configurations of four each).
test_internode_across_domains.timeout = 3600
