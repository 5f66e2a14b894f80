"""ceiling: every rank stores to every peer at once, with a plain SM kernel
(16-byte stores) and with bulk copies through shared memory (one thread a
block issuing cp.async.bulk), and reads from every peer at once with SM loads.
The NVLink figure every later result is compared with; where ranks share a
GPU, the local copy (HBM) ceiling of that GPU instead. The plain store kernel
also runs with a GPU's warps split otherwise between SMs (as many warps on
fewer SMs, or spread over more): whether its store rate is bound per SM or per
warp; and with eight loads a lane in flight before their stores, as the data
kernels copy rows, where the plain kernel has one. The loads say whether a
kernel that pulls its rows from the peers could move more bytes an SM than
one that pushes them; their rows with sixteen words a lane in flight (128 KB
an SM) whether an SM loads faster with more bytes in flight than eight give."""
import statistics
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..launch import gpus_shared, run_on_local_gpus
from .progress import Progress
from .report import NVLINK_RAW_GBPS, column, pct_of_raw, range_column
from .timing import merge_ranks, time_each

TITLE = (f"ceiling: all GPUs store to all peers at once (SM stores of 16 B, or bulk copies) or load from all of them "
         f"(SM loads of 16 B), wire bytes per GPU; "
         f"NVLink raw {NVLINK_RAW_GBPS:.0f} GB/s")

METHODS = ("sm stores", "bulk copies", "sm loads")

COLUMNS = [
    column("copy", "method"),
    column("SMs", "num_sms"),
    column("warps/SM", "warps_per_block"),
    column("words/lane", "words_in_flight"),
    column("MiB/GPU", "bytes_per_gpu", "{:.0f}", scale=2**20),
    column("time us", "time_us", "{:.1f}"),
    column("GB/s", "gbps", "{:.1f}"),
    range_column("GB/s over ranks", "gbps"),
    column("GB/s per GPU, its ranks together", "gbps_gpu", "{:.1f}"),
    column("% of NVLink raw", "pct_of_raw", "{:.1f}"),
]

SM_COUNTS = (8, 12, 16, 24, 32, 48, 64, 96, 132)
QUICK_SM_COUNTS = (12, 24, 96)
# The plain kernel's warps a block, and (SMs, warps a block) of the splits:
# 96 and 192 warps a GPU on 6 to 48 SMs (with the rows above at 12 SMs).
WARPS = 16
WARP_SPLITS = ((6, 16), (12, 8), (24, 4), (6, 32), (24, 8), (48, 4))
SPLIT_TOTALS = (96, 192)
# 16-byte loads a lane in flight: the plain kernel's, the deep rows', and the
# loads' deepest rows.
WORDS, DEEP_WORDS, DEEPEST_LOAD_WORDS = 1, 8, 16


