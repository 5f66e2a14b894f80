#!/usr/bin/env bash
# On a GPU host: build and run every test (scripts/test.sh, GPU suite included),
# then the GPU suite again at other rank counts, then the benchmarks; logs and
# JSON go to $OUT (or build/out). Prints a short summary last.
#
#   SUITE_RANKS="2 8"      extra GPU-suite runs, one per rank count ("" for none)
#   SHARED_RANKS="2 4 8"   GPU-suite runs with all ranks sharing one GPU, one per rank count:
#                          side by side on GPUs 0, 1, ... where there are enough, else in turns on GPU 0
#   SUITE_ARGS="-x test_intranode::"  passed to those runs (-k / -x pick tests)
#   BENCH_ARGS="intranode" what to bench (default: everything; "none" to skip)
#   SKIP_TEST_SH=1         skip scripts/test.sh (the build still happens)
#   BASELINE=DIR           also bench an earlier tree (a copy of it in DIR, e.g. from
#                          `git archive REV`) with this tree's bench, in the same run
#   BASELINE_OWN_BENCH=1   with BASELINE: the earlier tree's own bench, for a library whose native
#                          calls this tree's bench no longer makes (the 2026-11-26 code's)
#   BASELINE_BENCH_ARGS="intranode layout"  with BASELINE: what it benches (default: BENCH_ARGS),
#                          for an older bench's subcommands and options
#   RINGS=1                also bench this tree with every intranode op on its rings
#                          (TURNOUT_COMBINE_STAGES=0 TURNOUT_DISPATCH_LANDING=0), before and
#                          after the default bench, into bench-rings-{1,2}.json
#   GRAPHS_OFF=1           also bench this tree with every op's calls enqueued one by one
#                          (TURNOUT_OP_GRAPHS=0), after the default bench, into bench-graphs-off.json
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${OUT:-build/out}"
out=$(cd "${OUT:-build/out}" && pwd)  # absolute: the bench runs from /tmp
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
bench_args=${BENCH_ARGS:-}
suite_ranks=${SUITE_RANKS-}
shared_ranks=${SHARED_RANKS-}

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$out/gpus.txt" 2>&1
nvidia-smi topo -m > "$out/topology.txt" 2>&1
start=$(date +%s)
if [ -n "${SKIP_TEST_SH:-}" ]; then
  python3 -m pip install --quiet --root-user-action=ignore --no-build-isolation --no-deps . -Cbuild-dir=build/test \
    -Ccmake.define.TURNOUT_BUILD_TESTS=ON > "$out/test.log" 2>&1
else
  bash scripts/test.sh > "$out/test.log" 2>&1
fi
test_status=$?
test_s=$(($(date +%s) - start))
suite_lines=()
for n in $suite_ranks; do
  start=$(date +%s)
  python3 tests/gpu/run.py --ranks "$n" ${SUITE_ARGS:-} > "$out/suite-$n.log" 2>&1
  suite_lines+=("GPU suite --ranks $n: exit $? after $(($(date +%s) - start)) s: $(tail -n 1 "$out/suite-$n.log")")
done
# The suite scripts/test.sh already ran: its ranks (TURNOUT_TEST_RANKS, else the
# visible GPUs, at least 4), all on GPU 0 where only one is visible.
gpus=$(wc -l < "$out/gpus.txt")
ran_by_test_sh=""
[ -z "${SKIP_TEST_SH:-}" ] && [ "$gpus" = 1 ] && ran_by_test_sh=${TURNOUT_TEST_RANKS:-4}
# Side by side, each on a GPU of its own, where the host has a GPU for each
# (the MPS daemon of a run on GPU k > 0 sees every GPU, so that its ranks find
# GPU k); else in turns on GPU 0.
shared_list=()
for n in $shared_ranks; do
  if [ "$n" = "$ran_by_test_sh" ] && [ -z "${SUITE_ARGS:-}" ]; then
    suite_lines+=("GPU suite --ranks $n, all on GPU 0: run by scripts/test.sh above, not again")
    continue
  fi
  shared_list+=("$n")
