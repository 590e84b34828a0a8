"""``agentarium engine``: the local CPU engine speaking SGLang's HTTP API, or vLLM
(``--backend vllm``) started from its own virtualenv as the fleet speaks to it.

Its settings are ``EngineCommand``'s fields: the model to serve and the backend, then the
engine's own ``EngineSettings``, each one a flag (vLLM takes ``--host`` and ``--port``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
from dataclasses import dataclass

from agentarium.broker import free_port, setup_logging, setup_tracing, shutdown_tracing
from agentarium.inference.engine import (
    EngineSettings,  # torch-free: the engine itself loads in cmd_engine
)
from agentarium.schemas import section, setting

from ..config import ConfigKeys, add_settings, resolve
from ..models import model_name, resolve_model


@dataclass(frozen=True, kw_only=True)
class EngineCommand:
    """What to serve, then how (``EngineSettings``)."""

    model: str = setting(
        "tiny",
        metavar="tiny|smol|PATH",
        help="'tiny' (the built-in random model), 'smol' (SmolLM2-135M-Instruct, the built-in "
        "real model: the smol extra), each created once under $AGENTARIUM_HOME, or a "
        "transformers model directory",
    )
    backend: str = setting(
        "local",
        choices=("local", "vllm"),
        help="local: the CPU engine of this package (SGLang's API); vllm: vLLM from its own "
        "virtualenv (ops/vllm_venv.sh builds it on first use: about 3 minutes and 3.5 GB), "
        "serving the token-in/token-out route, the weight-update routes and temperature-scaled "
        "log-probs (consumers: --llm-engine vllm); --threads, --max-batch and "
        "--prefix-cache-tokens 0 become vLLM's own settings when set away from their defaults",
    )
    vllm_arg: tuple[str, ...] = setting(
        (),
        metavar="ARG",
        help="with --backend vllm: one more argument for vLLM's server, repeatable, written "
        "with '=' when it starts with '-' (--vllm-arg=--enable-lora, "
        "--vllm-arg=--otlp-traces-endpoint=http://127.0.0.1:4318/v1/traces)",
    )
    engine: EngineSettings = section(EngineSettings)


# no --config: the keys say how flags become EngineCommand
KEYS = ConfigKeys.of("engine", EngineCommand)


def cmd_engine(args: argparse.Namespace) -> int:
    command: EngineCommand = resolve(args, KEYS).build(EngineCommand)
    setup_logging()
    if command.backend == "vllm":
        extra = vllm_settings(command)  # refused before a model loads
        return serve_vllm(resolve_model(command.model), command, extra)
    model_dir = resolve_model(command.model)
    if command.vllm_arg:
        raise ValueError("--vllm-arg is for --backend vllm; the local engine takes none")
    settings = command.engine
    if settings.port:  # said before the model loads (seconds); the server's own bind below
        check_bindable(settings.host, settings.port)  # still reports a later race
    from agentarium.inference.engine import serve  # torch + transformers: imported only here

    setup_tracing("agentarium-engine")  # spans over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set
    try:
        asyncio.run(serve(model_dir, command.engine))
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # the port taken, the host not an address here: say which flags
        settings = command.engine
        raise ValueError(f"--host {settings.host} --port {settings.port}: {exc}") from None
    finally:
        shutdown_tracing()  # the last spans leave before the process does
    return 0


def check_bindable(host: str, port: int) -> None:
    """A port another server holds, or a host that is no address here, refused in one line
    naming both flags: never that server adopted as ours."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ValueError(f"--host {host} --port {port}: {exc}") from None


def vllm_settings(command: EngineCommand) -> tuple[list[str], dict[str, str]]:
    """The local engine's settings set away from its defaults, as vLLM's arguments and
    environment (at their defaults vLLM keeps its own):
    ``--threads N`` binds vLLM's CPU build to cores 0..N-1 (``VLLM_CPU_OMP_THREADS_BIND``),
    ``--max-batch N`` is ``--max-num-seqs N``, ``--prefix-cache-tokens 0`` turns its prefix
    cache off; what has no vLLM counterpart is refused, never dropped."""
    from agentarium.inference import has_gpu

    settings, defaults = command.engine, EngineSettings()
    given = {
        name
        for name in ("threads", "max_batch", "prefix_cache_tokens")
        if getattr(settings, name) != getattr(defaults, name)
    }
    argv: list[str] = []
    env: dict[str, str] = {}
    if "threads" in given:
        if has_gpu():
            raise ValueError(
                "--threads sets the CPU build's compute threads; vLLM here runs on a GPU"
            )
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{settings.threads - 1}"
    if "max_batch" in given:
        argv.append(f"--max-num-seqs={settings.max_batch}")
    if "prefix_cache_tokens" in given:
        if settings.prefix_cache_tokens:
            raise ValueError(
                "--prefix-cache-tokens: vLLM's prefix cache lives in its KV cache "
                "(VLLM_CPU_KVCACHE_SPACE GiB on a CPU) and takes no size; 0 turns it off"
            )
        argv.append("--no-enable-prefix-caching")
    return argv, env


def serve_vllm(
    model_dir, command: EngineCommand, extra: tuple[list[str], dict[str, str]] | None = None
) -> int:
    """vLLM on ``model_dir`` (served under the model's name: ``smol``, or the directory's)
    until it exits or this process is told to stop (SIGINT, SIGTERM: passed on to it). Prints
    'engine ready on URL' once its /health answers; returns 0 after a stop, else its exit
    status, 1 when it ended by itself with 0 (a server should not end)."""
    import signal
    import subprocess
    import time
    import urllib.request

    from agentarium.inference import VllmUnavailable, vllm_command, vllm_python

    settings = command.engine
    port = settings.port or free_port(settings.host)
    check_bindable(settings.host, port)
    try:
        python = vllm_python()
    except VllmUnavailable as exc:
        raise ValueError(str(exc)) from None
    argv, env = vllm_command(
        python,
        model_dir,
        served_name=model_name(command.model, model_dir),
        host=settings.host,
        port=port,
        extra=[*(extra[0] if extra else ()), *command.vllm_arg],
    )
    env = {**env, **(extra[1] if extra else {})}
    proc = subprocess.Popen(argv, env={**os.environ, **env})  # in this process group
    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)  # its API server stops its engine core

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    url = f"http://{settings.host}:{port}"
    while proc.poll() is None and not stopping:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    print(f"engine ready on {url}", flush=True)
                    break
        except OSError:
            time.sleep(0.5)
    code = proc.wait()
    if stopping:
        return 0
    return code or 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engine",
        help="serve a model on the CPU with SGLang's HTTP API (the local engine)",
        description="The local CPU engine: torch + transformers behind SGLang's /generate (streamed too, as SGLang's --incremental-streaming-output), /abort_request, /health, /model_info, "
        "/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group, "
        "/update_weights_from_disk, /pause_generation and /continue_generation, batching concurrent requests; "
        "Prometheus metrics on the same port at /metrics (as SGLang's --enable-metrics); spans (each request's "
        "queue wait, prefill and decode, in the caller's trace) over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set. "
        "Prints 'engine ready on http://HOST:PORT' when it listens.",
    )
    add_settings(p, EngineCommand)
    p.set_defaults(func=cmd_engine)
