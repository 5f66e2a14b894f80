"""A job of N ranks, one of which dies by SIGKILL in the middle of a call, for
test_shrink.py and test_shrink_normal.py (the test runner's own workers must
not die). Low-latency mode: the last rank kills itself between a dispatch's
send and its receive (hook mode); the survivors' combine gives up on it,
masks it, and the next calls match the reference without it. Normal mode: it
dies while the survivors are in their dispatch, waiting for it; their
dispatch masks it and matches the reference without it. Then the survivors
destroy their buffers (which must not wait for the dead rank), build a new
group and buffer of their own, and make a checked round trip on it.

    python shrink_kill_job.py --ranks N --mode low_latency|normal

The launcher prints one summary line last and exits nonzero if a survivor
failed or the victim did not die by SIGKILL."""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent


def launch(n: int, mode: str) -> int:
    import torch

    from turnout.gpu_sharing import shared_gpus
    from turnout.launch import free_port

    port = free_port()
    num_devices = torch.cuda.device_count()
    # Ranks sharing a GPU run under an MPS daemon of the job's own, which a
    # killed client cannot disturb for anyone else.
    with tempfile.TemporaryDirectory() as tmp, shared_gpus(n, num_devices) as placement:
        procs = []
        for r in range(n):
            env = dict(os.environ, **placement.env(r))
            procs.append(subprocess.Popen([sys.executable, __file__, "--ranks", str(n), "--mode", mode, "--rank",
                                           str(r), "--port", str(port), "--dir", tmp, "--device",
                                           str(placement.device(r))], stdout=subprocess.PIPE, text=True, env=env))
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=200)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outs.append(out)
    victim = n - 1
    ok = procs[victim].returncode == -signal.SIGKILL
    lines = []
    if not ok:
        lines.append(f"the victim (rank {victim}) exited with {procs[victim].returncode}, not by SIGKILL")
    results = []
    for r in range(n - 1):
        found = [json.loads(line[7:]) for line in outs[r].splitlines() if line.startswith("RESULT ")]
        if procs[r].returncode != 0 or not found or not found[-1]["ok"]:
            ok = False
            lines.append(f"rank {r}: exit {procs[r].returncode}: {found[-1] if found else outs[r][-2000:]}")
        else:
            results.append(found[-1])
    for line in lines:
        print(line)
    if ok:
        worst = max(r["death_to_call_s"] for r in results)
        print(f"{mode}: rank {victim} of {n} killed mid-call; every survivor's call completed at most {worst:.2f} s "
              f"after the kill (shrink_timeout_s={results[0]['shrink_s']}), then {results[0]['calls']} checked calls, "
              f"a destroy in {max(r['destroy_s'] for r in results):.2f} s and "
              + (f"a checked round trip on a new group of {n - 1}" if n > 2 else "no new group (one survivor)")
              + f" (peer memory: {results[0]['kind']})")
    return 0 if ok else 1


