"""Low-latency mode across NVL domains (NVSHMEM; its P2P transport on this
machine, which has no NIC), against the host reference: the suite's
low-latency tests, a rank that never calls, a wrong declared domain size, and
shrink mode with a rank that stops calling,
in jobs of their own (fresh processes: NVSHMEM is set up per process, with the
domain size declared in the environment). Configurations by the run's rank
count: 2 ranks as 2 domains of 1; 4 as 2 of 2, 4 of 1, and one domain with
NVLink kept out of low-latency mode; 8 as 2 of 4 and 4 of 2; and where the run
has a GPU per rank, twice its ranks (8 ranks on 4 GPUs as 2 of 4 and 4 of 2,
a shorter list of tests); and with 8 ranks, 16 as 2 domains of 8.
TURNOUT_DOMAIN_TESTS=short gives every job the shorter list, and
TURNOUT_DOMAIN_JOBS="4:2 8:4" keeps only the jobs of those ranks:domain size
(runs that must fit a time limit). TURNOUT_JOB_TIMING=1 adds every rank's
TIME line per test: where its host time went (low_latency_domains_job.py)."""
import os
import subprocess
import sys
from pathlib import Path

from test_nvshmem_window import find_library, smoke_env

TESTS = (
    "test_low_latency::test_dispatch_and_combine_match_reference",
    "test_low_latency::test_combine_options",
    "test_low_latency::test_same_inputs_give_same_bits",
    "test_low_latency_graph::test_dispatch_and_combine_in_cuda_graph",
    "test_low_latency_graph::test_hooked_dispatch_and_combine_in_cuda_graph",
    "test_low_latency_graph::test_receive_hooks",
    "test_low_latency_errors::test_expert_ids_out_of_range_fail_on_every_rank",
    "absent_rank",
    "wrong_domain_size",
    "shrink_lost_rank",  # last: it leaves NVSHMEM initialized in every process
)


# Where a job's ranks share GPUs on a run with a GPU per rank: the tests that
# reach every path (formats, weights, graphs, hooks, timeouts) in less time.
SHORT_TESTS = (
    "test_low_latency::test_combine_options",
    "test_low_latency::test_same_inputs_give_same_bits",
    "test_low_latency_graph::test_hooked_dispatch_and_combine_in_cuda_graph",
    "absent_rank",
    "wrong_domain_size",
    "shrink_lost_rank",  # last: it leaves NVSHMEM initialized in every process
)


def configurations(world_size: int, num_devices: int):
    """(ranks, domain size, NVLink for low-latency mode, tests) of the jobs this run makes."""
    by_ranks = {2: [(2, 1, True)], 4: [(4, 2, True), (4, 1, True), (4, 4, False)], 8: [(8, 4, True), (8, 2, True)]}
    full = SHORT_TESTS if os.environ.get("TURNOUT_DOMAIN_TESTS") == "short" else TESTS
    jobs = [job + (full,) for job in by_ranks.get(world_size, [])]
    if world_size == num_devices and 2 * world_size in by_ranks:
        jobs += [job + (SHORT_TESTS,) for job in by_ranks[2 * world_size]]
    if world_size == 8:
        # Past one NVL domain's 8 ranks: 16 as two full domains.
        jobs.append((16, 8, True, SHORT_TESTS))
    keep = os.environ.get("TURNOUT_DOMAIN_JOBS")
    if keep:
        jobs = [job for job in jobs if f"{job[0]}:{job[1]}" in keep.split()]
    return jobs


def test_low_latency_across_domains(ctx):
    if not os.path.exists(find_library()):
        ctx.skip(f"turnout was built without NVSHMEM (no {find_library()}; pip install nvidia-nvshmem-cu13==3.4.5 "
                 "and rebuild)")
    jobs = configurations(ctx.world_size, ctx.num_devices)
    if not jobs:
        ctx.skip(f"no domain configuration for {ctx.world_size} ranks")
    if ctx.rank != 0:
        return
    script = Path(__file__).resolve().parent / "low_latency_domains_job.py"
    for ranks, domain, nvlink, tests in jobs:
        env = smoke_env(ranks, ctx.num_devices)
        # The job starts an MPS daemon of its own where its ranks share GPUs.
        env = {k: v for k, v in env.items() if not k.startswith("CUDA_MPS_")}
        env["TURNOUT_NVL_DOMAIN_SIZE"] = str(domain)
        what = f"{ranks} ranks as {ranks // domain} domains of {domain}" + ("" if nvlink else ", NVLink off")
        out = subprocess.run([sys.executable, str(script), str(ranks), str(domain), str(int(nvlink)), *tests],
                             capture_output=True, text=True, timeout=900, env=env)
        print(f"{what}:\n{out.stdout}", flush=True)
        assert out.returncode == 0, f"{what}: job exit {out.returncode}\n{out.stdout}\n{out.stderr[-6000:]}"
        # Every test reports on rank 0; a skip names its reason above.
        done = out.stdout.count("[rank 0] PASS") + out.stdout.count("[rank 0] SKIP")
        assert done == len(tests) and "[rank 0] PASS" in out.stdout, f"{what}: {done} of {len(tests)} reported"


test_low_latency_across_domains.timeout = 2400
