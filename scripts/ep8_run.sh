#!/usr/bin/env bash
# The 8-GPU run, one rank per GPU, in one or two device calls (each at most 10
# minutes). Logs, JSON and PNG go to $OUT (or build/out); a short summary is
# printed last.
#
#   PART=suite   build, then the GPU suite at 8 ranks: every test, the kill
#                tests (time from a death to the survivors' completed call),
#                and the domain jobs (8 ranks as 2 hosts of 4 and 4 of 2, 16
#                ranks as 2 of 8), shortened by TURNOUT_DOMAIN_TESTS=short.
#                Longer than one call allows (on 4x H100 the 4-rank suite
#                with its domain jobs ran past 585 s), so in two calls:
#   PART=tests   build, then the suite without the domain jobs
#   PART=domains build, then the domain jobs alone (TURNOUT_DOMAIN_JOBS="8:4 16:8"
#                keeps some, for a call that must end sooner)
#   PART=bench   build, then `python -m turnout.bench` at EP8 (ceiling, layout,
#                intranode with its SM and token sweeps, low_latency with its
#                wire bytes), then low_latency (and internode, where this
#                tree has it) with the 8 GPUs declared as 2 hosts of 4 and 4 of
#                2: NVSHMEM over its P2P transport, labelled so
#   PART=all     both (default; longer than one call allows)
#   QUICK=1      the benches' --quick
set -uo pipefail
cd "$(dirname "$0")/.." || exit
mkdir -p "${OUT:-build/out}"
out=$(cd "${OUT:-build/out}" && pwd)  # absolute: the benches run from /tmp
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
part=${PART:-all}
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
lines=()

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$out/gpus.txt" 2>&1
nvidia-smi topo -m > "$out/topology.txt" 2>&1
gpus=$(wc -l < "$out/gpus.txt")
[ "$gpus" -ge 8 ] || lines+=("warning: $gpus GPUs visible; this run is meant for 8 (ranks will share GPUs)")
python3 -m pip install --quiet --root-user-action=ignore --no-build-isolation --no-deps . -Cbuild-dir=build/test \
  -Ccmake.define.TURNOUT_BUILD_TESTS=ON > "$out/build.log" 2>&1
lines+=("build: exit $?")

suite() {  # log name, then run.py's test selection
  local name=$1
  shift
  local start
  start=$(date +%s)
  TURNOUT_DOMAIN_TESTS=short python3 tests/gpu/run.py --ranks 8 "$@" > "$out/$name.log" 2>&1
  lines+=("GPU suite --ranks 8 $*: exit $? after $(($(date +%s) - start)) s: $(tail -n 1 "$out/$name.log")")
  while IFS= read -r kill_line; do lines+=("shrink: $kill_line"); done < <(grep -E "killed mid-call" "$out/$name.log")
}
domain_tests=test_low_latency_domains,test_internode_domains
case "$part" in
  suite | all) suite suite-8 ;;
  tests) suite suite-8-tests -x "$domain_tests" ;;
  domains) suite suite-8-domains -k "$domain_tests" ;;
esac

bench() {  # name, environment..., then -- and the bench's arguments
  local name=$1
  shift
  local env=()
  while [ "$1" != -- ]; do env+=("$1"); shift; done
  shift
  (cd /tmp && env "${env[@]}" python3 -m turnout.bench "$@" "${quick[@]}" --json "$out/ep8-$name.json") > "$out/ep8-$name.log" 2>&1
  lines+=("bench $name: exit $?")
}

if [ "$part" = bench ] || [ "$part" = all ]; then
  # Each rank on its GPU's CPUs, as the EP4 figures were taken.
  bench one-host -- ceiling layout intranode low_latency --bind-cpus
  emulated=(NVSHMEM_REMOTE_TRANSPORT=none)
  has_internode=$(python3 -m turnout.bench --help 2>/dev/null | grep -c "internode")
  for domain in 4 2; do
    bench "low-latency-domains-of-$domain" "${emulated[@]}" TURNOUT_NVL_DOMAIN_SIZE=$domain -- low_latency --bind-cpus
    [ "$has_internode" -gt 0 ] &&
      bench "internode-domains-of-$domain" "${emulated[@]}" TURNOUT_NVL_DOMAIN_SIZE=$domain -- internode
  done
fi

for log in "$out"/suite-8*.log; do
  [ -f "$log" ] && { echo "== $(basename "$log") (FAIL/SKIP lines)"; grep -E "^(FAIL|SKIP) " "$log"; }
done
for log in "$out"/ep8-*.log; do
  [ -f "$log" ] && { echo "== $(basename "$log") (tail)"; tail -n 30 "$log"; }
done
echo "== summary"
cat "$out/gpus.txt"
for line in "${lines[@]}"; do echo "$line"; done
