"""``agentarium engine``: the local CPU engine speaking SGLang's HTTP API."""

from __future__ import annotations

import argparse
import asyncio

from broker import setup_logging

from ..tiny import resolve_model


def cmd_engine(args: argparse.Namespace) -> int:
    from consumers.engine import serve  # torch + transformers: imported only here

    setup_logging()
    model_dir = resolve_model(args.model)
    try:
        asyncio.run(
            serve(
                model_dir,
                host=args.host,
                port=args.port,
                threads=args.threads,
                max_batch=args.max_batch,
            )
        )
    except KeyboardInterrupt:
        pass
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engine",
        help="serve a model on the CPU with SGLang's HTTP API (the local engine)",
        description="The local CPU engine: torch + transformers behind SGLang's /generate, /health, /model_info, "
        "/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group, "
        "/update_weights_from_disk, /pause_generation and /continue_generation, batching concurrent requests; "
        "Prometheus metrics on the same port at /metrics (as SGLang's --enable-metrics). "
        "Prints 'engine ready on http://HOST:PORT' when it listens.",
    )
    p.add_argument(
        "--model",
        default="tiny",
        metavar="tiny|PATH",
        help="'tiny' (the built-in model, created once under $AGENTARIUM_HOME) or a transformers model directory",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    p.add_argument(
        "--port", type=int, default=30000, help="port; 0 picks a free one (default %(default)s)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=64,
        help="most sequences decoded together (default %(default)s)",
    )
    p.set_defaults(func=cmd_engine)
