"""Low-latency dispatch and combine at the extremes of the bounds the README
promises (hidden any multiple of 128 up to 16384, BF16 any multiple of 8;
top-k 1 to 16; num_max_dispatch_tokens_per_rank up to 1024; up to 1024
experts; UE8M0 with a hidden not a multiple of 512), one extreme at a time,
over every rank of the run (2, 4 or 8 ranks, which may all share one GPU).

Each case is checked as test_low_latency checks its cases: dispatch bitwise
against the host reference in canonical order, combine within the tolerance
of low_latency_cases. With UE8M0 and a hidden that is no multiple of 512 the
reference gives float scales only; the packed words are checked against their
exponent bytes, the bytes past the last group zero (low_latency_cases.ue8m0_words).

Memory per rank: a Buffer keeps one output set per dispatch shape for its
lifetime, so every case's E * M * H stays small (at most 2^23 elements: its
[L, M*R, H] expert rows are at most 16 MiB of BF16) and all the cases' output
sets together, plus the largest case's expert rows, come to about 150 MiB
(case_bytes; a guard asserts at most 200 MiB), which 8 ranks on one 80 GB GPU
can afford. The Buffer is sized with the largest per-case size hint (36, 40,
48 MiB at 2, 4, 8 ranks), not with the hint of the largest M, hidden and
experts taken together (1.1 to 1.5 GiB).
"""
from low_latency_cases import LLCase, fit_cases, round_trip, size_hint, world

# (case, round_trip's combine options): one extreme per group.
CASES = (
    # hidden 16384, the largest: BF16 rows of 32 KiB; FP8 with 128 float scales
    # per row (32 16-byte words: every lane of a warp); UE8M0, 32 packed words.
    (LLCase("uniform", 24, 32, 16384, 8, 16, "bf16"), dict(stats=True)),
    (LLCase("uniform", 32, 32, 16384, 8, 16, "fp8"), dict(weights_at_dispatch=True)),
    (LLCase("uniform", 16, 16, 16384, 9, 16, "ue8m0"), dict(logfmt=True, zero_copy=True)),
    # BF16 hiddens that are multiples of 8 but not of 128: one 16-byte word per
    # row (8), 1000, and the largest below 16384 (16376).
    (LLCase("uniform", 64, 64, 8, 8, 64, "bf16"), dict()),
    (LLCase("uniform", 48, 64, 1000, 9, 64, "bf16"), dict(weights_at_dispatch=True, use_out=True)),
    (LLCase("holes", 16, 16, 16376, 8, 16, "bf16"), dict(zero_copy=True)),
    # top-16, the largest: uniform over 64 experts; every token's 16 experts on
    # one rank (128 experts: at least 16 per rank at 8 ranks), so one message
    # carries 16 entries, pre-reduced there; a token naming an expert twice.
    (LLCase("uniform", 32, 32, 2048, 16, 64, "fp8"), dict(stats=True)),
    (LLCase("one_rank", 32, 32, 2048, 16, 128, "bf16"), dict(weights_at_dispatch=True)),
    (LLCase("one_rank", 24, 32, 1024, 16, 128, "fp8_round"), dict()),
    (LLCase("duplicates", 32, 32, 1024, 16, 64, "ue8m0"), dict(logfmt=True)),
    # num_max_dispatch_tokens_per_rank 1024 with T = 1024: uniform top-8; and
    # every token of every rank to one expert, which receives M * R rows (all
    # its rows).
    (LLCase("uniform", 1024, 1024, 256, 8, 16, "bf16"), dict(weights_at_dispatch=True, stats=True)),
    (LLCase("one_expert", 1024, 1024, 128, 8, 16, "fp8"), dict(logfmt=True)),
    # Token bits too many for the dispatch receive's shared memory (128
    # experts x 32 words = 4,096, over its 2,048): read from the region.
    (LLCase("uniform", 600, 1024, 64, 8, 128, "bf16"), dict()),
    # 1024 experts (512, 256, 128 per rank at 2, 4, 8 ranks): FP8 top-8; -1
    # slots with top-16 and pre-reduced combine; UE8M0 top-16.
    (LLCase("uniform", 16, 16, 256, 8, 1024, "fp8"), dict(stats=True)),
    (LLCase("holes", 8, 8, 128, 16, 1024, "bf16"), dict(weights_at_dispatch=True, logfmt=True)),
    (LLCase("uniform", 16, 16, 512, 16, 1024, "ue8m0"), dict(zero_copy=True, use_out=True)),
    # UE8M0 with a hidden that is no multiple of 512: 1 group of 4 in the last
    # word (128, 640), 3 of 4 (1408).
    (LLCase("uniform", 32, 32, 640, 8, 64, "ue8m0"), dict()),
    (LLCase("uniform", 32, 32, 128, 8, 64, "ue8m0"), dict(weights_at_dispatch=True)),
    (LLCase("skip_rank", 32, 32, 1408, 8, 64, "ue8m0"), dict(logfmt=True, stats=True)),
)

