"""internode: normal dispatch (BF16, FP8) and combine (BF16) across NVL
domains declared on one host (``TURNOUT_NVL_DOMAIN_SIZE`` smaller than the
ranks), so the ops take the internode path over NVSHMEM's P2P transport: the
protocol a NIC runs, not its wire. Run only when named (``python -m
turnout.bench internode``); a group of one domain is refused by name.

Shape as the intranode bench's (docs/PERFORMANCE.md): 4096 tokens per rank,
hidden 7168, top-8 of 256 experts, uniform load (``--tokens`` and the others
shrink it where it does not fit). Each call timed alone with CUDA events
after an L2 flush; median of 50 after 50 warm-ups; combine weighted by the
received top-k weights, as training calls it. Logical GB/s: bytes this rank
receives (its own tokens included) over the call's time, as intranode counts
them. Then an SM sweep, and per rank the network bytes and puts of one call
from the routing (``internode_wire``): turnout's beside DeepEP's protocol
and a per-rank protocol (no forwarding)."""
import os
import statistics
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import Config
from ..buffer import Buffer
from ..gpu_sharing import find_mps_control
from ..launch import gpus_shared, run_on_local_gpus
from . import SHAPE_OPTIONS, shape_problem
from .internode_wire import network_counts
from .intranode import inputs
from .low_latency import EMULATED_LABEL, SHARED_LABEL
from .progress import Progress
from .report import Refused, column, range_column
from .timing import merge_ranks, time_each
from .wire import SCALE_GROUP

TITLE = "internode: dispatch / combine across declared NVL domains, and network bytes per rank and call"
DOMAIN_ENV = "TURNOUT_NVL_DOMAIN_SIZE"

COLUMNS = [
    column("figure", "figure"),
    column("SMs", "num_sms"),
    column("time us", "time_us", "{:.1f}"),
    column("max us", "time_us_max", "{:.1f}"),
    column("GB/s", "gbps", "{:.1f}"),
    range_column("GB/s over ranks", "gbps"),
    column("ours MiB", "turnout_bytes", "{:.2f}", scale=1 << 20),
    column("DeepEP MiB", "deepep_bytes", "{:.2f}", scale=1 << 20),
    column("per-rank MiB", "per_rank_bytes", "{:.2f}", scale=1 << 20),
    column("ours / DeepEP", "ratio_deepep", "{:.3f}"),
    column("per-rank / ours", "ratio_per_rank", "{:.2f}"),
    column("ours puts", "turnout_messages", "{:.0f}"),
    column("per-rank puts", "per_rank_messages", "{:.0f}"),
]

PROTOCOL = SHAPE_OPTIONS["internode"]
MAIN_SMS = 24
SWEEP_SMS = {False: (8, 12, 16, 24), True: (12, 24)}
# (iters, warm-ups) by --quick.
SETTINGS = {False: (50, 50), True: (10, 5)}
FLUSH_BYTES = 256 << 20
# Chunks as the GPU job's tested config: network puts of up to 16 tokens into
# rings of 128, NVL rings of 256 that combine splits per source domain.
NVL_SEND, NVL_RECV, RDMA_SEND, RDMA_RECV = 8, 256, 16, 128
OPS = ("dispatch BF16", "dispatch FP8", "combine BF16")


def config_for(num_sms: int) -> Config:
    return Config(num_sms=num_sms, num_max_nvl_chunked_send_tokens=NVL_SEND,
                  num_max_nvl_chunked_recv_tokens=NVL_RECV, num_max_rdma_chunked_send_tokens=RDMA_SEND,
                  num_max_rdma_chunked_recv_tokens=RDMA_RECV)


def declared_domain_size(num_ranks: int, environ=None) -> int:
    """The NVL domain size the ranks are split by; raises Refused where they
    form one domain (nothing would cross between domains) or the size does
    not divide them. On one host the domain is the host unless declared."""
    text = (os.environ if environ is None else environ).get(DOMAIN_ENV, "").strip()
    how = (f"declare smaller NVL domains, e.g. {DOMAIN_ENV}={max(1, num_ranks // 2)} "
           f"NVSHMEM_REMOTE_TRANSPORT=none python -m turnout.bench internode --ranks {num_ranks}")
    if not text:
        raise Refused(f"internode: the {num_ranks} ranks of this host form one NVL domain ({DOMAIN_ENV} is not "
                      f"set), so no token crosses between domains; {how}")
    try:
        size = int(text)
    except ValueError:
        raise Refused(f"internode: {DOMAIN_ENV}={text!r} is not a number; {how}") from None
    if size < 1 or num_ranks % size:
        raise Refused(f"internode: {DOMAIN_ENV}={size} must divide the {num_ranks} ranks; {how}")
    if size >= num_ranks:
        raise Refused(f"internode: {DOMAIN_ENV}={size} puts all {num_ranks} ranks in one NVL domain, so no token "
                      f"crosses between domains; {how}")
    return size


