"""``agentarium trainer``, ``agentarium sync`` and ``agentarium plot``: bodies live in trainer/."""

from __future__ import annotations

import argparse

from ..tiny import resolve_model
from .common import add_nats_flags, run_async, settings_from_args


def cmd_trainer(args: argparse.Namespace) -> int:
    from trainer import cli as trainer_cli  # torch + transformers: imported only here

    args.model = str(resolve_model(args.model))
    return run_async(
        lambda: trainer_cli.run_trainer(args, settings_from_args(args)),
        service="agentarium-trainer",
    )


def cmd_sync(args: argparse.Namespace) -> int:
    from trainer import sync_cli

    return run_async(
        lambda: sync_cli.run_sync(args, settings_from_args(args)), service="agentarium-sync"
    )


def cmd_plot(args: argparse.Namespace) -> int:
    from trainer import cli as trainer_cli

    return trainer_cli.run_plot(args)


def register(sub: argparse._SubParsersAction) -> None:
    from trainer import cli as trainer_cli
    from trainer import sync_cli

    trainer = sub.add_parser(
        "trainer",
        help="asynchronous GRPO on a run's trajectories; publishes new weights",
        description="Group a run's training trajectories by group_id, run asynchronous GRPO updates with torch + "
        "transformers, publish new weights every --publish-every steps (object store + policy KV), and checkpoint. "
        "SIGTERM checkpoints and exits 0; --resume continues from the last checkpoint.",
    )
    trainer_cli.add_trainer_arguments(trainer)
    add_nats_flags(trainer)
    trainer.set_defaults(func=cmd_trainer)

    sync_parser = sub.add_parser(
        "sync",
        help="watch a run's policy versions and reload engines with the new weights",
        description="The weight syncer, run beside each engine fleet with access to its disk: watches the policy "
        "KV, fetches and verifies (sha256) the new safetensors, and reloads every engine with "
        "pause -> /update_weights_from_disk -> continue (SGLang and the local engine alike).",
    )
    sync_cli.add_sync_arguments(sync_parser)
    add_nats_flags(sync_parser)
    sync_parser.set_defaults(func=cmd_sync)

    plot = sub.add_parser(
        "plot",
        help="plot a trainer's metrics CSV (reward vs step) to PNG",
        description="Plot a trainer's --metrics CSV (reward vs step by default) to a PNG file.",
    )
    trainer_cli.add_plot_arguments(plot)
    plot.set_defaults(func=cmd_plot)
