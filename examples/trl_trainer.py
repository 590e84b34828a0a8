"""TRL's GRPOTrainer, its rollouts run by Agentarium: the seed's "any RL framework" pattern.

TRL owns the model, the optimizer and the GRPO loss; Agentarium runs every rollout (a job per
sample through NATS to the consumers, whose agent calls the engine) and, after each optimizer
step, publishes the new weights that the syncer beside the engine loads. The services first
(docs/integrations.md has the same commands):

    agentarium broker up --port 4222 --store /tmp/agentarium-nats &
    agentarium engine --model tiny --port 30000 &
    agentarium sync --run trl --engine http://127.0.0.1:30000 &
    agentarium consumer --agent digit=agentarium.examples.toy:any_digit --llm http://127.0.0.1:30000 &
    python examples/trl_trainer.py --agent digit --run trl --steps 20

With ``--lora-rank 8`` TRL trains a peft LoRA adapter instead of the whole model, and the
adapter alone goes to the engine (which serves its base + the adapter).

The task (``examples.toy.any_digit``): whatever the prompt, reward 1 when the reply starts with
a digit. The tiny model starts near 0.04 and learns it within 20 steps of 8 prompts x 8
samples; ``--lr 0`` shows that it does not without training.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from agentarium.broker import NatsSettings
from agentarium.config import ConfigKeys, add_settings, resolve
from agentarium.integrations.config import RolloutConfig


def grpo_config(
    output_dir: str, *, steps: int, lr: float, prompts_per_step: int, generations: int, seed: int
):
    """TRL's GRPOConfig for the digit task on the CPU: one digit and the end of the turn per
    completion, no KL term, no checkpoints, no reporting. fp32 and no activation checkpointing:
    TRL's defaults (bf16, checkpointing) run bf16 matrix products on a CPU without AVX-512 BF16
    or AMX in torch's fallback kernel, which made the smol test's steps take minutes."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        per_device_train_batch_size=prompts_per_step * generations,
        num_generations=generations,
        max_completion_length=2,  # the digit, then the end of the turn
        temperature=1.0,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
    )


def prompts(n: int) -> list[dict[str, Any]]:
    """n distinct chat prompts (TRL's conversational format); the reward does not depend on
    them. The consumer renders them with the model's chat template, as TRL itself would (a
    system message of our own: the template's default one would triple the prompt's tokens)."""
    system = {"role": "system", "content": "Answer with one digit."}
    return [
        {"prompt": [system, {"role": "user", "content": f"say a digit ({i})"}]} for i in range(n)
    ]


def lora_config(rank: int):
    """peft's LoraConfig of rank ``rank`` on every linear layer (alpha 2 x rank, no dropout)."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0, bias="none"
    )


def grpo_trainer(
    rollouts: Any,
    *,
    model_dir: str,
    steps: int = 20,
    lr: float = 1e-2,
    prompts_per_step: int = 8,
    generations: int = 8,
    output_dir: str | None = None,
    seed: int = 0,
    extra_rewards: Sequence[Callable[..., list]] = (),
    lora_rank: int = 0,
):
    """TRL's GRPOTrainer whose rollouts ``rollouts`` (an ``AgentariumRollout``) runs and
    whose weights it publishes after each step; with ``lora_rank`` > 0, TRL trains a peft
    LoRA adapter of that rank (``lora_config``) and the adapter alone is published."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    from agentarium.integrations.trl import agent_reward

    args = grpo_config(
        output_dir or tempfile.mkdtemp(prefix="trl-agentarium-"),
        steps=steps,
        lr=lr,
        prompts_per_step=prompts_per_step,
        generations=generations,
        seed=seed,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[agent_reward, *extra_rewards],
        args=args,
        train_dataset=Dataset.from_list(prompts(prompts_per_step * steps)),
        rollout_func=rollouts,
        callbacks=[rollouts.weight_sync(model_dir=model_dir)],
        peft_config=lora_config(lora_rank) if lora_rank > 0 else None,
    )
    trainer.remove_callback(PrinterCallback)  # main() prints its own line per step
    return trainer


def train(
    config: RolloutConfig,
    *,
    model_dir: str,
    settings: NatsSettings | None = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Train for ``steps`` optimizer steps (``kwargs``: ``grpo_trainer``'s); returns TRL's log
    history (one entry per step). ``extra_rewards``: more TRL reward functions beside the
    agent's (return None to add nothing: TRL sums the functions' rewards)."""
    from agentarium.integrations.trl import AgentariumRollout

    with AgentariumRollout(config, settings=settings) as rollouts:
        trainer = grpo_trainer(rollouts, model_dir=model_dir, **kwargs)
        trainer.train()
        return [entry for entry in trainer.state.log_history if "reward" in entry]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Train a model with TRL's GRPOTrainer on rollouts run by Agentarium "
        "(a broker, an engine, `agentarium sync` and a consumer must be running: see the "
        "module docstring). The broker is $AGENTARIUM_NATS_URL (default nats://127.0.0.1:4222)."
    )
    add_settings(parser, RolloutConfig)
    parser.add_argument(
        "--model", default="tiny", help="'tiny' or a model directory (default tiny)"
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 1e-2)")
    parser.add_argument("--output-dir", help="TRL's output directory (default: a temporary one)")
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train a peft LoRA adapter of this rank on every linear layer, and publish the "
        "adapter alone (default 0: the whole model)",
    )
    args = parser.parse_args(argv)
    config = resolve(args, ConfigKeys.of("trl_trainer", RolloutConfig)).build(RolloutConfig)
    from agentarium.tiny import resolve_model

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    history = train(
        config,
        model_dir=str(resolve_model(args.model)),
        steps=args.steps,
        lr=args.lr,
        output_dir=args.output_dir,
        lora_rank=args.lora_rank,
    )
    for entry in history:
        print(f"step {int(entry['step']):3d}  reward {entry['reward']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