def check_shape(shape: Dict[str, int], num_ranks: int) -> None:
    problem = shape_problem(shape, num_ranks)
    if problem:
        raise Refused(f"internode: {problem}")


def wire_rows(in_ranks, rank: int, domain: int, shape: Dict[str, int], channels_per_block: int = 1) -> List[Dict]:
    """This rank's network rows, one per op, with the MAIN_SMS config's
    channels and chunks: DeepEP's a channel per two SMs, turnout's
    ``channels_per_block`` times as many, each with that share of the ring
    (so puts of at most RDMA_RECV // channels_per_block tokens)."""
    hidden, topk = shape["hidden"], shape["topk"]
    common = dict(rank=rank, num_nvl_ranks=domain, num_topk=topk, hidden=hidden)
    turnout_channels = dict(num_channels=MAIN_SMS // 2 * channels_per_block,
                            chunk_tokens=min(RDMA_SEND, RDMA_RECV // channels_per_block))
    deepep_channels = dict(num_channels=MAIN_SMS // 2, chunk_tokens=RDMA_SEND)
    formats = {"BF16": dict(row_bytes=2 * hidden, num_scales=0),
               "FP8": dict(row_bytes=hidden, num_scales=hidden // SCALE_GROUP)}
    by_format = {fmt: (network_counts(in_ranks, **common, **args, **turnout_channels),
                       network_counts(in_ranks, **common, **args, **deepep_channels))
                 for fmt, args in formats.items()}
    rows = []
    for op, fmt, key in (("dispatch BF16", "BF16", "dispatch"), ("dispatch FP8", "FP8", "dispatch"),
                         ("combine BF16", "BF16", "combine")):
        counts = by_format[fmt][0]
        row = {f"{p}_{what}": by_format[fmt][p == "deepep"][f"{key}_{p}_{what}"]
               for p in ("turnout", "deepep", "per_rank") for what in ("bytes", "messages")}
        ours = row["turnout_bytes"]
        row.update(ratio_deepep=ours / row["deepep_bytes"] if row["deepep_bytes"] else None,
                   ratio_per_rank=row["per_rank_bytes"] / ours if ours else None,
                   token_domain_pairs=counts["token_domain_pairs"], token_rank_pairs=counts["token_rank_pairs"])
        rows.append(make_row("wire", op, MAIN_SMS, **row))
    return rows


def make_row(kind: str, op: str, num_sms: int, **values) -> Dict:
    figure = op if kind == "gpu" else f"wire: {op}"
    return dict({"bench": "internode", "kind": kind, "op": op, "figure": figure, "num_sms": num_sms}, **values)


def measure_point(buffer: Buffer, data, shape: Dict[str, int], num_sms: int, iters: int, warmup: int,
                  flush) -> List[Dict]:
    topk_idx, topk_weights, x, x_fp8 = data
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, shape["experts"])
    config = config_for(num_sms)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, config=config)
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, **layout)
    num_recv, hidden = recv_x.shape[0], shape["hidden"]
    calls = {
        "dispatch BF16": (lambda: buffer.dispatch(x, **layout), num_recv * hidden * 2),
        "dispatch FP8": (lambda: buffer.dispatch(x_fp8, **layout), num_recv * hidden * (1 + 4 / SCALE_GROUP)),
        "combine BF16": (lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights, config=config),
                         num_recv * hidden * 2),
    }
    rows = []
    for op in OPS:
        fn, num_bytes = calls[op]
        t = statistics.median(time_each(fn, iters, warmup, before=flush.zero_))
        rows.append(make_row("gpu", op, num_sms, time_us=t, recv_tokens=num_recv,
                             gbps=num_bytes / (t * 1e-6) / 1e9))
    buffer.check_errors()
    return rows


def measure(rank: int, world_size: int, quick: bool, shape: Dict[str, int], domain: int) -> List[Dict]:
    iters, warmup = SETTINGS[quick]
    torch.manual_seed(rank)
    sweep = (MAIN_SMS,) + tuple(s for s in SWEEP_SMS[quick] if s != MAIN_SMS)
    hidden_bytes = shape["hidden"] * 2
    configs = [config_for(s) for s in sweep]
    num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, world_size) for c in configs)
    num_rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, world_size, domain) for c in configs)
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                    explicitly_destroy=True)
    try:
        data = inputs(shape["tokens"], shape["hidden"], shape["experts"], shape["topk"])
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        progress = Progress(len(sweep) + 1, "internode", enabled=rank == 0)
        rows = []
        for num_sms in sweep:
            progress.step(f"{num_sms} SMs")
            rows += measure_point(buffer, data, shape, num_sms, iters, warmup, flush)
        progress.step("network bytes")
        in_rank = buffer.get_dispatch_layout(data[0], shape["experts"])[3].cpu()
        in_ranks = [None] * world_size
        dist.all_gather_object(in_ranks, in_rank)
        rows += wire_rows(in_ranks, rank, domain, shape, buffer._native.internode_channels_per_block)
        progress.close()
    finally:
        buffer.destroy()
    return [dict(r, **shape) for r in rows]


