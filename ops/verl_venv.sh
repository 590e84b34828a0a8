#!/usr/bin/env bash
# Idempotent: verl 0.9.1's own virtualenv, for tests/test_verl_compat.py and
# tests/test_verl_agent_loop.py.
#   ops/verl_venv.sh      creates ${AGENTARIUM_VERL_VENV:-~/.cache/agentarium/verl-venv}
# verl 0.9.1 pins transformers < 5.11, which would disturb the project's .venv, so it gets its
# own: verl without its dependencies, plus what verl.protocol, verl.trainer.ppo.core_algos and
# verl.experimental.agent_loop import, with the pins verl 0.9.1 declares, and the packages of
# Agentarium's client side (schemas, broker, producers, the torch-free trainer face), which the
# agent loop agentarium.integrations.verl loads there. torch is the CPU build, pinned like
# ops/setup.sh's. Agentarium itself is not installed here: put the checkout on PYTHONPATH (the
# tests do) or `pip install --no-deps -e .` into this venv.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${AGENTARIUM_VERL_VENV:-$HOME/.cache/agentarium/verl-venv}
py=${PYTHON:-python3}
torch_version=${AGENTARIUM_TORCH_VERSION:-2.13.0}
packages=(
  "tensordict>=0.8,<=0.10,!=0.9.0"
  omegaconf
  hydra-core
  codetiming
  orjson
  numpy
  "ray>=2.41"
  "transformers>=5.5.3,<5.11,!=5.6.0"
  # verl.experimental.agent_loop
  pillow
  datasets
  cachetools
  fastapi
  uvicorn
  # Agentarium's client side (pyproject.toml's pins)
  "nats-py>=2.9,<3"
  "msgpack>=1.0"
  "aiohttp>=3.9"
  "structlog>=24.1"
  "opentelemetry-api>=1.25"
  "opentelemetry-sdk>=1.25"
  "prometheus-client>=0.20"
)
# The stamp records what was installed: a change of this script's package list rebuilds.
want="verl==0.9.1 torch==${torch_version} ${packages[*]}"
stamp="$venv/.agentarium-verl-installed"
# One build at a time (setup and a test may both start one): a second waits, then finds it built.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "verl venv ready at $venv"
  exit 0
fi
mkdir -p "$(dirname "$venv")"
if [ ! -x "$venv/bin/python" ]; then
  if ! "$py" -m venv "$venv" 2>/dev/null; then
    echo "python venv is missing: install it (apt-get install python3-venv) and rerun." >&2
    exit 1
  fi
fi
# --no-compile: no bytecode for its 15,000 modules at install; the few the tests import are
# compiled when first imported.
pip=("$venv/bin/python" -m pip install --quiet --no-compile)
"${pip[@]}" "torch==${torch_version}"
"${pip[@]}" "${packages[@]}"
# Last and without its dependencies (datasets, peft, vllm, ...: none needed to build a DataProto
# and run core_algos), so pip has nothing to complain about afterwards.
"${pip[@]}" --no-deps "verl==0.9.1"
"$venv/bin/python" -c 'import verl.protocol, verl.trainer.ppo.core_algos, verl.experimental.agent_loop'
echo "$want" >"$stamp"
echo "verl venv ready at $venv"
