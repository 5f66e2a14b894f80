"""Where the intranode warps' time goes, per op, SM count and role.

Dispatch (BF16, FP8) and combine at the bench's shape (4096 tokens, hidden
7168, top-8 of 256 experts), eager calls each after an L2 flush, in a build
with the CMake option TURNOUT_INTRANODE_STAMPS
(``pip install . -Ccmake.define.TURNOUT_INTRANODE_STAMPS=ON``). Every warp of
the send blocks, the dispatch receive blocks, the warps that copy a rank's
own tokens and combine's reducers prints the SM cycles it spent in each part
of its work (src/kernels/intranode/warp_stamps.cuh). Per SM count, op and role this prints
the warps' median rows and time, each part's share of the warps' time, and the
time a row takes a warp (a reducer's rows are its tokens).

    python scripts/intranode_stamps.py [--ranks N] [--sms 12,24] [--calls C] [--chunk 8]
"""
import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from low_latency_timeline import printed_by  # noqa: E402

PREFIX = "turnout-intranode-stamps "
NUM_PARTS = 5
# The parts of a warp's time, by role, in warp_stamps.cuh's order (None: a part the role does not mark).
PARTS = {
    "send": ["walk and other", "waiting for ring room", "row loads and stores issued", "small parts' stores",
             "round ends (barrier, tail release)"],
    "receive": ["other", "waiting for a tail and the group", "rows copied out", None,
                "slots handed back (barrier, head release)"],
    "own": ["walk and other", None, "rows copied", None, None],
    "reduce": ["walk and other", "waiting for the rows' tails", "rows loaded, summed and stored", "top-k weights",
               "progress posted"],
}


def parse(lines: list) -> list:
    """One dict per warp line: op, role, rank, channel, warp, peer, rows, the
    span in us (global timer) and each part in us (SM cycles over the rate
    the line's own span gives; the median rate of the others for a span too
    short to time)."""
    raw = []
    for line in lines:
        if not line.startswith(PREFIX):
            continue
        f = line.split()
        if len(f) != 10 + NUM_PARTS:
            continue
        cycles = [int(c) for c in f[10:]]
        raw.append({"op": f[1], "role": f[2], "rank": int(f[3]), "channel": int(f[4]), "warp": int(f[5]),
                    "peer": int(f[6]), "rows": int(f[7]), "span_ns": int(f[9]) - int(f[8]), "cycles": cycles})
    rates = [sum(w["cycles"]) / w["span_ns"] for w in raw if w["span_ns"] >= 2000 and sum(w["cycles"]) > 0]
    if not rates:
        return []
    fallback = statistics.median(rates)
    out = []
    for w in raw:
        total = sum(w["cycles"])
        rate = total / w["span_ns"] if w["span_ns"] >= 2000 and total > 0 else fallback
        parts = [c / rate / 1e3 for c in w.pop("cycles")]
        out.append(dict(w, parts_us=parts, total_us=sum(parts)))
    return out


def summarize(warps: list) -> dict:
    """Per role: warps, median rows and time, each part's share of all the
    warps' time and its median, and the median time per row of the warps that
    moved rows."""
    by_role = defaultdict(list)
    for w in warps:
        by_role[w["role"]].append(w)
    out = {}
    for role, ws in by_role.items():
        total = sum(w["total_us"] for w in ws)
        per_row = [w["total_us"] / w["rows"] for w in ws if w["rows"] > 0]
        out[role] = {
            "warps": len(ws),
            "rows": statistics.median(w["rows"] for w in ws),
            "total_us": statistics.median(w["total_us"] for w in ws),
            "share": [sum(w["parts_us"][k] for w in ws) / total if total > 0 else 0.0 for k in range(NUM_PARTS)],
            "part_us": [statistics.median(w["parts_us"][k] for w in ws) for k in range(NUM_PARTS)],
            "us_per_row": statistics.median(per_row) if per_row else None,
        }
    return out


def measure(rank: int, world_size: int, sms: list, calls: int, chunk: int) -> dict:
    import torch
    import torch.distributed as dist

    from turnout import Buffer
    from turnout.bench import intranode as bench

    torch.manual_seed(rank)
    buffer = Buffer(dist.group.WORLD,
                    num_nvl_bytes=bench.config_for(max(sms), chunk).get_nvl_buffer_size_hint(bench.HIDDEN * 2,
                                                                                              world_size))
    topk_idx, topk_weights, x, x_fp8 = bench.inputs(bench.MAIN_TOKENS)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, bench.NUM_EXPERTS)
    flush = torch.empty(bench.FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    results = {}
    for num_sms in sms:
        config = bench.config_for(num_sms, chunk)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=topk_idx, topk_weights=topk_weights, config=config)
        handle = []
        printed_by(lambda: handle.append(buffer.dispatch(x, **layout)))
        recv_x, h = handle[0][0], handle[0][4]
        ops = {"dispatch bf16": lambda: buffer.dispatch(x, **layout),
               "dispatch fp8": lambda: buffer.dispatch(x_fp8, **layout),
               "combine bf16": lambda: buffer.combine(recv_x, h, config=config)}
        for op, fn in ops.items():
            printed_by(lambda: [fn() for _ in range(2)])  # warm-up; its lines dropped

            def run():
                for _ in range(calls):
                    flush.zero_()
                    dist.barrier()
                    fn()
                    torch.cuda.synchronize()

            text = printed_by(run)
            buffer.check_errors()
            results[(num_sms, op)] = summarize(parse(text.splitlines()))
    return results


def report(per_rank: list, calls: int) -> None:
    for num_sms, op in per_rank[0]:
        print(f"== {op}, {num_sms} SMs: {calls} calls a rank, {len(per_rank)} ranks")
        roles = sorted({role for r in per_rank for role in r[(num_sms, op)]})
        if not roles:
            print("  no stamps: build with -Ccmake.define.TURNOUT_INTRANODE_STAMPS=ON")
            continue
        for role in roles:
            got = [r[(num_sms, op)][role] for r in per_rank if role in r[(num_sms, op)]]
            us_row = [g["us_per_row"] for g in got if g["us_per_row"] is not None]
            row_text = f", {statistics.median(us_row):.2f} us a row" if us_row else ""
            rows = statistics.median(g["rows"] for g in got)
            total = statistics.median(g["total_us"] for g in got)
            print(f"  {role}: {sum(g['warps'] for g in got)} warps, median {rows:.0f} rows and {total:.1f} us a warp"
                  f"{row_text}")
            for k, name in enumerate(PARTS.get(role, [f"part {k}" for k in range(NUM_PARTS)])):
                if name is None:
                    continue
                share = statistics.median(g["share"][k] for g in got)
                part = statistics.median(g["part_us"][k] for g in got)
                print(f"    {name:44s} {100 * share:5.1f}%   median {part:8.1f} us")


def main() -> None:
    from turnout.launch import run_on_local_gpus

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--sms", default="12,24", help="SM counts, comma-separated")
    parser.add_argument("--calls", type=int, default=3, help="stamped calls per op and SM count")
    parser.add_argument("--chunk", type=int, default=8, help="the config's send chunk")
    args = parser.parse_args()
    sms = [int(s) for s in args.sms.split(",")]
    report(run_on_local_gpus(measure, (sms, args.calls, args.chunk), args.ranks, "nccl"), args.calls)


if __name__ == "__main__":
    main()