def finish(rows: List[Dict], num_ranks: int, domain: int, shared: bool) -> List[Dict]:
    """The run's facts on every merged row, and the labels on the GPU times:
    always the emulated domains' (NVSHMEM over P2P), and the shared GPU's."""
    labels = ([SHARED_LABEL] if shared else []) + [EMULATED_LABEL]
    out = []
    for r in rows:
        r = dict(r, num_ranks=num_ranks, nvl_domain_size=domain, num_domains=num_ranks // domain,
                 ranks_share_gpus=shared)
        if r["kind"] == "gpu":
            r["label"] = "; ".join(labels)
        out.append(r)
    return out


def nvshmem_environment(environ, shared: bool) -> None:
    """What NVSHMEM needs in ``environ`` (the ranks inherit it) for domains
    emulated on this host: no remote transport (every PE is reached over P2P;
    left as given if set) and, where ranks share a GPU, the MPS control binary
    on PATH, since NVSHMEM asks it whether MPS runs before it gives PEs
    sharing a GPU its full support (as tests/gpu/test_nvshmem_window.py sets
    it up)."""
    environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    control = find_mps_control() if shared else None
    if control:
        folder = os.path.dirname(control)
        path = environ.get("PATH", "")
        if folder not in path.split(os.pathsep):
            environ["PATH"] = folder + os.pathsep + path if path else folder


def run(num_ranks: Optional[int], quick: bool, **shape: int) -> List[Dict]:
    shape = dict(PROTOCOL, **shape)
    world_size = num_ranks or torch.cuda.device_count()
    domain = declared_domain_size(world_size)
    check_shape(shape, world_size)
    nvshmem_environment(os.environ, gpus_shared(world_size))
    per_rank = run_on_local_gpus(measure, (quick, shape, domain), num_ranks, "nccl")
    rows = merge_ranks(per_rank, "time_us", "gbps", "turnout_bytes", "deepep_bytes", "per_rank_bytes",
                       "turnout_messages", "deepep_messages", "per_rank_messages", "ratio_deepep", "ratio_per_rank")
    return finish(rows, world_size, domain, gpus_shared(world_size))


def title(rows: List[Dict]) -> str:
    r = rows[0]
    text = (f"internode: {r['tokens']} tokens per rank, hidden {r['hidden']}, top-{r['topk']} of {r['experts']} "
            f"experts, EP{r['num_ranks']} as {r['num_domains']} domains of {r['nvl_domain_size']} ranks, "
            f"{EMULATED_LABEL}; median over ranks; network bytes of one call per rank from the routing "
            f"({MAIN_SMS} SMs' channels, puts of up to {RDMA_SEND} tokens)")
    return f"{text}; {SHARED_LABEL}" if r["ranks_share_gpus"] else text


def plot_series(rows: List[Dict]) -> List[Dict]:
    """Two bar panels: time per call by SMs, and network bytes per protocol."""
    gpu = [r for r in rows if r["kind"] == "gpu"]
    wire = [r for r in rows if r["kind"] == "wire"]
    first = rows[0]
    times_title = f"internode: time per call, EP{first['num_ranks']}\n{EMULATED_LABEL}"
    if first["ranks_share_gpus"]:
        times_title += f"\n{SHARED_LABEL}"
    sms = sorted({r["num_sms"] for r in gpu})
    times = {"title": times_title, "width": 9, "height": 6, "ylabel": "us per call",
             "categories": list(OPS),
             "bars": [(f"{s} SMs", [next((r["time_us"] for r in gpu if r["op"] == op and r["num_sms"] == s), None)
                                    for op in OPS]) for s in sms]}
    network = {"title": f"internode: network bytes per rank and call, EP{first['num_ranks']}", "width": 6,
               "height": 6, "ylabel": "MiB per call", "categories": [r["op"] for r in wire],
               "bars": [(name, [r[f"{key}_bytes"] / (1 << 20) for r in wire])
                        for name, key in (("turnout", "turnout"), ("DeepEP", "deepep"),
                                          ("per rank, no forwarding", "per_rank"))]}
    return [times, network]
