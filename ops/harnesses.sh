#!/usr/bin/env bash
# Idempotent: the agent harnesses that bench/harnesses.py runs unchanged as program agents.
#   ops/harnesses.sh      installs into ${AGENTARIUM_HARNESSES:-~/.cache/agentarium/harnesses}
#     venv/   mini-swe-agent and openai-agents (their own virtualenv: litellm and the Agents SDK
#             pin openai and pydantic versions the project's .venv must not take on)
#     node/   @openai/codex and @anthropic-ai/claude-code (npm; their native binaries come in
#             the packages' optional dependencies)
# The versions are the ones docs/agents.md reports on; AGENTARIUM_HARNESS_VERSIONS=latest takes
# the newest instead. Needs python3 with venv, and node >= 20 with npm.
set -euo pipefail

dir=${AGENTARIUM_HARNESSES:-$HOME/.cache/agentarium/harnesses}
py=${PYTHON:-python3}
if [ "${AGENTARIUM_HARNESS_VERSIONS:-}" = latest ]; then
  python_packages=(mini-swe-agent openai-agents)
  node_packages=(@openai/codex @anthropic-ai/claude-code)
else
  python_packages=("mini-swe-agent==2.4.6" "openai-agents==0.24.0")
  node_packages=("@openai/codex@0.171.0" "@anthropic-ai/claude-code@2.1.197")
fi
want="${python_packages[*]} ${node_packages[*]}"
stamp="$dir/.agentarium-harnesses-installed"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "harnesses ready in $dir"
else
  command -v node >/dev/null && command -v npm >/dev/null || {
    echo "node and npm are missing: install them (apt-get install nodejs npm) and rerun." >&2
    exit 1
  }
  mkdir -p "$dir/node"
  if [ ! -x "$dir/venv/bin/python" ] && ! "$py" -m venv "$dir/venv"; then
    echo "python venv is missing: install it (apt-get install python3-venv) and rerun." >&2
    exit 1
  fi
  "$dir/venv/bin/python" -m pip install --quiet "${python_packages[@]}"
  (cd "$dir/node" && npm install --no-audit --no-fund --loglevel=error "${node_packages[@]}")
  "$dir/venv/bin/mini" --help >/dev/null
  "$dir/venv/bin/python" -c "import agents"
  "$dir/node/node_modules/.bin/codex" --version
  "$dir/node/node_modules/.bin/claude" --version
  echo "$want" >"$stamp"
  echo "harnesses ready in $dir"
fi
echo "their PATH for program agents: --program-env PATH=$dir/node/node_modules/.bin:$dir/venv/bin:\$PATH"
