"""Runs every GPU test with N ranks, one process each, and ends with
'N passed, M failed, K skipped'.

Each test is a function ``test_*(ctx)`` in a ``test_*.py`` module beside this
file; every rank runs it. It passes when every rank returns and the ranks made
at least one check between them (``harness`` counts asserts and helpers); it
is skipped, with its reason, when a rank raises ``harness.Skipped``. Ranks go
round-robin over the visible GPUs; where they share one, an MPS daemon of the
run's own serves them (``turnout.gpu_sharing``) and is stopped at the end,
also when a test fails, hangs or the run is interrupted (Ctrl-C, SIGTERM,
SIGHUP). Workers, and the test jobs they start, die with this process, also
when it is SIGKILLed (Linux: ``die_with_parent``). A watchdog in this
(parent) process gives each test a deadline (``fn.timeout`` seconds, default
180): a test that hangs is killed with its workers, counted as failed, and the
run goes on with fresh workers from the next test.

    python tests/gpu/run.py [--ranks N] [-k SUBSTRING] [-x SUBSTRING] [--list]

Ranks: ``--ranks``, else ``$TURNOUT_TEST_RANKS``, else every visible GPU, at
least 4 (ranks then share GPUs).
"""
import argparse
import atexit
import ctypes
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAG = "@@turnout-test@@ "
DEFAULT_TIMEOUT_S = 180.0
MIN_DEFAULT_RANKS = 4
# How long workers that ran every test get to leave on their own (their last
# barrier, destroy_process_group, CUDA's teardown) before they are killed.
EXIT_WAIT_S = 60.0
PARENT_ENV = "TURNOUT_TEST_RUNNER_PID"  # the run's pid, for a worker's die_with_parent
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Signals that end the run through SystemExit, so its cleanup runs: SIGTERM
# (`timeout`, a scheduler) and SIGHUP (a closed terminal). Ctrl-C already raises.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def discover(pattern: str, exclude: str = ""):
    """[(module_name, function_name, timeout_s)] in file then definition order."""
    sys.path.insert(0, str(HERE))
    tests = []
    for path in sorted(HERE.glob("test_*.py")):
        module = importlib.import_module(path.stem)
        for name, fn in vars(module).items():
            if name.startswith("test_") and callable(fn) and getattr(fn, "__module__", None) == path.stem:
                full = f"{path.stem}::{name}"
                picked = any(p in full for p in pattern.split(","))
                left_out = any(x and x in full for x in exclude.split(","))
                if picked and not left_out:
                    tests.append((path.stem, name, float(getattr(fn, "timeout", DEFAULT_TIMEOUT_S))))
    return tests


# ---------------------------------------------------------------------------------------------------------------
# Worker side


