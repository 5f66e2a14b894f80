"""host: the host's time per call of the normal-mode ops, on its own and with
many calls, so that the figure holds still: intranode dispatch and combine
(intranode.host_times, 400 calls of each; combine also with its top-k
weights, at 128 tokens a rank too, and with a buffer of the config's size
hint, on its rings) and get_dispatch_layout back to back (layout's protocol,
five runs of 200 calls, the median). The other subcommands time the GPU; this
one the CPU, which is the critical path of eager training and prefill loops
at small batches. Pin each rank to CPUs of its own (``--bind-cpus``) or the
figures carry the scheduler's noise."""
import statistics
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..launch import gpus_shared, run_on_local_gpus
from . import intranode, layout
from .progress import Progress
from .report import column, range_column
from .timing import merge_ranks, time_back_to_back

TITLE = "host: host time per call of the normal ops (median over ranks), EP over this host's GPUs"

COLUMNS = [
    column("op", "op"),
    column("host us", "host_us", "{:.1f}"),
    range_column("host us over ranks", "host_us"),
    column("host us after sync", "host_us_after_sync", "{:.1f}"),
    column("target us", "target_us", "{:.0f}"),
]

# What each row must stay under: dispatch and combine, and DeepEP's layout back to back (4x H200, 2026-11-26).
TARGETS_US = {"dispatch bf16 (host)": 25.0, "combine bf16 (host)": 20.0, "combine bf16, top-k weights (host)": 20.0,
              "combine bf16, top-k weights, 128 tokens (host)": 20.0, "combine bf16, rings (host)": 20.0,
              "layout back to back (host)": layout.DEEPEP_BACK_TO_BACK_US}
LAYOUT_RUNS = 5


def measure(rank: int, world_size: int, quick: bool) -> List[Dict]:
    torch.manual_seed(rank)
    iters = 40 if quick else 400
    progress = Progress(3, "host", enabled=rank == 0)
    # DeepEP's own test's buffer, where combine first copies its rows into a
    # stage past the rings (copies the host enqueues), then one of the size
    # Config's hint gives, as frameworks size it, where combine runs on its rings.
    progress.step("dispatch and combine")
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=intranode.NVL_BYTES)
    rows = intranode.host_times(buffer, iters)
    # A small batch, where the host sets the pace: a middle rank's stage takes its own rows along.
    for row in intranode.host_times(buffer, iters, only=("combine bf16, top-k weights",), tokens=128):
        rows.append(dict(row, op="combine bf16, top-k weights, 128 tokens (host)"))
    progress.step("combine on the rings")
    hint = intranode.config_for(intranode.MAIN_SMS).get_nvl_buffer_size_hint(intranode.HIDDEN * 2, world_size)
    rings = Buffer(dist.group.WORLD, num_nvl_bytes=hint)
    for row in intranode.host_times(rings, iters, only=("combine bf16",)):
        rows.append(dict(row, op="combine bf16, rings (host)"))
    progress.step("layout back to back")
    topk_idx = layout.routing(layout.MAIN_TOKENS)
    calls = layout.BACK_TO_BACK_CALLS // 4 if quick else layout.BACK_TO_BACK_CALLS
    runs = [time_back_to_back(lambda: buffer.get_dispatch_layout(topk_idx, layout.NUM_EXPERTS), calls, 50)
            for _ in range(LAYOUT_RUNS)]
    rows.append({"op": "layout back to back (host)", "tokens": layout.MAIN_TOKENS,
                 "host_us": statistics.median(runs), "host_us_after_sync": None})
    progress.close()
    for row in rows:
        row["bench"] = "host"
        row["target_us"] = TARGETS_US.get(row["op"])
    return rows


def run(num_ranks: Optional[int], quick: bool) -> List[Dict]:
    shared = gpus_shared(num_ranks or torch.cuda.device_count())
    rows = merge_ranks(run_on_local_gpus(measure, (quick,), num_ranks, "nccl"), "host_us", "host_us_after_sync")
    for row in rows:
        row["ranks_share_gpus"] = shared
    return rows
