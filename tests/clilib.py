"""The `agentarium` command line in the test's own process: ``cli`` parses arguments as the
command does, and ``consume`` runs `agentarium consumer ... --burst` until the queue is empty
(tests/test_env_agent.py, tests/test_program_agent.py, tests/test_program_rollouts_bench.py)."""

from __future__ import annotations

from agentarium.cli import build_parser
from agentarium.commands import consumer_cmd


def cli(*argv: str):
    return build_parser().parse_args(list(argv))


async def consume(nats_url: str, *argv: str) -> int:
    """`agentarium consumer ... --burst` in this process: runs until the queue is empty."""
    args = cli("consumer", *argv, "--burst", "--retry-delay", "0.05", "--nats-url", nats_url)
    config, source = consumer_cmd.config_from_args(args)
    return await consumer_cmd.consume(args, config, source)
