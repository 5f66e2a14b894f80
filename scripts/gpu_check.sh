#!/usr/bin/env bash
# On a GPU host: build and run every test (scripts/test.sh, GPU suite included),
# then the benchmarks; logs and JSON go to $OUT (or build/out). Prints a short
# summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${OUT:-build/out}"
out=$(cd "${OUT:-build/out}" && pwd)  # absolute: the bench runs from /tmp
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
bench_args=${BENCH_ARGS:-}

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$out/gpus.txt" 2>&1
nvidia-smi topo -m > "$out/topology.txt" 2>&1
start=$(date +%s)
bash scripts/test.sh > "$out/test.log" 2>&1
test_status=$?
test_s=$(($(date +%s) - start))
(cd /tmp && python3 -m turnout.bench $bench_args --json "$out/bench.json") > "$out/bench.log" 2>&1
bench_status=$?

echo "== test.log (tail)"; tail -n 40 "$out/test.log"
echo "== bench.log (tail)"; tail -n 30 "$out/bench.log"
echo "== summary"
cat "$out/gpus.txt"
grep -E "tests passed|passed, .* failed|[0-9]+ passed|FAIL " "$out/test.log" | tail -n 8
echo "scripts/test.sh: exit $test_status after ${test_s} s; bench: exit $bench_status"
