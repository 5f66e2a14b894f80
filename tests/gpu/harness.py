"""What every GPU test gets: its rank, its GPU, process groups of every size the
run allows, buffers that are destroyed on the way out, seeded generators,
comparison helpers that say what differed, a way to skip with a reason, and a
count of the checks it made.

A test's checks are counted: every ``assert`` statement of the modules in this
folder (``install_check_counter`` rewrites them on import) and every helper
below. The runner fails a test whose ranks made no check at all, so a loop
that ran zero times cannot pass as a test."""
import ast
import contextlib
import functools
import gc
import importlib.abc
import importlib.machinery
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent

# turnout and turnout_reference are imported where used, so importing this
# module (the runner does, before it sets the rank's GPU) loads what it always did.

_checks = 0


class Skipped(Exception):
    """Raised by a test that cannot run its body in this configuration."""


def count_check() -> None:
    global _checks
    _checks += 1


def take_checks() -> int:
    """The checks made since the last call (the runner calls it per test)."""
    global _checks
    made, _checks = _checks, 0
    return made


class _CountAsserts(ast.NodeTransformer):
    """``assert test, msg`` becomes ``count_check(); if not test: raise
    AssertionError(msg)``: the message is still built only on failure."""

    def visit_Assert(self, node: ast.Assert):
        count = ast.Expr(ast.Call(ast.Name("__count_check__", ast.Load()), [], []))
        fail = ast.Raise(ast.Call(ast.Name("AssertionError", ast.Load()), [node.msg] if node.msg else [], []), None)
        check = ast.If(ast.UnaryOp(ast.Not(), node.test), [fail], [])
        return [ast.copy_location(count, node), ast.copy_location(check, node)]


class _CountingLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        # Always from source: a cached .pyc would hold the unrewritten asserts.
        path = self.get_filename(fullname)
        tree = _CountAsserts().visit(ast.parse(self.get_data(path), path))
        return compile(ast.fix_missing_locations(tree), path, "exec", dont_inherit=True)

    def exec_module(self, module):
        module.__dict__["__count_check__"] = count_check
        super().exec_module(module)


class _CountingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if "." in name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [str(HERE)])
        if spec is None or not spec.origin or Path(spec.origin).parent != HERE or name == "harness":
            return None
        spec.loader = _CountingLoader(name, spec.origin)
        return spec