def die_with_parent(parent_pid: int) -> None:
    """Ends this worker, and the test jobs it started (its process group), when
    the run's process ends, also by SIGKILL, which runs none of the run's
    cleanup: the workers sit in sessions of their own, so nothing else would
    reach them, and a rank left running keeps the GPUs busy under the next run.
    Linux only (prctl); elsewhere it does nothing. The kernel's SIGTERM is
    handled in Python: a worker blocked in native code goes when that returns."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None:
        return
    me = os.getpid()

    def on_sigterm(signum, frame):
        if os.getpid() != me:
            # A child forked from this worker inherited the handler: it ends
            # alone, as by default, and leaves the worker's group be.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        os.killpg(0, signal.SIGKILL)  # the worker leads the group: it goes too

    signal.signal(signal.SIGTERM, on_sigterm)
    if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the prctl: no signal will come
        os._exit(1)


def report(**event) -> None:
    sys.stdout.write(TAG + json.dumps(event) + "\n")
    sys.stdout.flush()


def worker_main(rank: int, world_size: int, port: int, device: int, tests, start: int) -> None:
    import faulthandler
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import harness

    faulthandler.enable()  # a crash in native code still shows the Python stack
    harness.install_check_counter()
    # The host references run in every rank at once: split the cores, or each
    # rank's thread pool fights the others' (8 ranks x all cores).
    harness.share_cpu_cores(world_size)
    torch.cuda.set_device(device)
    # Ranks outside a test's smaller groups wait in the next collective while those
    # groups run (minutes with many ranks on one GPU); the watchdog catches real hangs.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=900))
    ctx = harness.Context(rank, world_size, device)
    # A worker that leaves early through Python's exit path, or through a C
    # exit() in native code (which skips Python's handlers), says where it was.
    at = {"test": None, "done": False}
    atexit.register(lambda: at["done"] or sys.stderr.write(f"rank {rank}: worker exiting during test {at['test']}\n"))

    def on_c_exit(status, _):
        if not at["done"]:
            sys.stderr.write(f"rank {rank}: C exit({status}) during test {at['test']}; the stacks:\n")
            faulthandler.dump_traceback(all_threads=True)

    at["c_hook"] = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p)(on_c_exit)  # lives as long as the process
    ctypes.CDLL(None).on_exit(at["c_hook"], None)
    for index in range(start, len(tests)):
        at["test"] = index
        module_name, fn_name, _ = tests[index]
        fn = getattr(importlib.import_module(module_name), fn_name)
        dist.barrier()
        report(event="start", test=index)
        harness.take_checks()
        t0 = time.time()
        try:
            fn(ctx)
            report(event="end", test=index, ok=True, seconds=time.time() - t0, checks=harness.take_checks())
        except harness.Skipped as e:
            report(event="end", test=index, ok=True, skipped=str(e), seconds=time.time() - t0,
                   checks=harness.take_checks())
        except BaseException:
            report(event="end", test=index, ok=False, seconds=time.time() - t0, error=traceback.format_exc())
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    at["done"] = True


# ---------------------------------------------------------------------------------------------------------------
# Parent side: launch, watch, report


def start_worker(argv, env=None, **popen_kwargs) -> subprocess.Popen:
    """Starts a worker in a session of its own, so that kill() ends it with the
    test jobs it starts (one process group), and tells it this process's pid
    for its die_with_parent. Call it from the main thread: the kernel's
    parent-death signal comes when the thread that started the child ends."""
    env = dict(os.environ if env is None else env, **{PARENT_ENV: str(os.getpid())})
    return subprocess.Popen(argv, start_new_session=True, env=env, **popen_kwargs)


def launch(world_size: int, tests_arg: str, start: int, placement):
    from turnout.launch import free_port

    port = free_port()
    events: "queue.Queue" = queue.Queue()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, **placement.env(rank))
        p = start_worker([sys.executable, __file__, "--worker", str(rank), str(world_size), str(port),
                          str(placement.device(rank)), tests_arg, str(start)],
                         env=env, stdout=subprocess.PIPE, text=True)
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


def wait_for_exit(procs, limit_s: float) -> None:
    """Waits up to ``limit_s`` in all for the workers to exit."""
    deadline = time.time() + limit_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            return


def kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def verdict(done, errors, world_size: int):
    """("PASS" | "FAIL" | "SKIP", message) of one test from its ranks' end events."""
    if errors:
        return "FAIL", "\n".join(errors)
    skipped = sorted({ev["skipped"] for ev in done.values() if ev.get("skipped")})
    if skipped:
        return "SKIP", "; ".join(skipped)
    if sum(ev.get("checks", 0) for ev in done.values()) == 0:
        return "FAIL", f"no rank of {world_size} made a check: the test's body checked nothing"
    return "PASS", ""


def wait_for_gpus(placement, world_size: int, limit_s: float = 180.0) -> None:
    """Under MPS, a killed rank's kernels run on until they end (at worst their
    timeout), and meanwhile the server may turn new clients away: before
    fresh workers start, wait until a client of each GPU gets in."""
    probe = "import sys, torch; torch.zeros(1, device=f'cuda:{sys.argv[1]}'); torch.cuda.synchronize()"
    deadline = time.time() + limit_s
    for device in sorted({placement.device(r) for r in range(world_size)}):
        rank = next(r for r in range(world_size) if placement.device(r) == device)
        env = dict(os.environ, **placement.env(rank))
        said = False
        while subprocess.run([sys.executable, "-c", probe, str(device)], env=env, capture_output=True).returncode:
            if time.time() > deadline:
                print(f"GPU {device} still turns new processes away after {limit_s:.0f} s", flush=True)
                return
            if not said:
                print(f"waiting for GPU {device} to accept new processes (a killed rank's kernels may still run)",
                      flush=True)
                said = True
            time.sleep(2.0)