def worker(n: int, mode: str, rank: int, port: int, tmp: str, device: int) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import harness

    harness.install_check_counter()
    import turnout
    from low_latency_cases import LLCase, round_trip, size_hint
    from shrink_cases import CASES, SHRINK_S, References, Step, assert_mask

    torch.cuda.set_device(device)
    dev = torch.device("cuda", device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    ctx = types.SimpleNamespace(rank=rank, device=dev)
    victim = n - 1
    kill_file = Path(tmp) / "killed_at"
    if mode == "normal":
        return normal_worker(n, rank, ctx, dev, kill_file)
    buf = turnout.Buffer(dist.group.WORLD, num_rdma_bytes=size_hint(CASES, n), low_latency_mode=True,
                         enable_shrink=True, shrink_timeout_s=SHRINK_S, explicitly_destroy=True)
    kind = buf._native.peer_memory_kind
    refs = References(n)
    for case in CASES:
        step = Step(ctx, buf, refs, case)
        step.dispatch(set(), f"rank {rank}: before the kill: dispatch")
        step.combine(set(), set(), f"rank {rank}: before the kill: combine")
    dist.barrier()
    case = CASES[0]
    if rank == victim:
        inp = refs.inputs(case)[rank]
        buf.low_latency_dispatch(inp.x.to(dev), inp.topk_idx.to(dev), case.max_tokens, case.experts,
                                 use_fp8=case.use_fp8, return_recv_hook=True)
        torch.cuda.synchronize()  # its sends are out; it dies before its receive
        kill_file.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    # The victim's tokens arrived before it died: this dispatch holds them.
    step = Step(ctx, buf, refs, case, hook=True)
    step.dispatch(set(), f"rank {rank}: the killed call: dispatch")
    step.combine(set(), {victim}, f"rank {rank}: the killed call: combine")
    death_to_call = step.finished_at - float(kill_file.read_text())
    assert_mask(buf, n, dev, {victim}, f"rank {rank}: after the killed call")
    calls = 0
    for i in range(20):
        step = Step(ctx, buf, refs, CASES[i % len(CASES)], weights_at_dispatch=bool(i % 2))
        step.dispatch({victim}, f"rank {rank}: call {i} after the kill: dispatch")
        step.combine({victim}, {victim}, f"rank {rank}: call {i} after the kill: combine")
        calls += 2
    start = time.monotonic()
    buf.destroy()
    destroy_s = time.monotonic() - start
    assert destroy_s < SHRINK_S, f"rank {rank}: destroy took {destroy_s:.2f} s"
    # A new group of the survivors (two at least) and a buffer on it.
    if n - 1 >= 2:
        group = dist.new_group(list(range(n - 1)), use_local_synchronization=True)
        small = LLCase("uniform", 32, 32, 2048, 8, 8 * (n - 1), "bf16")
        fresh = turnout.Buffer(group, num_rdma_bytes=size_hint([small], n - 1), low_latency_mode=True,
                               enable_shrink=True, explicitly_destroy=True)
        round_trip(ctx, fresh, small, n - 1, f"rank {rank}: a new group of {n - 1}")
        fresh.destroy()
    print("RESULT " + json.dumps({"ok": True, "death_to_call_s": death_to_call, "calls": calls, "kind": kind,
                                  "destroy_s": destroy_s, "shrink_s": SHRINK_S, "checks": harness.take_checks()}),
          flush=True)
    # The default group still names the dead rank: leave without tearing it down.
    os._exit(0)


def normal_worker(n: int, rank: int, ctx, dev, kill_file: Path) -> None:
    import torch.distributed as dist

    import harness
    import turnout
    from intranode_cases import Case, nvl_bytes, round_trip
    from shrink_cases import SHRINK_S, assert_mask
    from test_shrink_normal import CASES, masked_round_trip

    victim = n - 1
    buf = turnout.Buffer(dist.group.WORLD, num_nvl_bytes=nvl_bytes(1024, n), enable_shrink=True,
                         shrink_timeout_s=SHRINK_S, explicitly_destroy=True)
    kind = buf._native.peer_memory_kind
    for case in CASES:
        round_trip(ctx, buf, case, n, f"rank {rank}: before the kill")
    dist.barrier()
    if rank == victim:
        kill_file.write_text(repr(time.time() + 0.5))
        time.sleep(0.5)  # the others are in their dispatch by now, waiting for this rank
        os.kill(os.getpid(), signal.SIGKILL)
    times = {}
    masked_round_trip(ctx, buf, CASES[0], n, {victim}, f"rank {rank}: the killed call", times=times)
    death_to_call = times["dispatch_done"] - float(kill_file.read_text())
    assert_mask(buf, n, dev, {victim}, f"rank {rank}: after the killed call")
    calls = 0
    for i in range(10):
        masked_round_trip(ctx, buf, CASES[i % len(CASES)], n, {victim}, f"rank {rank}: call {i} after the kill")
        calls += 2
    start = time.monotonic()
    buf.destroy()
    destroy_s = time.monotonic() - start
    assert destroy_s < SHRINK_S, f"rank {rank}: destroy took {destroy_s:.2f} s"
    if n - 1 >= 2:
        group = dist.new_group(list(range(n - 1)), use_local_synchronization=True)
        small = Case("uniform", 128, 1024, 8, 8 * (n - 1))
        fresh = turnout.Buffer(group, num_nvl_bytes=nvl_bytes(1024, n - 1), enable_shrink=True,
                               explicitly_destroy=True)
        round_trip(ctx, fresh, small, n - 1, f"rank {rank}: a new group of {n - 1}")
        fresh.destroy()
    print("RESULT " + json.dumps({"ok": True, "death_to_call_s": death_to_call, "calls": calls, "kind": kind,
                                  "destroy_s": destroy_s, "shrink_s": SHRINK_S, "checks": harness.take_checks()}),
          flush=True)
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--mode", choices=("low_latency", "normal"), required=True)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--dir")
    parser.add_argument("--device", type=int)
    args = parser.parse_args()
    if args.rank is None:
        return launch(args.ranks, args.mode)
    try:
        worker(args.ranks, args.mode, args.rank, args.port, args.dir, args.device)
    except BaseException:
        print("RESULT " + json.dumps({"ok": False, "error": traceback.format_exc()[-3000:]}), flush=True)
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