def install_check_counter() -> None:
    """From now on, modules of this folder are imported with counted asserts."""
    if not any(isinstance(f, _CountingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CountingFinder())


def share_cpu_cores(world_size: int) -> int:
    """Gives this rank's torch thread pool its share of the host's cores
    (cores // ranks, at least 1) and returns that count. The host references
    of every rank run at once: with a pool as large as the host in each rank,
    the pools fight (ranks x cores threads, each spinning between parallel
    regions) and every CPU op of a test takes many times as long. The runner's
    workers and the jobs that start processes of their own both call it."""
    threads = max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    return threads


class HostTimes:
    """Where one rank's host time went while active (a ``with`` block), for a
    job's timing line: seconds and calls in ``turnout.Buffer()`` (across NVL
    domains this holds NVSHMEM's init and its symmetric allocation),
    ``Buffer.destroy`` (NVSHMEM's collective free and finalize), the
    low-latency calls (their launch only: they do not wait for the GPU), and
    ``torch.cuda.synchronize`` (the GPU's work and the wait for slower peers);
    ``line`` puts the rest down to the test's own host work (inputs,
    references, checks). It wraps those functions while active and puts the
    originals back after."""

    BUFFER_METHODS = (("__init__", "Buffer()"), ("destroy", "destroy"), ("low_latency_dispatch", "dispatch"),
                      ("low_latency_combine", "combine"), ("clean_low_latency_buffer", "clean"))

    def __init__(self) -> None:
        self.times = {}  # label -> [calls, seconds]
        self._undo = []

    def _wrap(self, owner, attr: str, label: str) -> None:
        original = owner.__dict__.get(attr)
        wrapped = getattr(owner, attr)
        times = self.times

        @functools.wraps(wrapped)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return wrapped(*args, **kwargs)
            finally:
                entry = times.setdefault(label, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - t0

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def __enter__(self) -> "HostTimes":
        import turnout

        for attr, label in self.BUFFER_METHODS:
            self._wrap(turnout.Buffer, attr, label)
        self._wrap(torch.cuda, "synchronize", "synchronize")
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self._undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._undo.clear()

    def line(self, name: str, total_s: float) -> str:
        """``TIME name: total, each label's seconds (calls), the rest``."""
        parts, counted = [], 0.0
        for _, label in self.BUFFER_METHODS + (("", "synchronize"),):
            calls, seconds = self.times.get(label, (0, 0.0))
            if calls:
                parts.append(f"{label} {seconds:.2f} s ({calls})")
                counted += seconds
        parts.append(f"rest {total_s - counted:.2f} s")
        return f"TIME {name}: {total_s:.1f} s: " + ", ".join(parts) + f"; torch threads {torch.get_num_threads()}"


class Context:
    def __init__(self, rank: int, world_size: int, device_index: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda", device_index)
        self.num_devices = torch.cuda.device_count()
        # new_group is collective over WORLD: make every size once, up front.
        self.groups = {}
        for n in (2, 4, 8):
            if n < world_size:
                self.groups[n] = dist.new_group(list(range(n)))
        self.groups[world_size] = dist.group.WORLD

    @property
    def shares_gpu(self) -> bool:
        """True when ranks of this run share GPUs (more ranks than GPUs)."""
        return self.world_size > self.num_devices

    def sizes(self):
        """Group sizes to test, smallest first (2, 4 and 8 where the run allows);
        skips the test when the run has a single rank."""
        sizes = sorted(n for n in self.groups if n >= 2)
        if not sizes:
            self.skip(f"needs a group of at least 2 ranks; this run has {self.world_size}")
        return sizes

    def group(self, size: int):
        """The group of ranks [0, size), or None on ranks outside it."""
        return self.groups[size] if self.rank < size else None

    def each_group(self, min_size: int = 2):
        """(size, group) for every size of ``sizes()`` from ``min_size`` up
        whose group holds this rank. Only for bodies that make no collective
        over WORLD: the ranks left out of a group skip its turn."""
        for n in self.sizes():
            g = self.group(n)
            if n >= min_size and g is not None:
                yield n, g

    @contextlib.contextmanager
    def buffer(self, group, *args, **kwargs):
        """A ``turnout.Buffer`` over ``group`` made with explicitly_destroy=True
        (the other arguments as given), destroyed when the block ends: its peer
        mappings go before the next buffer, not whenever it is collected."""
        import turnout

        buf = turnout.Buffer(group, *args, explicitly_destroy=True, **kwargs)
        try:
            yield buf
        finally:
            buf.destroy()

    def all_gather(self, obj, group=None):
        group = group or dist.group.WORLD
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    @staticmethod
    def skip(reason: str):
        """Ends the test as skipped. Call it on every rank alike."""
        raise Skipped(reason)


def generator(*key) -> torch.Generator:
    """A CPU generator seeded from ``key`` alone, so any rank can redraw what
    any other rank drew (keys: the test's name, group size, rank, case)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def memory_in_use(device: int, rank_pids) -> Tuple[int, Optional[FrozenSet[int]]]:
    """Bytes in use on ``device`` less what nvidia-smi lists for processes other
    than the run's ranks (``rank_pids``), and those processes' pids; None in
    their place where nvidia-smi cannot tell (or does not list this process:
    pids of another namespace), the figure then the whole GPU's. nvidia-smi is
    asked before and after the free-memory query, and counts where both agree."""
    from turnout.bench import gpu_processes

    uuid = gpu_processes.normalize_uuid(str(torch.cuda.get_device_properties(device).uuid))

    def others() -> Optional[Dict[int, int]]:
        snapshot = gpu_processes.query(set(), [uuid])
        if isinstance(snapshot, str) or os.getpid() not in {p["pid"] for p in snapshot}:
            return None
        mib = {p["pid"]: p["used_mib"] for p in snapshot if p["pid"] not in rank_pids}
        return None if None in mib.values() else mib

    for _ in range(5):
        before = others()
        free, total = torch.cuda.mem_get_info(device)
        if before is None:
            break
        if others() == before:
            return total - free - (sum(before.values()) << 20), frozenset(before)
    return total - free, None


@dataclass
class MemoryWindow:
    before: int  # bytes in use at the start (see memory_in_use)
    after: int
    note: str  # how the figures were told apart from other processes'

    @property
    def kept(self) -> int:
        return self.after - self.before


def memory_kept(ctx, group, rank_pids, body, tries: int = 3) -> MemoryWindow:
    """Memory in use after ``body()`` less before, every rank of ``group`` idle
    and torch's cache empty at both ends. Why not the GPU's free memory alone:
    another job's MPS server takes about 71 MiB on every GPU it sees, of which
    nvidia-smi lists 66 for it, so where a process other than the ranks starts
    or ends on a rank's GPU meanwhile the window is run again, up to ``tries``
    times; the note of the last says so."""
    device = torch.cuda.current_device()

    def settle() -> None:
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        ctx.all_gather(None, group=group)

    for _ in range(tries):
        settle()
        before, others_before = memory_in_use(device, rank_pids)
        body()
        settle()
        after, others_after = memory_in_use(device, rank_pids)
        steady = others_before == others_after
        if all(ctx.all_gather(steady, group=group)):
            if others_after is None:
                return MemoryWindow(before, after, "the whole GPU's (nvidia-smi could not tell other processes)")
            return MemoryWindow(before, after, f"other processes' memory left out ({len(others_after)} of them)")
    came = sorted((others_after or frozenset()) - (others_before or frozenset()))
    gone = sorted((others_before or frozenset()) - (others_after or frozenset()))
    return MemoryWindow(before, after, f"other processes came or went on the GPUs in each of {tries} tries "
                                       f"(last, here: started {came}, ended {gone})")


def assert_equal(got, expected, what: str) -> None:
    """Bitwise equality of two tensors/arrays, with the first differing index."""
    count_check()
    g = got.cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    e = expected.cpu().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected)
    if g.shape != e.shape:
        raise AssertionError(f"{what}: shape {g.shape} != expected {e.shape}")
    if g.dtype != e.dtype and not (g.dtype.kind == e.dtype.kind == "b"):
        g = g.astype(e.dtype)
    diff = np.argwhere(g != e)
    if len(diff):
        i = tuple(diff[0])
        raise AssertionError(f"{what}: {len(diff)} elements differ; first at {i}: got {g[i]}, expected {e[i]}")


def assert_raises(kind, fn, *words):
    """Calls fn, which must raise `kind` with every word of `words` in its message."""
    count_check()
    try:
        fn()
    except kind as e:
        message = str(e)
        missing = [w for w in words if w not in message]
        if missing:
            raise AssertionError(f"{kind.__name__} raised, but its message lacks {missing}: {message!r}") from e
        return e
    except BaseException as e:
        raise AssertionError(f"expected {kind.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def assert_layout_matches(out, topk_idx, num_ranks: int, num_experts: int, what: str, num_nvl_ranks=None):
    """num_tokens_per_rank, num_tokens_per_expert and is_token_in_rank of
    get_dispatch_layout's ``out`` against the host reference over the same
    ``topk_idx`` (one NVL domain unless ``num_nvl_ranks``); returns the
    reference, whose [1] is the per-RDMA-rank count."""
    import turnout_reference

    per_rank, _, per_expert, in_rank, _ = out
    ref = turnout_reference.get_dispatch_layout(topk_idx.cpu().numpy(), num_ranks, num_experts,
                                                num_nvl_ranks or num_ranks)
    assert_equal(per_rank, ref[0], f"{what}: num_tokens_per_rank")
    assert_equal(per_expert, ref[2], f"{what}: num_tokens_per_expert")
    assert_equal(in_rank, ref[3].astype(bool), f"{what}: is_token_in_rank")
    return ref