done
side_by_side=0
[ "${#shared_list[@]}" -gt 1 ] && [ "$gpus" -ge "${#shared_list[@]}" ] && side_by_side=1
i=0
for n in "${shared_list[@]}"; do
  gpu=$((side_by_side ? i : 0))
  (
    start=$(date +%s)
    CUDA_VISIBLE_DEVICES=$gpu python3 tests/gpu/run.py --ranks "$n" ${SUITE_ARGS:-} > "$out/shared-$n.log" 2>&1
    echo "GPU suite --ranks $n, all on GPU $gpu: exit $? after $(($(date +%s) - start)) s: $(tail -n 1 "$out/shared-$n.log")" \
      > "$out/shared-$n.line"
  ) &
  [ "$side_by_side" = 1 ] || wait $!
  i=$((i + 1))
done
wait
for n in "${shared_list[@]}"; do suite_lines+=("$(cat "$out/shared-$n.line")"); done
bench_status=skipped
baseline_status=skipped
if [ "$bench_args" != none ] && [ -n "${BASELINE:-}" ]; then
  # The earlier library with this tree's bench over it (both sides time the same figures), or with its own.
  site=/tmp/turnout-baseline
  rm -rf "$site" && python3 -m pip install --quiet --root-user-action=ignore --no-build-isolation --no-deps \
    --target "$site" "$(cd "$BASELINE" && pwd)" -Cbuild-dir=/tmp/turnout-baseline-build > "$out/baseline-build.log" 2>&1 &&
    { [ -n "${BASELINE_OWN_BENCH:-}" ] || { rm -rf "$site/turnout/bench" && cp -r python/turnout/bench "$site/turnout/bench"; }; } &&
    (cd /tmp && PYTHONPATH="$site" python3 -m turnout.bench ${BASELINE_BENCH_ARGS:-$bench_args} \
      --json "$out/bench-baseline.json") > "$out/bench-baseline.log" 2>&1
  baseline_status=$?
fi
rings_status=skipped
rings_bench() {
  (cd /tmp && TURNOUT_COMBINE_STAGES=0 TURNOUT_DISPATCH_LANDING=0 python3 -m turnout.bench $bench_args \
    --json "$out/bench-rings-$1.json") > "$out/bench-rings-$1.log" 2>&1
  rings_status="$rings_status $?"
}
[ "$bench_args" != none ] && [ -n "${RINGS:-}" ] && { rings_status=exit; rings_bench 1; }
if [ "$bench_args" != none ]; then
  (cd /tmp && python3 -m turnout.bench $bench_args --json "$out/bench.json") > "$out/bench.log" 2>&1
  bench_status=$?
fi
[ "$bench_args" != none ] && [ -n "${RINGS:-}" ] && rings_bench 2
graphs_off_status=skipped
if [ "$bench_args" != none ] && [ -n "${GRAPHS_OFF:-}" ]; then
  (cd /tmp && TURNOUT_OP_GRAPHS=0 python3 -m turnout.bench $bench_args --json "$out/bench-graphs-off.json") \
    > "$out/bench-graphs-off.log" 2>&1
  graphs_off_status=$?
fi

echo "== test.log (tail)"; tail -n 40 "$out/test.log"
for n in $suite_ranks; do echo "== suite-$n.log (FAIL/SKIP lines)"; grep -E "^(FAIL|SKIP) " "$out/suite-$n.log"; done
for n in $shared_ranks; do echo "== shared-$n.log (FAIL/SKIP lines)"; grep -E "^(FAIL|SKIP) " "$out/shared-$n.log" 2>/dev/null; done
[ -f "$out/bench-baseline.log" ] && { echo "== bench-baseline.log (tail)"; tail -n 40 "$out/bench-baseline.log"; }
for f in "$out"/bench-rings-*.log "$out"/bench-graphs-off.log; do [ -f "$f" ] && { echo "== $(basename "$f") (tail)"; tail -n 40 "$f"; }; done
[ -f "$out/bench.log" ] && { echo "== bench.log (tail)"; tail -n 40 "$out/bench.log"; }
echo "== summary"
cat "$out/gpus.txt"
grep -E "tests passed|passed, .* failed|[0-9]+ passed|FAIL |GPU suite:" "$out/test.log" | tail -n 8
for line in "${suite_lines[@]}"; do echo "$line"; done
echo "scripts/test.sh: exit $test_status after ${test_s} s; bench: exit $bench_status; baseline bench: exit $baseline_status;" \
  "rings bench: $rings_status; graphs-off bench: $graphs_off_status"
