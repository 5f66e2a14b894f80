"""intranode: normal dispatch (BF16, FP8) and combine (BF16) on one host, as
docs/PERFORMANCE.md describes them: 4096 tokens per rank, hidden 7168, top-8 of 256
experts, uniform load; each call timed alone with CUDA events after an L2
flush; median of 50 after 50 warm-ups. Bandwidth is the logical figure:
bytes this rank receives (its own tokens included) over the call's time.
Then sweeps over tokens, SMs and the config's send chunk (with the best chunk
of each op, as DeepEP's own test reports its figures), and the host time of
one call."""
import statistics
import time
from typing import Collection, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import Config
from ..buffer import Buffer
from ..launch import gpus_shared, run_on_local_gpus
from ..ops import intranode as intranode_ops
from .progress import Progress
from .report import NVLINK_RAW_GBPS, column, pct_of_raw, range_column
from .timing import merge_ranks, time_each

TITLE = (f"intranode: dispatch / combine, hidden 7168, top-8 of 256 experts; logical GB/s per rank (median over "
         f"ranks), % of NVLink raw {NVLINK_RAW_GBPS:.0f} GB/s; target >= 450 GB/s with <= 24 SMs")

COLUMNS = [
    column("op", "op"),
    column("tokens", "tokens"),
    column("SMs", "num_sms"),
    column("SMs used", "sms_used"),
    column("chunk", "chunk"),
    column("time us", "time_us", "{:.1f}"),
    column("GB/s", "gbps", "{:.1f}"),
    range_column("GB/s over ranks", "gbps"),
    column("% of raw", "pct_of_raw", "{:.1f}"),
    column("host us", "host_us", "{:.1f}"),
    column("host us after sync", "host_us_after_sync", "{:.1f}"),
]

HIDDEN, NUM_EXPERTS, NUM_TOPK = 7168, 256, 8
MAIN_TOKENS, MAIN_SMS = 4096, 24
# DeepEP's default Buffer.num_sms: few enough channels that a dispatch past its
# counts lands its rows (no rings), so its host time is that path's.
DEFAULT_SMS = 20
SWEEP_TOKENS = (128, 512, 1024, 2048, 4096, 8192)
SWEEP_SMS = (8, 12, 16, 20, 24, 32)
# The config's send chunk (num_max_nvl_chunked_send_tokens): the bench's own,
# and the sweep's at 4096 tokens with 24 and 12 SMs.
CHUNK = 8
SWEEP_CHUNKS = (4, 8, 12, 16, 24, 32)
CHUNK_SMS = (MAIN_SMS, 12)
FLUSH_BYTES = 256 << 20
# The buffer of DeepEP's own intranode test: past the rings it holds combine's
# stages of up to 4096 tokens a rank at EP4 (combine pulls the rows from them).
NVL_BYTES = 10**9
OPS = ("dispatch bf16", "dispatch fp8", "combine bf16")
BURST = 5  # host-time calls issued back to back


def config_for(num_sms: int, chunk: int = CHUNK) -> Config:
    return Config(num_sms, chunk, 256)