def measure(rank: int, world_size: int, quick: bool) -> List[Dict]:
    """One rank's median store time per SM count (run in every rank's process)."""
    bytes_per_peer = (64 if quick else 256) << 20
    sm_counts = QUICK_SM_COUNTS if quick else SM_COUNTS
    warmup, iters = 5, 5 if quick else 20
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=world_size * bytes_per_peer)
    native = buffer._native
    if native.num_nvl_ranks < 2:
        raise RuntimeError("ceiling: needs at least 2 ranks (on GPUs connected by NVLink, or sharing one GPU)")
    # Random bytes: a zero source could let the hardware take shortcuts.
    src = torch.randint(0, 256, (bytes_per_peer,), dtype=torch.uint8, device="cuda")
    # Where the loads land: a slot per rank, this rank's own left alone.
    dst = torch.empty(native.num_nvl_ranks * bytes_per_peer, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    bytes_per_gpu = (native.num_nvl_ranks - 1) * bytes_per_peer
    runs = [(method, num_sms, WARPS, WORDS, False) for method in METHODS for num_sms in sm_counts]
    if not quick:
        runs += [(METHODS[0], num_sms, warps, WORDS, True) for num_sms, warps in WARP_SPLITS]
        runs += [(method, num_sms, WARPS, DEEP_WORDS, False) for method in (METHODS[0], METHODS[2])
                 for num_sms in sm_counts]
        runs += [(METHODS[2], num_sms, WARPS, DEEPEST_LOAD_WORDS, False) for num_sms in sm_counts]
    progress = Progress(len(runs), "ceiling", enabled=rank == 0)
    rows = []
    for method, num_sms, warps, words, split in runs:
        bulk = method == "bulk copies"
        progress.step(f"{method}, {num_sms} SMs, {warps} warps a block, {words} words a lane")
        if method == "sm loads":
            def copy():
                native.load_from_peers(dst.data_ptr(), bytes_per_peer, 0, num_sms, stream, False, warps, words)
        else:
            def copy():
                native.store_to_peers(src.data_ptr(), bytes_per_peer, 0, False, num_sms, stream, bulk, warps, words)
        times = time_each(
            copy, iters, warmup,
            # Outside the timed region: every GPU leaves the barrier together, so
            # each one's copies meet its peers' on the links.
            before=lambda: native.barrier(stream))
        rows.append({"bench": "ceiling", "method": method, "num_sms": num_sms,
                     "warps_per_block": None if bulk else warps, "words_in_flight": None if bulk else words,
                     "warp_split": split, "bytes_per_gpu": bytes_per_gpu,
                     "time_us": statistics.median(times), "ranks_on_gpu": native.ranks_on_gpu})
    progress.close()
    return rows


def gbps(num_bytes: int, time_us: float) -> float:
    return num_bytes / (time_us * 1e-6) / 1e9


def run(num_ranks: Optional[int], quick: bool) -> List[Dict]:
    shared = gpus_shared(num_ranks or torch.cuda.device_count())
    rows = merge_ranks(run_on_local_gpus(measure, (quick,), num_ranks, "nccl"), "time_us")
    for row in rows:
        # Every rank moves the same bytes: the slowest rank has the lowest bandwidth.
        row.update(gbps=gbps(row["bytes_per_gpu"], row["time_us"]),
                   gbps_min=gbps(row["bytes_per_gpu"], row["time_us_max"]),
                   gbps_max=gbps(row["bytes_per_gpu"], row["time_us_min"]))
        row["gbps_gpu"] = row["gbps"] * row["ranks_on_gpu"]
        # Stores between ranks of one GPU never reach NVLink.
        row["pct_of_raw"] = None if shared else pct_of_raw(row["gbps"])
        row["ranks_share_gpus"] = shared
    return rows


def plot_series(rows: List[Dict]) -> Dict:
    """One line per copy method over the SM counts (the splits and deep rows
    left out), one per warp total of the splits (with the plain kernel's rows
    of that total), one per method of its deep rows, and one of the loads'
    deepest rows."""
    shared = bool(rows) and rows[0].get("ranks_share_gpus")
    key = "gbps_gpu" if shared else "gbps"
    plain = [r for r in rows if r.get("words_in_flight") in (None, WORDS)]
    deep = [r for r in rows if r.get("words_in_flight") == DEEP_WORDS]
    deepest = [r for r in rows if r.get("words_in_flight") == DEEPEST_LOAD_WORDS]
    series = []
    for method in METHODS:
        mine = [r for r in plain if r.get("method", METHODS[0]) == method and not r.get("warp_split")]
        if mine:
            series.append((method, [r["num_sms"] for r in mine], [r[key] for r in mine]))
    for total in SPLIT_TOTALS:
        mine = sorted((r for r in plain if r.get("method", METHODS[0]) == METHODS[0] and r.get("warps_per_block")
                       and r["num_sms"] * r["warps_per_block"] == total),
                      key=lambda r: r["num_sms"])
        if len(mine) > 1:
            series.append((f"sm stores, {total} warps a GPU", [r["num_sms"] for r in mine], [r[key] for r in mine]))
    for method in (METHODS[0], METHODS[2]):
        mine = [r for r in deep if r.get("method", METHODS[0]) == method]
        if mine:
            series.append((f"{method}, {DEEP_WORDS} words a lane in flight", [r["num_sms"] for r in mine],
                           [r[key] for r in mine]))
    if deepest:
        series.append((f"{METHODS[2]}, {DEEPEST_LOAD_WORDS} words a lane in flight", [r["num_sms"] for r in deepest],
                       [r[key] for r in deepest]))
    ticks = sorted({r["num_sms"] for r in rows})
    if shared:
        return {"x": ticks, "series": series, "xlabel": "SMs per rank",
                "ylabel": "GB/s per GPU, ranks sharing it (local copy)"}
    return {"x": ticks, "series": series, "xlabel": "SMs per GPU", "ylabel": "GB/s per GPU (wire)",
            "ref": (NVLINK_RAW_GBPS, "NVLink raw")}
