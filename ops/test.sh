#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh --test
# Tests start their own nats-server processes on free ports; they never use a running one.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