def inputs(num_tokens: int, hidden: int = HIDDEN, num_experts: int = NUM_EXPERTS, num_topk: int = NUM_TOPK):
    """(topk_idx, topk_weights, x in BF16, x in FP8 with column-major scales), uniform load."""
    scores = torch.randn(num_tokens, num_experts, device="cuda").abs() + 1
    topk_idx = scores.topk(num_topk, dim=-1).indices
    topk_weights = torch.rand(num_tokens, num_topk, device="cuda")
    x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    x_fp8 = (torch.randint(0, 120, (num_tokens, hidden), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn),
             torch.rand(hidden // 128, num_tokens, device="cuda").t())
    return topk_idx, topk_weights, x, x_fp8


def measure_point(buffer: Buffer, num_tokens: int, num_sms: int, iters: int, warmup: int, flush,
                  chunk: int = CHUNK) -> List[Dict]:
    topk_idx, topk_weights, x, x_fp8 = inputs(num_tokens)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    config = config_for(num_sms, chunk)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=topk_weights, config=config)
    out = buffer.dispatch(x, **layout)
    recv_x, handle = out[0], out[4]
    num_recv = recv_x.shape[0]
    rows = []
    calls = {
        "dispatch bf16": (lambda: buffer.dispatch(x, **layout), num_recv * HIDDEN * 2),
        "dispatch fp8": (lambda: buffer.dispatch(x_fp8, **layout), num_recv * HIDDEN * 2 * (1 + 4 / 128) / 2),
        "combine bf16": (lambda: buffer.combine(recv_x, handle, config=config), num_recv * HIDDEN * 2),
    }
    for op in OPS:
        fn, num_bytes = calls[op]
        t = statistics.median(time_each(fn, iters, warmup, before=flush.zero_))
        rows.append({"bench": "intranode", "op": op, "tokens": num_tokens, "num_sms": num_sms,
                     "sms_used": min(num_sms, buffer._native.sm_budget), "chunk": chunk, "time_us": t,
                     "recv_tokens": num_recv, "gbps": num_bytes / (t * 1e-6) / 1e9})
    return rows


def host_times(buffer: Buffer, iters: int, only: Optional[Collection[str]] = None,
               tokens: int = MAIN_TOKENS) -> List[Dict]:
    """CPU time of one call, without the host's wait for the receive counts:
    dispatch with num_worst_tokens (no wait), dispatch without it (its wait,
    as the native layer timed it, taken off; at MAIN_SMS on the rings and at
    DEFAULT_SMS through the landing areas), and combine. Calls come in
    bursts of ``BURST`` after the GPU drains and the ranks meet: "host us" is
    the median over the calls after the first of a burst (the host runs ahead
    of the GPU, as in a training step), "host us after sync" the median of the
    first calls, which also pay the host's wake-up from the wait for the GPU.

    The rows "... only" time parts of the first and last call, to tell where
    their host time goes: the native call alone (its outputs made once, its
    arguments ready), the outputs alone (made and freed as the op does), and
    the two stream joins around an op alone (two native calls, each an event
    record and a stream wait). ``only`` names the calls to time (all by default),
    ``tokens`` the tokens of each rank."""
    topk_idx, topk_weights, x, _ = inputs(tokens)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    config = config_for(MAIN_SMS)
    num_ranks = buffer.group_size
    worst = tokens * num_ranks
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=topk_weights, config=config)
    out = buffer.dispatch(x, **layout)
    native = buffer._native
    comm, caller = buffer._context.comm_raw, torch.cuda.current_stream().cuda_stream

    def outputs():  # what a dispatch with num_worst_tokens allocates, as it does
        return intranode_ops._receive_outputs(x.device, x, None, worst, HIDDEN, 0, NUM_TOPK, num_ranks, True)

    # The native calls as the ops make them (python/turnout/ops/intranode.py), into outputs made once.
    recv_x, _, recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx, prefix = outputs()
    dispatch_args = (x.data_ptr(), tokens, HIDDEN * 2, 0, 0, 0, 0, topk_idx.data_ptr(), topk_weights.data_ptr(),
                     NUM_TOPK, NUM_EXPERTS, per_expert.data_ptr(), 1, in_rank.data_ptr(), prefix.data_ptr(), worst,
                     worst, config, recv_x.data_ptr(), 0, recv_topk_idx.data_ptr(), recv_topk_weights.data_ptr(),
                     recv_src_idx.data_ptr(), source_num_tokens.data_ptr(), caller, None, None)
    handle = out[4]
    combined_x = out[0].new_empty(tokens, HIDDEN)
    combine_args = (out[0].data_ptr(), out[0].shape[0], HIDDEN, 0, 0, 0, 0, handle[0].data_ptr(), handle[1].data_ptr(),
                    handle[3].data_ptr(), handle[4].data_ptr(), tokens, config, combined_x.data_ptr(), 0,
                    *handle._own_rows, caller, None, None)
    default_layout = dict(layout, config=config_for(DEFAULT_SMS))
    # (call, whether it waits for the counts on the host); the joins are what a
    # plain op paid before it ran on the caller's stream, and one on a stream switch does.
    calls = {"dispatch bf16": (lambda: buffer.dispatch(x, num_worst_tokens=worst, **layout), False),
             "dispatch bf16, native call only": (lambda: native.dispatch_known_rows(*dispatch_args), False),
             "dispatch bf16, outputs only": (outputs, False),
             "dispatch bf16, counts waited for": (lambda: buffer.dispatch(x, **layout), True),
             "dispatch bf16, counts waited for, landing": (lambda: buffer.dispatch(x, **default_layout), True),
             "combine bf16": (lambda: buffer.combine(out[0], out[4], config=config), False),
             "combine bf16, top-k weights": (lambda: buffer.combine(out[0], out[4], out[2], config=config), False),
             "combine bf16, native call only": (lambda: native.combine(*combine_args), False),
             "stream joins only": (lambda: (native.join(comm, caller), native.join(caller, comm)), False)}
    sms_of = {"dispatch bf16, counts waited for, landing": DEFAULT_SMS}  # the others: MAIN_SMS
    rows = []
    for op, (fn, waits) in calls.items():
        if only is not None and op not in only:
            continue
        first, warm = [], []
        for _ in range(max(1, iters // BURST)):
            torch.cuda.synchronize()
            dist.barrier()
            for i in range(BURST):
                start = time.perf_counter()
                fn()
                host_s = time.perf_counter() - start - (native.last_host_wait_s if waits else 0)
                (warm if i else first).append(host_s * 1e6)
        torch.cuda.synchronize()
        num_sms = sms_of.get(op, MAIN_SMS)
        rows.append({"bench": "intranode", "op": f"{op} (host)", "tokens": tokens, "num_sms": num_sms,
                     "sms_used": min(num_sms, native.sm_budget), "host_us": statistics.median(warm),
                     "host_us_after_sync": statistics.median(first)})
    return rows


def measure(rank: int, world_size: int, quick: bool) -> List[Dict]:
    warmup, iters = (5, 10) if quick else (50, 50)
    torch.manual_seed(rank)
    sweep_tokens = (1024, 4096) if quick else SWEEP_TOKENS
    sweep_sms = (12, 24) if quick else SWEEP_SMS
    sweep_chunks = (4, 16) if quick else SWEEP_CHUNKS
    points = [(MAIN_TOKENS, MAIN_SMS, CHUNK), (MAIN_TOKENS, 12, CHUNK)]
    points += [(t, MAIN_SMS, CHUNK) for t in sweep_tokens if (t, MAIN_SMS, CHUNK) not in points]
    points += [(MAIN_TOKENS, s, CHUNK) for s in sweep_sms if (MAIN_TOKENS, s, CHUNK) not in points]
    points += [(MAIN_TOKENS, s, c) for s in CHUNK_SMS for c in sweep_chunks if (MAIN_TOKENS, s, c) not in points]
    num_nvl_bytes = max(config_for(max(s for _, s, _ in points)).get_nvl_buffer_size_hint(HIDDEN * 2, world_size),
                        NVL_BYTES)
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    progress = Progress(len(points) + 1, "intranode", enabled=rank == 0)
    rows = []
    for num_tokens, num_sms, chunk in points:
        progress.step(f"{num_tokens} tokens, {num_sms} SMs, chunk {chunk}")
        rows += measure_point(buffer, num_tokens, num_sms, iters, warmup, flush, chunk)
    progress.step("host time")
    rows += host_times(buffer, 20 if quick else 200)
    progress.close()
    return rows


def best_chunks(rows: List[Dict]) -> List[Dict]:
    """For each op and SM count of the chunk sweep, a copy of its fastest
    row at 4096 tokens (median over ranks) named "<op>, best chunk"."""
    best = []
    for num_sms in CHUNK_SMS:
        for op in OPS:
            swept = [r for r in rows if r["op"] == op and r["tokens"] == MAIN_TOKENS and r["num_sms"] == num_sms
                     and r.get("gbps") is not None]
            if swept:
                best.append(dict(max(swept, key=lambda r: r["gbps"]), op=f"{op}, best chunk"))
    return best


def merge(per_rank: List[List[Dict]], shared: bool) -> List[Dict]:
    merged = merge_ranks(per_rank, "gbps", "time_us", "host_us", "host_us_after_sync")
    merged += best_chunks(merged)
    for row in merged:
        # Where ranks share a GPU no byte crosses NVLink.
        if row.get("gbps") is not None and not shared:
            row["pct_of_raw"] = pct_of_raw(row["gbps"])
        row["ranks_share_gpus"] = shared
    return merged


def run(num_ranks: Optional[int], quick: bool) -> List[Dict]:
    shared = gpus_shared(num_ranks or torch.cuda.device_count())
    return merge(run_on_local_gpus(measure, (quick,), num_ranks, "nccl"), shared)


def plot_series(rows: List[Dict]) -> Dict:
    series = []
    for op in OPS:
        pts = sorted((r["tokens"], r["gbps"]) for r in rows if r["op"] == op and r["num_sms"] == MAIN_SMS
                     and r.get("chunk") == CHUNK and r.get("gbps") is not None)
        series.append((f"{op}, {MAIN_SMS} SMs", [p[0] for p in pts], [p[1] for p in pts]))
    if rows and rows[0].get("ranks_share_gpus"):
        return {"series": series, "x": series[0][1], "xlabel": "tokens per rank",
                "ylabel": "logical GB/s per rank (ranks share a GPU)"}
    return {"series": series, "x": series[0][1], "xlabel": "tokens per rank", "ylabel": "logical GB/s per rank",
            "ref": (450.0, "target 450 GB/s")}
