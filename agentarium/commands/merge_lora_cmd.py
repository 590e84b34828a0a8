"""``agentarium merge-lora``: a LoRA trainer's adapter folded into its base (trainer.merge_lora)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..models import resolve_model


def cmd_merge_lora(args: argparse.Namespace) -> int:
    from agentarium.trainer import merge_lora

    if not Path(args.adapter).exists():  # before the base model loads
        print(f"error: --adapter {args.adapter}: no such file or folder", file=sys.stderr)
        return 2
    try:
        out = merge_lora(resolve_model(args.model), args.adapter, args.out)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "merge-lora",
        help="fold a LoRA adapter into its base model, for export",
        description="Fold a LoRA adapter (a version a trainer with --lora-rank published, or a "
        "PEFT adapter directory) into its base model and save the result, tokenizer included, "
        "as an ordinary transformers model directory.",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="tiny|smol|PATH",
        help="the base model: 'tiny', 'smol' (the built-in models) or a model directory",
    )
    parser.add_argument(
        "--adapter",
        required=True,
        metavar="PATH",
        help="an adapter file (<weights-dir>/<run>/v<N>/model.safetensors, or an object fetched "
        "from the weights store) or a PEFT adapter directory",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="where the merged model goes")
    parser.set_defaults(func=cmd_merge_lora)
