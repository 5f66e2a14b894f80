"""Runs every GPU test on all visible GPUs, one process per GPU, and ends with
'N passed, M failed'.

Each test is a function ``test_*(ctx)`` in a ``test_*.py`` module beside this
file; every rank runs it and it passes when every rank returns. A watchdog in
this (parent) process gives each test a deadline (``fn.timeout`` seconds,
default 180): a test that hangs is killed with its workers, counted as failed,
and the run goes on with fresh workers from the next test.

    python tests/gpu/run.py [--ranks N] [-k SUBSTRING] [--list]
"""
import argparse
import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAG = "@@turnout-test@@ "
DEFAULT_TIMEOUT_S = 180.0


def discover(pattern: str):
    """[(module_name, function_name, timeout_s)] in file then definition order."""
    sys.path.insert(0, str(HERE))
    tests = []
    for path in sorted(HERE.glob("test_*.py")):
        module = importlib.import_module(path.stem)
        for name, fn in vars(module).items():
            if name.startswith("test_") and callable(fn) and getattr(fn, "__module__", None) == path.stem:
                full = f"{path.stem}::{name}"
                if pattern in full:
                    tests.append((path.stem, name, float(getattr(fn, "timeout", DEFAULT_TIMEOUT_S))))
    return tests


# ---------------------------------------------------------------------------------------------------------------
# Worker side


def report(**event) -> None:
    sys.stdout.write(TAG + json.dumps(event) + "\n")
    sys.stdout.flush()


def worker_main(rank: int, world_size: int, port: int, tests, start: int) -> None:
    import faulthandler
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    from harness import Context

    faulthandler.enable()  # a crash in native code still shows the Python stack
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    ctx = Context(rank, world_size)
    for index in range(start, len(tests)):
        module_name, fn_name, _ = tests[index]
        fn = getattr(importlib.import_module(module_name), fn_name)
        dist.barrier()
        report(event="start", test=index)
        t0 = time.time()
        try:
            fn(ctx)
            report(event="end", test=index, ok=True, seconds=time.time() - t0)
        except BaseException:
            report(event="end", test=index, ok=False, seconds=time.time() - t0, error=traceback.format_exc())
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Parent side: launch, watch, report


def launch(world_size: int, tests_arg: str, start: int):
    sys.path.insert(0, str(HERE.parent.parent / "python"))
    from turnout.launch import free_port

    port = free_port()
    events: "queue.Queue" = queue.Queue()
    procs = []
    for rank in range(world_size):
        p = subprocess.Popen([sys.executable, __file__, "--worker", str(rank), str(world_size), str(port), tests_arg,
                              str(start)], stdout=subprocess.PIPE, text=True, start_new_session=True)
        threading.Thread(target=pump, args=(rank, p, events), daemon=True).start()
        procs.append(p)
    return procs, events


def pump(rank: int, proc, events) -> None:
    for line in proc.stdout:
        if line.startswith(TAG):
            events.put((rank, json.loads(line[len(TAG):])))
        else:
            sys.stderr.write(f"[rank {rank}] {line}")
    events.put((rank, {"event": "exit", "code": proc.wait()}))


def kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_tests(tests, world_size: int):
    """Yields (name, ok, seconds, message) per test."""
    tests_arg = json.dumps(tests)
    index = 0
    while index < len(tests):
        procs, events = launch(world_size, tests_arg, index)
        restart = False
        while index < len(tests) and not restart:
            name, timeout = f"{tests[index][0]}::{tests[index][1]}", tests[index][2]
            done, errors, started = {}, [], None
            deadline = time.time() + timeout + 120  # the first test also waits for start-up
            while len(done) < world_size:
                try:
                    rank, ev = events.get(timeout=max(0.0, deadline - time.time()))
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(done))
                    errors.append(f"hung: ranks {missing} did not finish within {timeout:.0f} s (killed)")
                    restart = True
                    break
                if ev["event"] == "start" and ev["test"] == index and started is None:
                    started = time.time()
                    deadline = started + timeout
                elif ev["event"] == "end" and ev["test"] == index:
                    done[rank] = ev
                    if not ev["ok"]:
                        errors.append(f"rank {rank}:\n{ev['error']}")
                elif ev["event"] == "exit":
                    errors.append(f"rank {rank} exited with code {ev['code']} during the test")
                    restart = True
                    break
            seconds = time.time() - (started or time.time())
            yield name, not errors, seconds, "\n".join(errors)
            index += 1
            # Ranks of a failed test may still sit in its collectives: start afresh.
            restart = restart or bool(errors)
        kill(procs)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world_size, port = map(int, sys.argv[2:5])
        sys.path.insert(0, str(HERE))
        worker_main(rank, world_size, port, json.loads(sys.argv[5]), int(sys.argv[6]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None, help="processes (GPUs) to use; default all visible")
    parser.add_argument("-k", default="", help="run only tests whose module::name contains this")
    parser.add_argument("--list", action="store_true", help="list the tests and exit")
    args = parser.parse_args()
    tests = discover(args.k)
    if args.list:
        for m, n, t in tests:
            print(f"{m}::{n} (timeout {t:.0f} s)")
        return 0
    import torch

    world_size = args.ranks or torch.cuda.device_count()
    if world_size < 1:
        print("no CUDA device visible: no GPU test can run")
        print("0 passed, 1 failed")
        return 1
    passed = failed = 0
    t0 = time.time()
    for name, ok, seconds, message in run_tests(tests, world_size):
        print(f"{'PASS' if ok else 'FAIL'} {name} ({seconds:.1f} s)", flush=True)
        if not ok:
            print("    " + message.replace("\n", "\n    "), flush=True)
        passed, failed = passed + ok, failed + (not ok)
    print(f"GPU suite on {world_size} GPU(s), {time.time() - t0:.0f} s")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
