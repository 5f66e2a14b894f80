"""low_latency: low-latency dispatch and combine (decoding) as TARGETS.md's
protocol has them: 128 tokens per rank, hidden 7168, top-8 of 288 experts
(the top-k of ``randn().abs() + 1`` scores), FP8 dispatch, BF16 combine.
Figures are per rank; the table gives the median over ranks and the slowest
rank, the JSON the fastest too.

- GPU time per call: dispatch FP8 and BF16, combine BF16 (also with the weights
  given at dispatch, so the expert ranks pre-reduce), dispatch + combine back
  to back. 20 calls captured in one CUDA graph; each of 100 replays (after 10
  more) timed with CUDA events; the median of those per-call times. Where any
  rank cannot capture, every rank times eager calls with events instead and
  the mode column says so. The pair also as the protocol times it: events
  around one eager pair, L2 flushed before.
- The receive-hook variants (``return_recv_hook=True``): the send call's GPU
  work, then hook()'s, each timed on its own; a device barrier between them
  lets every rank's data land first, as the compute a hook hides would.
- Host time of one Python-level call: ``time.perf_counter_ns`` around calls
  issued back to back, the GPU never waited for in between; with
  ``async_finish=True`` too.
- A pair (dispatch FP8 with ``cumulative_local_expert_recv_stats``, combine)
  as a job issues it, 50 back to back, each between two CUDA events with no
  host sync or barrier in between, so the GPU time includes any wait for the
  host: "pair, fresh" first of all, "pair, long-running process" last, after
  32 mixed calls made with ``torch.set_default_device("cuda")`` and
  ``torch.set_default_dtype(torch.bfloat16)`` set, as DeepEP's test harness sets
  them. The second must stay within 10 us of the first.
- Bytes and messages on the wire per rank and call, counted from the routing
  (``wire``): to every other rank, or with ``TURNOUT_NVL_DOMAIN_SIZE`` set to
  the ranks of other NVL domains only.

Every timed round starts aligned: the GPU sleeps while the host queues the
round, then all ranks meet in a device barrier. So the events time GPU work,
not the host's launches nor a peer's late start."""
import gc
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..cpu_binding import allowed_cpus
from ..launch import gpus_shared, run_on_local_gpus
from . import SHAPE_OPTIONS, shape_problem
from .progress import Progress
from .report import column
from .timing import merge_ranks, time_parts
from .wire import PAIRS_NOTE, wire_bytes

TITLE = "low_latency: GPU time per call, host time per call and wire bytes per rank and call (median over ranks)"
SHARED_LABEL = "ranks sharing one GPU: not NVLink figures"
#: Where TURNOUT_NVL_DOMAIN_SIZE splits the ranks of one host into domains.
EMULATED_LABEL = "NVL domains declared on one host: NVSHMEM over its P2P transport, not a NIC"

COLUMNS = [
    column("figure", "figure"),
    column("mode", "mode"),
    column("time us", "time_us", "{:.2f}"),
    column("max us", "time_us_max", "{:.2f}"),
    column("ours KiB", "ours_bytes", "{:.1f}", scale=1024),
    column("per-(token,expert) KiB", "ref_bytes", "{:.1f}", scale=1024),
    column("ratio", "ratio", "{:.3f}"),
    column("ours msgs", "ours_messages", "{:.0f}"),
    column("per-(token,expert) msgs", "ref_messages", "{:.0f}"),
    column("max ratio", "ratio_max", "{:.3f}"),
    column("target", "target"),
    column("verdict", "verdict"),
]

PROTOCOL = SHAPE_OPTIONS["low_latency"]
# calls captured per graph, timed rounds and warm-up rounds per figure, host-time rounds; by --quick.
SETTINGS = {False: {"calls": 20, "iters": 100, "warmup": 10, "host_iters": 400},
            True: {"calls": 4, "iters": 10, "warmup": 2, "host_iters": 40}}
