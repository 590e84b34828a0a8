#!/usr/bin/env bash
# Set up (idempotent) and run the CPU demo on embedded defaults. Extra args go to `agentarium demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh
exec .venv/bin/agentarium demo "$@"
