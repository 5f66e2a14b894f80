"""A rank killed (SIGKILL) while the others are in the middle of a dispatch,
ranks sharing a GPU: the others raise TimeoutError naming it within the
timeout (+2 s), their CUDA context still works, and the job's MPS daemon is
stopped."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from turnout.gpu_sharing import process_alive

TIMEOUT_S = 3.0
HOST_GRACE_S = 2.0
VICTIM = 1


def test_killed_rank_makes_the_others_time_out(ctx):
    if ctx.rank != 0:
        return
    job = Path(__file__).resolve().parent / "killed_rank_job.py"
    with tempfile.TemporaryDirectory() as folder:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        out = subprocess.run([sys.executable, str(job), folder, str(TIMEOUT_S)], capture_output=True, text=True,
                             timeout=170, env=env)
        log = f"job exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
        assert out.returncode == 3, f"the job must report its killed rank\n{log}"
        assert f"rank {VICTIM}: its process exited with code -9" in out.stdout, log
        records = {}
        for name in os.listdir(folder):
            if name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    record = json.load(f)
                records[record["rank"]] = record
    assert records.get(VICTIM, {}).get("killed"), f"the victim never came to its kill\n{log}"
    survivors = [r for r in records if r != VICTIM]
    assert len(survivors) >= 2, f"survivors that reported: {survivors}\n{log}"
    assert any(records[r]["ranks_on_gpu"] > 1 for r in records), f"no rank shared a GPU: {records}"
    for r in survivors:
        rec = records[r]
        assert rec["error"] and rec["error"].startswith("TimeoutError") and f"rank {VICTIM}" in rec["error"], \
            f"rank {r}: expected a TimeoutError naming rank {VICTIM}, got {rec['error']!r}"
        assert rec["seconds"] <= TIMEOUT_S + HOST_GRACE_S + 1.0, \
            f"rank {r}: raised after {rec['seconds']:.2f} s, timeout_s is {TIMEOUT_S}"
        assert rec["gpu_works"], f"rank {r}: the CUDA context did not survive"
        assert rec["destroy_seconds"] < TIMEOUT_S, f"rank {r}: destroy took {rec['destroy_seconds']:.2f} s"
    pids = {records[r]["daemon_pid"] for r in records}
    if pids != {None}:
        (pid,) = pids
        assert not process_alive(pid), f"the job's MPS daemon (pid {pid}) still runs after the job ended"
        folder_of = {os.path.dirname(records[r]["mps_pipe"]) for r in records}
        assert not any(os.path.exists(p) for p in folder_of), f"the job's MPS folder remains: {folder_of}"


test_killed_rank_makes_the_others_time_out.timeout = 240
