"""`python -m consumers.engine --model-path DIR`: serve a local model over SGLang's HTTP API.

Prints one line, `engine ready on http://HOST:PORT`, once it listens (port 0 picks a free one
and prints it); logs go to stderr as JSON lines
(console lines on a terminal; AGENTARIUM_LOG_FORMAT=json|console decides).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import structlog

from broker.telemetry import setup_logging

from .server import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m consumers.engine", description=__doc__)
    parser.add_argument("--model-path", required=True, type=Path, help="transformers model dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--max-batch", type=int, default=64, help="most sequences per step")
    args = parser.parse_args(argv)
    if not (args.model_path / "config.json").is_file():
        parser.error(f"{args.model_path} has no config.json: pass a transformers model directory")
    setup_logging()

    asyncio.run(
        serve(
            args.model_path,
            args.host,
            args.port,
            threads=args.threads,
            max_batch=args.max_batch,
        )
    )
    structlog.get_logger("agentarium.engine").info("engine stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