BURST = 10  # host-time rounds issued back to back after the ranks meet
FLUSH_BYTES = 256 << 20  # well past the 50 MB L2
# About 1 ms: ample time for the host to queue a whole round behind it.
SLEEP_CYCLES = 2_000_000
EAGER_BEFORE_CAPTURE = 3  # lazy initialization must not happen during capture
PAIR_LOOP = 50  # warm-up pairs, then timed pairs, of the fresh and long-running figures
FRESH_PAIR = "pair, fresh"
LONG_PAIR = "pair, long-running process"

# (kind, op) -> (target, the rank counts it is set for); TARGETS.md. Host
# times hold any op and rank count to 15 us.
TARGETS = {
    ("gpu", "dispatch FP8"): (15.0, (4,)),
    ("gpu", "combine BF16"): (22.0, (4,)),
    ("gpu", "combine BF16, weights at dispatch"): (22.0, (4,)),
    ("gpu", "dispatch FP8 + combine BF16"): (45.0, (4,)),
    ("wire", "dispatch FP8"): (0.5, (4, 8)),
    ("wire", "dispatch BF16"): (0.5, (4, 8)),
    ("wire", "combine BF16, weights at dispatch"): (0.5, (4, 8)),
    # At most this many us above FRESH_PAIR's figure of the same run, at any rank count.
    ("gpu", LONG_PAIR): (10.0, None),
}
# Targets given as an excess over another row of the run: (kind, op) -> that row's op.
RELATIVE_TO = {("gpu", LONG_PAIR): FRESH_PAIR}
HOST_TARGET_US = 15.0


