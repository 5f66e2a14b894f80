"""Low-latency mode at scale, on paper: per GPU and per call, what crosses the
network (the NIC) when ranks in the same NVL domain talk over NVLink and the
others over RDMA, for turnout's protocol (one message per (token, destination
rank), pre-reduced combine, combine weights published to every rank) beside a
one-message-per-(token, expert) protocol like DeepEP's, and the latency floor
that the NIC's bandwidth sets. Routing: top-k of E experts drawn uniformly
without replacement (expected values, exact). Prints a Markdown table.

    python3 scripts/low_latency_scale.py [--tokens 128] [--hidden 7168] [--experts 256] [--topk 8]
        [--domain 8] [--gbps 400]
"""
import argparse
from math import comb

# Bytes per message, as in python/turnout/bench/wire.py.
HEADER_BYTES = 144         # turnout's dispatch header
PER_EXPERT_HEADER = 16     # a one-row-per-expert protocol's per-message info
TAGGED_WEIGHT_BYTES = 8    # one published combine weight

# DeepEP V1's published low-latency figures (H800, CX7 400 Gb/s, 128 tokens, hidden 7168,
# top-8 of 256, FP8 dispatch, BF16 combine): EP -> (dispatch us, combine us).
DEEPEP_US = {16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369), 256: (194, 360)}


def expected(num_ranks: int, domain: int, experts: int, topk: int) -> dict:
    """Per token: expected (destination ranks, experts) outside the sender's NVL domain."""
    per_rank = experts // num_ranks
    p_rank = 1 - comb(experts - per_rank, topk) / comb(experts, topk)
    remote_ranks = num_ranks - domain
    return {"ranks": remote_ranks * p_rank, "experts": topk * remote_ranks / num_ranks,
            "domains": (num_ranks // domain - 1) * (1 - comb(experts - per_rank * domain, topk) / comb(experts, topk))}


def rows(tokens: int, hidden: int, experts: int, topk: int, domain: int, gbps: float):
    fp8 = hidden + hidden // 128 * 4
    bf16 = 2 * hidden
    nic = gbps / 8 * 1e9  # bytes per second, one direction
    for ep in sorted(DEEPEP_US):
        e = expected(ep, domain, experts, topk)
        ours_d = tokens * e["ranks"] * (HEADER_BYTES + fp8)
        ref_d = tokens * e["experts"] * (fp8 + PER_EXPERT_HEADER)
        weights = (ep - domain) * tokens * topk * TAGGED_WEIGHT_BYTES
        ours_c = tokens * e["ranks"] * bf16 + weights
        ref_c = tokens * e["experts"] * bf16
        yield {
            "ep": ep, "hosts": ep // domain,
            "msgs_ours": tokens * e["ranks"], "msgs_ref": tokens * e["experts"],
            "disp_ours": ours_d, "disp_ref": ref_d, "comb_ours": ours_c, "comb_ref": ref_c,
            "floor_d": ours_d / nic * 1e6, "floor_d_ref": ref_d / nic * 1e6,
            "floor_c": ours_c / nic * 1e6, "floor_c_ref": ref_c / nic * 1e6,
            "peers": ep - domain, "deepep": DEEPEP_US[ep],
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--domain", type=int, default=8, help="GPUs per NVL domain (host)")
    parser.add_argument("--gbps", type=float, default=400.0, help="NIC bandwidth per GPU, Gb/s")
    a = parser.parse_args()
    mib = 1 << 20
    print(f"{a.tokens} tokens per rank, hidden {a.hidden}, top-{a.topk} of {a.experts} experts, NVL domains of "
          f"{a.domain}, {a.gbps:g} Gb/s per GPU; per GPU and call, network only (expected values)\n")
    print("| EP | hosts | remote peers | messages, ours / per expert | dispatch FP8 MiB, ours / per expert | "
          "combine BF16 MiB, ours / per expert | floor dispatch us, ours / per expert | "
          "floor combine us, ours / per expert | DeepEP measured dispatch / combine us |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows(a.tokens, a.hidden, a.experts, a.topk, a.domain, a.gbps):
        print(f"| {r['ep']} | {r['hosts']} | {r['peers']} | {r['msgs_ours']:.0f} / {r['msgs_ref']:.0f} | "
              f"{r['disp_ours'] / mib:.2f} / {r['disp_ref'] / mib:.2f} | {r['comb_ours'] / mib:.2f} / "
              f"{r['comb_ref'] / mib:.2f} | {r['floor_d']:.0f} / {r['floor_d_ref']:.0f} | "
              f"{r['floor_c']:.0f} / {r['floor_c_ref']:.0f} | {r['deepep'][0]} / {r['deepep'][1]} |")


if __name__ == "__main__":
    main()
