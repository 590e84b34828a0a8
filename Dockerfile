# syntax=docker/dockerfile:1
# One image for the Agentarium services: `agentarium consumer | engine | trainer | sync | broker init`.
#
#   docker build -t agentarium .                                   # CPU (torch CPU build)
#   docker build -t agentarium:gpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA torch, for the trainer
#   docker run --rm agentarium consumer --help
#
# Multi-stage: build tools live in the builder only; the runtime stage gets the virtualenv and
# tini. No model is baked in: `--model tiny` is created at first start under $AGENTARIUM_HOME
# (a volume), and real models are mounted or downloaded by the engine (SGLang has its own image).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
# torch is pinned and taken from PyTorch's own index, so a CPU image never pulls CUDA wheels.
# The GPU variant only changes the index (the CUDA libraries come as wheels; the host needs the
# NVIDIA driver and container toolkit).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Extras of the agentarium package (lora, smol, ...). otlp is an empty alias kept for old build
# commands: the OTLP exporter (spans to OTEL_EXPORTER_OTLP_ENDPOINT) is a dependency. Another
# set of extras needs a lock file made for it: EXTRAS=otlp,trackers ops/lock.sh.
ARG EXTRAS=otlp
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The biggest layer first, so a source change does not reinstall torch.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# Every other dependency from the lock file: exact versions, each file checked against its
# sha256 (ops/lock.sh regenerates it; it covers pyproject's dependencies and the EXTRAS below).
COPY requirements.lock ./
RUN pip install --no-deps --require-hashes -r requirements.lock
COPY pyproject.toml README.md ./
COPY agentarium ./agentarium
COPY broker ./broker
COPY consumers ./consumers
COPY environments ./environments
COPY formats ./formats
COPY inference ./inference
COPY producers ./producers
COPY schemas ./schemas
COPY trainer ./trainer
COPY examples ./examples
# The project alone (--no-deps: nothing unlocked), built with the locked setuptools; pip check
# fails the build if the lock misses something pyproject or an EXTRAS asks for.
# hadolint ignore=DL3013
RUN pip install --no-deps --no-build-isolation ".[${EXTRAS}]" \
 && pip check \
 && python -c "import agentarium.cli, agentarium.broker, agentarium.consumers, agentarium.inference"

FROM ${PYTHON_IMAGE} AS runtime
# tini as PID 1: forwards SIGTERM (consumers drain on it) and reaps children. bubblewrap: the
# shell environment's per-session namespaces (docs/design.md, "The sandbox"). libjemalloc2: the
# trainer's allocator under --memory small (trainer/heap.py).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini bubblewrap libjemalloc2 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --user-group agentarium \
 && mkdir -p /var/lib/agentarium /weights \
 && chown agentarium:agentarium /var/lib/agentarium /weights
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    AGENTARIUM_HOME=/var/lib/agentarium \
    AGENTARIUM_LOG_FORMAT=json
USER 10001:10001
WORKDIR /home/agentarium
VOLUME ["/var/lib/agentarium"]
# The local engine's port (SGLang's default); consumers' tracing proxies pick free ports.
EXPOSE 30000
ENTRYPOINT ["/usr/bin/tini", "--", "agentarium"]
CMD ["--help"]