class Setup:
    """One rank's low-latency buffer, routing and inputs, and the calls the
    figures are made of."""

    def __init__(self, world_size: int, tokens: int, hidden: int, experts: int, topk: int) -> None:
        self.tokens, self.hidden, self.experts = tokens, hidden, experts
        num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world_size, experts)
        self.buffer = Buffer(dist.group.WORLD, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                             num_qps_per_rank=experts // world_size)
        scores = torch.randn(tokens, experts, device="cuda").abs() + 1
        self.topk_idx = scores.topk(topk, dim=-1).indices
        self.topk_weights = torch.randn(tokens, topk, device="cuda").abs()
        self.x = torch.randn(tokens, hidden, device="cuda").bfloat16()
        # The experts' outputs, in dispatch's rows [L, M*R, H].
        self.expert_out = torch.randn(experts // world_size, tokens * world_size, hidden, device="cuda").bfloat16()
        self.stats = torch.zeros(experts // world_size, dtype=torch.int32, device="cuda")

    def dispatch(self, use_fp8: bool = True, weights: bool = False, hook: bool = False, async_finish: bool = False,
                 stats: bool = False, round_scale: bool = False, use_ue8m0: bool = False):
        return self.buffer.low_latency_dispatch(self.x, self.topk_idx, self.tokens, self.experts,
                                                self.stats if stats else None, use_fp8=use_fp8,
                                                round_scale=round_scale, use_ue8m0=use_ue8m0,
                                                async_finish=async_finish, return_recv_hook=hook,
                                                topk_weights=self.topk_weights if weights else None)

    def combine(self, handle, hook: bool = False, async_finish: bool = False):
        return self.buffer.low_latency_combine(self.expert_out, self.topk_idx, self.topk_weights, handle,
                                               async_finish=async_finish, return_recv_hook=hook)

    def barrier(self) -> None:
        """Every rank meets on the GPU (the buffer's device barrier)."""
        self.buffer._native.barrier(torch.cuda.current_stream().cuda_stream)

    def aligned_start(self) -> None:
        torch.cuda._sleep(SLEEP_CYCLES)
        self.barrier()


# Each builder runs when its figure starts (a combine's handle must come from
# a recent dispatch) and returns the parts of one round: one call, or a send
# and its hook().

def dispatch_parts(s: Setup, use_fp8: bool) -> List[Callable]:
    return [lambda: s.dispatch(use_fp8)]


def combine_parts(s: Setup, weights_at_dispatch: bool) -> List[Callable]:
    handle = s.dispatch(weights=weights_at_dispatch)[2]
    return [lambda: s.combine(handle)]


def pair_parts(s: Setup) -> List[Callable]:
    return [lambda: s.combine(s.dispatch()[2])]


def dispatch_async_parts(s: Setup) -> List[Callable]:
    return [lambda: s.dispatch(async_finish=True)]


def combine_async_parts(s: Setup) -> List[Callable]:
    handle = s.dispatch()[2]
    return [lambda: s.combine(handle, async_finish=True)]


def hooked(send: Callable[[], Callable]) -> List[Callable]:
    """A send that returns its hook, and the part that calls that hook."""
    held = {}

    def send_part() -> None:
        held["hook"] = send()

    def receive_part() -> None:
        held.pop("hook")()

    return [send_part, receive_part]


def dispatch_hook_parts(s: Setup) -> List[Callable]:
    return hooked(lambda: s.dispatch(hook=True)[4])


def combine_hook_parts(s: Setup) -> List[Callable]:
    handle = s.dispatch()[2]
    return hooked(lambda: s.combine(handle, hook=True)[2])


HOOK_PARTS = ("send", "receive (hook())")
# (op, builder, names of its parts); every one is timed on the GPU, all but
# the pair on the host too.
FIGURES = [
    ("dispatch FP8", lambda s: dispatch_parts(s, True), None),
    ("dispatch BF16", lambda s: dispatch_parts(s, False), None),
    ("combine BF16", lambda s: combine_parts(s, False), None),
    ("combine BF16, weights at dispatch", lambda s: combine_parts(s, True), None),
    ("dispatch FP8 + combine BF16", pair_parts, None),
    ("dispatch FP8, hook", dispatch_hook_parts, HOOK_PARTS),
    ("combine BF16, hook", combine_hook_parts, HOOK_PARTS),
]
PAIR = "dispatch FP8 + combine BF16"
# Host time only: async_finish calls (their GPU time is the plain calls').
HOST_ONLY_FIGURES = [
    ("dispatch FP8, async_finish", dispatch_async_parts, None),
    ("combine BF16, async_finish", combine_async_parts, None),
]


def part_ops(op: str, part_names) -> List[str]:
    return [op] if part_names is None else [f"{op}: {name}" for name in part_names]


def all_ranks(value) -> List:
    """``value`` of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def gpu_times(s: Setup, parts: List[Callable], calls: int, iters: int, warmup: int):
    """(mode, capture error or None, per part the GPU times per call in us).
    A lone call is captured ``calls`` times into one graph; a send and its
    hook get a graph each, one call in it (a second send before the hook
    would break the protocol)."""
    repeats = calls if len(parts) == 1 else 1
    for _ in range(EAGER_BEFORE_CAPTURE):
        for part in parts:
            part()
    torch.cuda.synchronize()
    graphs, error = [], None
    try:
        for part in parts:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=graphs[0].pool() if graphs else None):
                for _ in range(repeats):
                    part()
            graphs.append(graph)
    except Exception as e:  # any rank's failure sends every rank to eager calls
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    failed = [f"rank {rank}: {e}" for rank, e in enumerate(all_ranks(error)) if e]
    if failed:
        del graphs
        # A failed capture may have left a call half issued: reset the region on every rank.
        torch.cuda.synchronize()
        dist.barrier()
        s.buffer.clean_low_latency_buffer(s.tokens, s.hidden, s.experts)
        torch.cuda.synchronize()
        times = time_parts(parts, iters, warmup, before=s.aligned_start, between=s.barrier)
        return "events, eager (capture failed)", failed[0], times
    times = time_parts([graph.replay for graph in graphs], iters, warmup, before=s.aligned_start, between=s.barrier)
    return f"graph x{repeats}", None, [[t / repeats for t in part] for part in times]


def pair_with_events(s: Setup, iters: int, warmup: int) -> List[float]:
    """The pair as TARGETS.md times it: CUDA events around one eager dispatch
    and its combine, the L2 flushed before each (outside the events)."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def flushed_start() -> None:
        flush.zero_()
        s.aligned_start()

    return time_parts(pair_parts(s), iters, warmup, before=flushed_start)[0]


def host_times(parts: List[Callable], iters: int):
    """Per part, (median us per call issued back to back, median us of the
    first call after the GPU drained): ``perf_counter_ns`` around the call
    only. Bursts of ``BURST`` rounds, each after a sync and a barrier; the
    first burst warms up."""
    warm, first = [[] for _ in parts], [[] for _ in parts]
    for burst in range(max(1, iters // BURST) + 1):
        torch.cuda.synchronize()
        dist.barrier()
        for i in range(BURST):
            for j, part in enumerate(parts):
                start = time.perf_counter_ns()
                part()
                elapsed_us = (time.perf_counter_ns() - start) / 1e3
                if burst:
                    (warm if i else first)[j].append(elapsed_us)
    torch.cuda.synchronize()
    return [(statistics.median(w), statistics.median(f)) for w, f in zip(warm, first)]


# What pair_loop notes beside the figure (in the JSON, per rank as min / max).
PAIR_LOOP_DETAILS = ("min_pair_us", "max_pair_us", "host_us_per_pair", "gc_collections", "gc_us")


def pair_loop(s: Setup) -> Dict:
    """Average us per pair between CUDA events (``time_us``): PAIR_LOOP pairs
    to warm up, an L2 flush, then PAIR_LOOP pairs, each between its own two
    events, all issued back to back (no host sync, no barrier). Beside it, to
    tell a slow GPU from a host that fell behind: the fastest and slowest
    pair, the host's us per pair while issuing them, and the garbage
    collections and their us in that time."""
    def pair() -> None:
        s.combine(s.dispatch(stats=True)[2])

    for _ in range(PAIR_LOOP):
        pair()
    torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda").zero_()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(PAIR_LOOP)]
    collections = []

    def note_collection(phase: str, info: Dict) -> None:
        collections.append((phase, time.perf_counter_ns()))

    gc.callbacks.append(note_collection)
    try:
        issue_start = time.perf_counter_ns()
        for start, end in events:
            start.record()
            pair()
            end.record()
        issue_ns = time.perf_counter_ns() - issue_start
    finally:
        gc.callbacks.remove(note_collection)
    torch.cuda.synchronize()
    pairs = [start.elapsed_time(end) * 1e3 for start, end in events]
    starts = [t for phase, t in collections if phase == "start"]
    stops = [t for phase, t in collections if phase == "stop"]
    return {"time_us": statistics.mean(pairs), "min_pair_us": min(pairs), "max_pair_us": max(pairs),
            "host_us_per_pair": issue_ns / 1e3 / PAIR_LOOP, "gc_collections": len(starts),
            "gc_us": sum(b - a for a, b in zip(starts, stops)) / 1e3}


# The mixed calls before the long-running figure: (format, kind), as a long
# job makes them: every format, hooks, async_finish, two dispatches of a shape
# before their combines, weights at dispatch; 32 calls (a hook counts as one).
# Formats: (use_fp8, round_scale, use_ue8m0).
FORMATS = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8 round_scale": (True, True, False),
           "ue8m0": (True, True, True)}
MIXED_CALLS: List[Tuple[str, str]] = [
    ("bf16", "plain"), ("fp8", "hook"), ("fp8 round_scale", "async"), ("ue8m0", "twice"), ("fp8", "plain"),
    ("bf16", "async"), ("ue8m0", "hook"), ("fp8", "twice"), ("fp8 round_scale", "hook"), ("bf16", "weights"),
    ("fp8", "async"),
]


def mixed_calls(s: Setup) -> None:
    """MIXED_CALLS, each dispatch with the stats tensor, each combined, its hooks
    called and its events waited for."""
    for fmt, kind in MIXED_CALLS:
        use_fp8, round_scale, use_ue8m0 = FORMATS[fmt]

        def dispatch(**kwargs):
            return s.dispatch(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, stats=True, **kwargs)

        if kind == "twice":
            first, second = dispatch(), dispatch()
            s.combine(first[2])
            s.combine(second[2])
        elif kind == "hook":
            out = dispatch(hook=True)
            out[4]()
            s.combine(out[2], hook=True)[2]()
        elif kind == "async":
            out = dispatch(async_finish=True)
            out[3].current_stream_wait()
            with s.combine(out[2], async_finish=True)[1]:
                pass
        else:
            s.combine(dispatch(weights=kind == "weights")[2])


def default_device_setting():
    """What torch.set_default_device was last given (None: never, or cleared)."""
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return None if context is None else context.device


def long_running_pair(s: Setup) -> Dict:
    """pair_loop after mixed_calls, both with DeepEP's test defaults set
    (restored after)."""
    device, dtype = default_device_setting(), torch.get_default_dtype()
    torch.set_default_device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    try:
        mixed_calls(s)
        return pair_loop(s)
    finally:
        torch.set_default_dtype(dtype)
        torch.set_default_device(device)


def wire_domain_size(s: Setup) -> Optional[int]:
    """The NVL domain size the wire rows count with: the buffer's where
    TURNOUT_NVL_DOMAIN_SIZE declares one, else None (every other rank), since
    one host's ranks would otherwise put nothing on the wire."""
    return s.buffer._native.num_nvl_ranks if os.environ.get("TURNOUT_NVL_DOMAIN_SIZE") else None


def make_row(kind: str, op: str, mode: str, **values) -> Dict:
    prefix = {"gpu": "", "host": "host: ", "wire": "wire: "}[kind]
    return dict({"bench": "low_latency", "kind": kind, "op": op, "figure": prefix + op, "mode": mode}, **values)


def measure(rank: int, world_size: int, quick: bool, shape: Dict[str, int]) -> List[Dict]:
    """One rank's rows (run in every rank's process): GPU times, host times,
    wire bytes, in that order."""
    calls, iters, warmup, host_iters = SETTINGS[quick].values()
    torch.manual_seed(rank)
    s = Setup(world_size, **shape)
    host_figures = [f for f in FIGURES if f[0] != PAIR] + HOST_ONLY_FIGURES
    progress = Progress(len(FIGURES) + 3 + len(host_figures), "low_latency", enabled=rank == 0)
    loop_mode = f"events, eager, {PAIR_LOOP} back to back"
    # Before anything else: the process as fresh as the bench can have it.
    progress.step(FRESH_PAIR)
    dist.barrier()
    gpu = [make_row("gpu", FRESH_PAIR, loop_mode, iters=PAIR_LOOP, **pair_loop(s))]
    s.buffer.check_errors()
    host = []
    for op, build, part_names in FIGURES:
        progress.step(op)
        mode, error, times = gpu_times(s, build(s), calls, iters, warmup)
        for name, part in zip(part_ops(op, part_names), times):
            gpu.append(make_row("gpu", name, mode, time_us=statistics.median(part), iters=len(part),
                                capture_error=error))
        torch.cuda.synchronize()
        s.buffer.check_errors()

    progress.step(f"{PAIR}, events")
    times = pair_with_events(s, iters, warmup)
    gpu.append(make_row("gpu", PAIR, "events, eager, L2 flushed", time_us=statistics.median(times), iters=len(times)))
    s.buffer.check_errors()

    # Where the host times ran: the CPUs this rank's main thread may use.
    cpus = allowed_cpus()
    for op, build, part_names in host_figures:
        progress.step(f"host: {op}")
        for name, (us, after_sync) in zip(part_ops(op, part_names), host_times(build(s), host_iters)):
            host.append(make_row("host", name, "perf_counter_ns", time_us=us, host_us_after_sync=after_sync,
                                 iters=host_iters, cpus=cpus))
    s.buffer.check_errors()

    progress.step(LONG_PAIR)
    gpu.append(make_row("gpu", LONG_PAIR, loop_mode, iters=PAIR_LOOP, **long_running_pair(s)))
    s.buffer.check_errors()
    progress.close()

    wire = [make_row("wire", w.pop("op"), "from topk_idx", pairs_note=PAIRS_NOTE, **w)
            for w in wire_bytes(s.topk_idx.tolist(), rank, world_size, shape["experts"], shape["hidden"],
                                wire_domain_size(s))]
    return [dict(r, **shape) for r in gpu + host + wire]


def target_and_verdict(row: Dict, num_ranks: int, shared: bool, protocol_shape: bool,
                       reference_us: Optional[float] = None) -> Dict:
    """The row's target (text and value) and whether it is met, judged on the
    median over ranks where the target is set: the protocol's shape and its
    rank counts. A target relative to another row (RELATIVE_TO) is that row's
    figure, ``reference_us``, plus the allowed excess, at any shape and rank
    count. GPU times of ranks sharing a GPU say so."""
    key = (row["kind"], row["op"])
    if row["kind"] == "host":
        value, ranks = HOST_TARGET_US, None
    elif key in TARGETS:
        value, ranks = TARGETS[key]
    else:
        return {"target": None, "target_value": None, "verdict": "-"}
    if key in RELATIVE_TO:
        text = f"<= {RELATIVE_TO[key]} + {value:g} us"
        if reference_us is None or row["time_us"] is None:
            return {"target": text, "target_value": None, "verdict": "-"}
        limit = reference_us + value
        verdict = ("met" if row["time_us"] <= limit else "not met") + (" (shared GPU)" if shared else "")
        return {"target": text, "target_value": limit, "verdict": verdict}
    scope = "" if ranks is None else f" ({', '.join(f'EP{r}' for r in ranks)})"
    text = f"<= {value:g}{' us' if row['kind'] != 'wire' else ''}{scope}"
    figure = row["ratio"] if row["kind"] == "wire" else row["time_us"]
    if row["kind"] != "host" and not protocol_shape:
        verdict = "n/a: not the protocol's shape"
    elif ranks is not None and num_ranks not in ranks:
        verdict = f"n/a at EP{num_ranks}"
    elif figure is None:
        verdict = "-"
    else:
        verdict = "met" if figure <= value else "not met"
        if shared and row["kind"] == "gpu":
            verdict += " (shared GPU)"
    return {"target": text, "target_value": value, "verdict": verdict}


def declared_domain_size(rows: List[Dict], num_ranks: int) -> Optional[int]:
    """The NVL domain size the wire rows were counted with, where it splits
    the ranks into several domains; else None."""
    sizes = {r.get("nvl_domain_size") for r in rows if r["kind"] == "wire"} - {None}
    size = min(sizes) if sizes else None
    return size if size is not None and size < num_ranks else None


def finish(rows: List[Dict], num_ranks: int, shared: bool) -> List[Dict]:
    """Targets, verdicts and the shared-GPU label on the merged rows. Across
    declared domains the GPU times are the NVSHMEM path's: the targets
    (NVLink on one host) do not judge them."""
    time_of = {(r["kind"], r["op"]): r.get("time_us") for r in rows}
    domains = declared_domain_size(rows, num_ranks)
    out = []
    for r in rows:
        protocol_shape = all(r[key] == value for key, value in PROTOCOL.items())
        reference = RELATIVE_TO.get((r["kind"], r["op"]))
        reference_us = time_of.get(("gpu", reference)) if reference is not None else None
        r = dict(r, ranks_share_gpus=shared, num_ranks=num_ranks, **target_and_verdict(r, num_ranks, shared,
                                                                                        protocol_shape, reference_us))
        if r["kind"] == "gpu":
            labels = ([SHARED_LABEL] if shared else []) + ([EMULATED_LABEL] if domains else [])
            if labels:
                r["label"] = "; ".join(labels)
            if domains and r["target"] is not None and not r["verdict"].startswith("n/a"):
                r["verdict"] = "n/a across domains"
        out.append(r)
    return out


def check_shape(shape: Dict[str, int], num_ranks: int) -> None:
    problem = shape_problem(shape, num_ranks)
    if problem:
        raise ValueError(f"low_latency: {problem}")


def run(num_ranks: Optional[int], quick: bool, **shape: int) -> List[Dict]:
    shape = dict(PROTOCOL, **shape)
    world_size = num_ranks or torch.cuda.device_count()
    check_shape(shape, world_size)
    per_rank = run_on_local_gpus(measure, (quick, shape), num_ranks, "nccl")
    rows = merge_ranks(per_rank, "time_us", "host_us_after_sync", "ours_bytes", "ref_bytes", "ratio",
                       "ours_messages", "ref_messages", "message_ratio", *PAIR_LOOP_DETAILS, listed=("cpus",))
    return finish(rows, world_size, gpus_shared(world_size))


def title(rows: List[Dict]) -> str:
    r = rows[0]
    text = (f"low_latency: {r['tokens']} tokens per rank, hidden {r['hidden']}, top-{r['topk']} of {r['experts']} "
            f"experts, EP{r['num_ranks']}; median over ranks and the slowest rank; targets from TARGETS.md")
    domains = declared_domain_size(rows, r["num_ranks"])
    if domains:
        text += f"; {r['num_ranks'] // domains} domains of {domains} ranks, {EMULATED_LABEL}"
    return f"{text}; {SHARED_LABEL}" if r["ranks_share_gpus"] else text


def plot_series(rows: List[Dict]) -> List[Dict]:
    """Two bar panels: the GPU times (the combine with and without weights
    at dispatch among them), and the wire bytes of both protocols."""
    gpu = [r for r in rows if r["kind"] == "gpu"]
    wire = [r for r in rows if r["kind"] == "wire"]
    ranks = rows[0]["num_ranks"]
    times_title = f"low_latency: GPU time per call, EP{ranks}"
    if rows[0]["ranks_share_gpus"]:
        times_title += f"\n{SHARED_LABEL}"
    if declared_domain_size(rows, ranks):
        times_title += f"\n{EMULATED_LABEL}"

    def applies(r: Dict) -> bool:
        return r["target_value"] is not None and not r["verdict"].startswith("n/a")

    times = {"title": times_title, "width": 9, "height": 6, "ylabel": "us per call",
             "categories": [f"{r['op']} [{r['mode']}]" for r in gpu],
             "bars": [("median over ranks", [r["time_us"] for r in gpu]),
                      ("slowest rank", [r.get("time_us_max") for r in gpu])],
             "targets": [r["target_value"] if applies(r) else None for r in gpu]}
    wire_bytes_panel = {
        "title": f"low_latency: wire bytes per rank and call, EP{ranks}", "width": 6, "height": 6,
        "ylabel": "KiB per call",
        "categories": [r["op"] for r in wire],
        "bars": [("turnout", [r["ours_bytes"] / 1024 for r in wire]),
                 ("one row per (token, expert)", [r["ref_bytes"] / 1024 for r in wire])],
        "targets": [r["target_value"] * r["ref_bytes"] / 1024 if applies(r) else None for r in wire]}
    return [times, wire_bytes_panel]

