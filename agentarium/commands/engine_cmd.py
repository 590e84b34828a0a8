"""``agentarium engine``: the local CPU engine speaking SGLang's HTTP API.

Its settings are ``EngineCommand``'s fields: the model to serve, then the engine's own
``EngineSettings``, each one a flag."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

from agentarium.broker import setup_logging, setup_tracing, shutdown_tracing
from agentarium.inference.engine import (
    EngineSettings,  # torch-free: the engine itself loads in cmd_engine
)
from agentarium.schemas import section, setting

from ..config import ConfigKeys, add_settings, resolve
from ..models import resolve_model


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
    engine: EngineSettings = section(EngineSettings)


# no --config: the keys say how flags become EngineCommand
KEYS = ConfigKeys.of("engine", EngineCommand)


def cmd_engine(args: argparse.Namespace) -> int:
    from agentarium.inference.engine import serve  # torch + transformers: imported only here

    command: EngineCommand = resolve(args, KEYS).build(EngineCommand)
    setup_logging()
    model_dir = resolve_model(command.model)
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engine",
        help="serve a model on the CPU with SGLang's HTTP API (the local engine)",
        description="The local CPU engine: torch + transformers behind SGLang's /generate, /health, /model_info, "
        "/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group, "
        "/update_weights_from_disk, /pause_generation and /continue_generation, batching concurrent requests; "
        "Prometheus metrics on the same port at /metrics (as SGLang's --enable-metrics); spans (each request's "
        "queue wait, prefill and decode, in the caller's trace) over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set. "
        "Prints 'engine ready on http://HOST:PORT' when it listens.",
    )
    add_settings(p, EngineCommand)
    p.set_defaults(func=cmd_engine)