def run_tests(tests, world_size: int, placement):
    """Yields (name, status, seconds, message) per test."""
    tests_arg = json.dumps(tests)
    index = 0
    while index < len(tests):
        if index > 0 and placement.daemon is not None:
            wait_for_gpus(placement, world_size)
        procs, events = launch(world_size, tests_arg, index, placement)
        restart = False
        # Ranks' output arrives through one thread each, so a rank's start of the
        # next test may come before another rank's end of this one: held back.
        held, last_seen = [], {}
        try:
            while index < len(tests) and not restart:
                name, timeout = f"{tests[index][0]}::{tests[index][1]}", tests[index][2]
                done, errors, started = {}, [], None
                deadline = time.time() + timeout + 120  # the first test also waits for start-up
                early = [item for item in held if item[1].get("test") == index]
                held = [item for item in held if item[1].get("test") != index]
                while len(done) < world_size:
                    try:
                        rank, ev = early.pop(0) if early else events.get(timeout=max(0.0, deadline - time.time()))
                    except queue.Empty:
                        missing = sorted(set(range(world_size)) - set(done))
                        seen = ", ".join(f"rank {r}: {last_seen.get(r, 'none')}" for r in missing)
                        errors.append(f"hung: ranks {missing} did not finish within {timeout:.0f} s (killed; "
                                      f"their last reports: {seen})")
                        restart = True
                        break
                    if "test" in ev:
                        last_seen[rank] = f"{ev['event']} of test {ev['test']}"
                        if ev["test"] > index:
                            held.append((rank, ev))
                            continue
                        if ev["test"] < index:
                            errors.append(f"rank {rank} reported the {ev['event']} of test {ev['test']} after "
                                          f"the run had moved on to test {index}")
                            continue
                    if ev["event"] == "start" and started is None:
                        started = time.time()
                        deadline = started + timeout
                    elif ev["event"] == "end":
                        done[rank] = ev
                        if not ev["ok"]:
                            errors.append(f"rank {rank}:\n{ev['error']}")
                    elif ev["event"] == "exit":
                        errors.append(f"rank {rank} exited with code {ev['code']} during the test (its last "
                                      f"report: {last_seen.get(rank, 'none')})")
                        restart = True
                        break
                seconds = time.time() - (started or time.time())
                status, message = verdict(done, errors, world_size)
                yield name, status, seconds, message
                index += 1
                # Ranks of a failed test may still sit in its collectives: start afresh.
                restart = restart or bool(errors)
        finally:
            # After the last test the workers leave through a barrier and
            # destroy_process_group: killing the first ones out while the
            # others are still in there resets those others' connections.
            if index >= len(tests) and not restart:
                wait_for_exit(procs, EXIT_WAIT_S)
            kill(procs)


def default_ranks(num_devices: int) -> int:
    env = os.environ.get("TURNOUT_TEST_RANKS")
    if env:
        return int(env)
    return max(num_devices, MIN_DEFAULT_RANKS)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        die_with_parent(int(os.environ[PARENT_ENV]))
        rank, world_size, port, device = map(int, sys.argv[2:6])
        sys.path.insert(0, str(HERE))
        worker_main(rank, world_size, port, device, json.loads(sys.argv[6]), int(sys.argv[7]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks (processes) to run; default $TURNOUT_TEST_RANKS, else the visible GPUs, at least 4")
    parser.add_argument("-k", default="", help="run only tests whose module::name contains one of these (a,b,...)")
    parser.add_argument("-x", default="", help="leave out tests whose module::name contains one of these (a,b,...)")
    parser.add_argument("--list", action="store_true", help="list the tests and exit")
    args = parser.parse_args()
    tests = discover(args.k, args.x)
    if args.list:
        for m, n, t in tests:
            print(f"{m}::{n} (timeout {t:.0f} s)")
        return 0
    from turnout.gpu_sharing import signals_raise

    # By default these signals would end this process at once, leaving the
    # workers (in sessions of their own) running: raised, the cleanup runs.
    try:
        with signals_raise(*ENDING_SIGNALS):
            return run_suite(tests, args.ranks)
    except SystemExit as e:
        if e.code in {128 + sig for sig in ENDING_SIGNALS}:
            print(f"GPU suite: ended by {signal.Signals(e.code - 128).name}", flush=True)
        raise


def run_suite(tests, ranks) -> int:
    """Runs the tests with ``ranks`` ranks (None: the default) over the visible
    GPUs; 0 when none failed and one passed."""
    import torch

    from turnout.gpu_sharing import shared_gpus

    num_devices = torch.cuda.device_count()
    if num_devices < 1:
        print("no CUDA device visible: no GPU test can run")
        print("0 passed, 1 failed, 0 skipped")
        return 1
    world_size = ranks or default_ranks(num_devices)
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    t0 = time.time()
    with shared_gpus(world_size, num_devices) as placement:
        where = (f"{world_size} ranks on {num_devices} GPU(s)" +
                 (", ranks sharing GPUs" + (" under MPS" if placement.daemon else " (time-sliced, no MPS)")
                  if placement.shared else ""))
        print(f"GPU suite: {where}", flush=True)
        results = run_tests(tests, world_size, placement)
        try:
            for name, status, seconds, message in results:
                print(f"{status} {name} ({seconds:.1f} s)" + (f": {message}" if status == "SKIP" else ""),
                      flush=True)
                if status == "FAIL":
                    print("    " + message.replace("\n", "\n    "), flush=True)
                counts[status] += 1
        finally:
            results.close()  # its workers go before the MPS daemon does
    print(f"GPU suite: {where}, {time.time() - t0:.0f} s")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 0 if counts["FAIL"] == 0 and counts["PASS"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