MAX_RANKS = 8
MAX_ELEMENTS = 1 << 23   # E * M * H of any one case
MAX_TOTAL_BYTES = 200 << 20  # what one rank holds at most over the whole run (see case_bytes)


def case_bytes(case: LLCase, options: dict) -> tuple:
    """(bytes the Buffer keeps for the rest of its life, bytes alive during the
    case only) on one rank, whatever the rank count: one output set (recv_x,
    its scales, src_info; the plan and layout_range are small beside them)
    plus, with zero_copy, its combine buffer; the expert outputs y ([L, M*R, H]
    bf16) while the case runs."""
    rows = case.experts * case.max_tokens  # L * M * R
    groups = case.hidden // 128
    kept = rows * case.hidden * (1 if case.use_fp8 else 2) + rows * 4
    if case.use_fp8:
        kept += rows * 4 * ((groups + 3) // 4 if case.use_ue8m0 else groups)
    if options.get("zero_copy"):
        kept += rows * case.hidden * 2
    return kept, rows * case.hidden * 2


def say(ctx, line: str) -> None:
    if ctx.rank == 0:
        print(line, flush=True)


def test_low_latency_bounds(ctx):
    """Every case of CASES that fits the run's rank count, in turn, on one Buffer."""
    n, g = world(ctx)
    if n > MAX_RANKS:
        ctx.skip(f"the bounds are for at most {MAX_RANKS} ranks; this run has {n}")
    cases, left_out = fit_cases([c for c, _ in CASES], n)
    if not cases:
        ctx.skip(f"no case fits {n} ranks: {left_out}")
    # The shapes' memory: a guard on CASES, so that an edit cannot make 8 ranks overflow one GPU.
    sizes = [case_bytes(c, o) for c, o in CASES]
    for case, _ in CASES:
        assert case.experts * case.max_tokens * case.hidden <= MAX_ELEMENTS, \
            f"{case}: E * M * H = {case.experts * case.max_tokens * case.hidden} > {MAX_ELEMENTS}"
    total = sum(kept for kept, _ in sizes) + max(live for _, live in sizes)
    assert total <= MAX_TOTAL_BYTES, f"the cases need {total / 2**20:.0f} MiB per rank, over {MAX_TOTAL_BYTES >> 20}"
    rdma = max(size_hint([c], n) for c in cases)
    say(ctx, f"n={n}: {len(cases)} of {len(CASES)} cases, num_rdma_bytes {rdma / 2**20:.1f} MiB, outputs and "
        f"expert rows at most {total / 2**20:.1f} MiB per rank")
    with ctx.buffer(g, num_rdma_bytes=rdma, low_latency_mode=True) as buf:
        assert buf.low_latency_mode and buf.group_size == n, "low_latency_mode / group_size"
        for i, ((case, options), (kept, live)) in enumerate(zip(CASES, sizes)):
            if case not in cases:
                continue
            what = f"n={n} case {i} ({case}) combine {options}"
            say(ctx, f"{what}: kept {kept / 2**20:.2f} MiB, expert rows {live / 2**20:.2f} MiB per rank")
            round_trip(ctx, buf, case, n, what, **options)
    if left_out:
        ctx.skip(f"ran the {len(cases)} cases that fit {n} ranks; these cannot run: {left_out}")


# The cases take seconds in all on 8 ranks sharing one GPU (the host reference
# dominates). A rank that fails a dispatch check skips that case's combine, and
# its peers give up on it after the buffer's timeout (100 s): that must still
# end within the deadline, as a failure rather than a hang.
test_low_latency_bounds.timeout = 300
