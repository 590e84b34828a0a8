"""``agentarium trainer``: asynchronous GRPO on a run's trajectories (trainer.run_trainer).

Its settings are the fields of ``TrainerConfig`` (the algorithm) and ``TrainerProcess`` (this
process), each one a flag, a key of a --config file and a KEY=VALUE override
(agentarium/config/); the weight transport they choose is
``trainer.publisher_for``'s decision.
"""

from __future__ import annotations

import argparse
import sys

from agentarium import trainer
from agentarium.broker import NatsSettings
from agentarium.schemas import settings
from agentarium.trainer import TrainerConfig, TrainerProcess

from ..config import Resolved, add_config_arguments, add_settings, resolve
from ..models import resolve_model
from .common import run_async, settings_from_args
from .service import add_service_flags, metrics_server, service_keys

KEYS = service_keys(
    "trainer",
    TrainerConfig,
    TrainerProcess,
    keyless={
        "resume": "what this start does with the checkpoint directory, not a setting of the run: "
        "the config.yaml written there starts the run again, and with --resume continues it",
    },
)


def add_trainer_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, TrainerConfig, TrainerProcess)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir (starts fresh if there is "
        "none)",
    )
    add_config_arguments(parser, KEYS)


def resolve_args(args: argparse.Namespace) -> tuple[TrainerConfig, TrainerProcess, Resolved]:
    """The trainer's settings from defaults, --config, flags and overrides, validated."""
    resolved = resolve(args, KEYS)
    values = resolved.values
    # agent (one) and agents (several) name the same setting: the one set by the
    # higher-precedence source (file < flag < override) wins, in what is recorded too
    rank = {None: -1, "file": 0, "flag": 1, "override": 2}
    agent_rank, agents_rank = (rank[resolved.sources.get(k)] for k in ("agent", "agents"))
    if values["agent"] and values["agents"] and agent_rank != agents_rank:
        loser, empty = ("agent", "") if agents_rank > agent_rank else ("agents", ())
        values[loser] = empty
    model_dir = str(
        resolve_model(str(values["model_dir"]))
    )  # 'tiny', 'smol': a built-in model's path
    config = settings.build(TrainerConfig, {**values, "model_dir": model_dir})
    return config, resolved.build(TrainerProcess), resolved


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    return resolve_args(args)[0]


async def train(args: argparse.Namespace, nats: NatsSettings) -> int:
    try:
        config, process, resolved = resolve_args(args)
        publisher = trainer.publisher_for(config, process)
    except (trainer.TrainerError, ValueError) as exc:  # TrainerConfigError, ConfigError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return await trainer.run_trainer(
        config,
        nats,
        resume=args.resume,
        max_steps=process.max_steps,
        make_publisher=publisher,
        torch_threads=process.torch_threads,
        run_config=resolved.values,
        config_source=resolved.describe(),
        metrics=metrics_server(args),
    )


def cmd_trainer(args: argparse.Namespace) -> int:
    try:  # the allocator first: a process that needs another executes itself again, here
        config, process, _ = resolve_args(args)
        trainer.use_allocator(trainer.allocator_for(config, process))
    except (trainer.TrainerError, ValueError) as exc:  # TrainerConfigError, ConfigError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_async(lambda: train(args, settings_from_args(args)), service="agentarium-trainer")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "trainer",
        help="asynchronous GRPO on a run's trajectories; publishes new weights",
        description="Group a run's training trajectories by group_id, run asynchronous GRPO updates with torch + "
        "transformers, publish new weights every --publish-every steps (object store + policy KV; or a shared path, "
        "or streamed to the engines over torch.distributed first: --weight-transport), and checkpoint. "
        "SIGTERM checkpoints and exits 0; --resume continues from the last checkpoint. Settings may come "
        "from --config FILE.yaml and KEY=VALUE overrides (defaults < file < flags < overrides); the "
        "resolved ones are logged once and written to <checkpoint-dir>/config.yaml.",
    )
    add_trainer_arguments(parser)
    add_service_flags(parser)
    parser.set_defaults(func=cmd_trainer)
