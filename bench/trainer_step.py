"""Trainer: one GRPO step on a padded batch vs the same step one sample at a time.

A batch of the toy task ("repeat the digit", the chat-templated prompt the consumer sends) of
--groups x --group-size trajectories goes through the trainer's update twice: as right-padded
(B, T) tensors in one forward/backward pass, and row by row with the gradients accumulated
(micro-batch 1: what a plain per-sample loop costs; same loss, same update). Prints step time,
tokens/s (all real tokens, prompts included) and model tokens/s side by side; the time to turn
trajectories into tensors is printed separately.

    python bench/trainer_step.py [--model tiny|DIR] [--groups 16] [--group-size 8]
                                 [--response-tokens 2] [--steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from agentarium.formats.chat_template import ChatTemplate
from agentarium.schemas import LLMCall, Trajectory
from agentarium.tiny import resolve_model
from agentarium.trainer.batch import Sample, advantages, build_rows, collate
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.step import LocalUpdater


def toy_samples(template: ChatTemplate, groups: int, size: int, response_tokens: int, seed=0):
    rng = random.Random(seed)
    eos = template.eos_token_ids[0]
    samples = []
    for g in range(groups):
        digit = rng.randrange(10)
        prompt = template.encode_chat([{"role": "user", "content": f"Repeat the digit: {digit}"}])
        answers = [rng.randrange(10) for _ in range(size)]
        rewards = [float(a == digit) for a in answers]
        for i, (answer, adv) in enumerate(zip(answers, advantages(rewards), strict=True)):
            response = [48 + answer] + [48 + rng.randrange(10) for _ in range(response_tokens - 2)]
            response = (response + [eos])[:response_tokens]
            call = LLMCall(
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=[-5.5] * len(response),
                finish_reason="stop",
            )
            traj = Trajectory(
                job_id=f"j{g}-{i}",
                agent="toy",
                task_id=f"t{g}",
                group_id=f"g{g}",
                group_size=size,
                status="ok",
                reward=rewards[i],
                calls=[call],
            )
            samples.append(Sample(traj, adv))
    return samples


def time_steps(updater: LocalUpdater, batch, steps: int) -> float:
    updater.step(batch, seed=0)  # warm-up (allocator, kernels)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        updater.step(batch, seed=step + 1)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--response-tokens", type=int, default=2, help="digit + <|im_end|> by default"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    template = ChatTemplate.from_model_dir(model_dir)
    samples = toy_samples(template, args.groups, args.group_size, args.response_tokens)

    started = time.perf_counter()
    rows, _ = build_rows(samples)
    batch = collate(rows, pad_id=256)
    build_s = time.perf_counter() - started
    print(
        f"model {model_dir.name}, torch threads {args.threads}, batch {batch.rows} rows x "
        f"{batch.input_ids.shape[1]} positions, {batch.tokens} tokens "
        f"({batch.model_tokens} generated), trajectories -> tensors {build_s * 1000:.1f} ms"
    )

    print(f"{'mode':<28}{'step s':>10}{'tokens/s':>12}{'model tok/s':>13}")
    for label, micro in (("padded batch (trainer)", 0), ("one sample at a time", 1)):
        config = TrainerConfig(
            run="bench",
            agent="toy",
            model_dir=str(model_dir),
            lr=1e-5,
            micro_batch_size=micro,
            pack_rows=False,  # padded, as compared here (packed: bench/trainer_packing.py)
        )
        step_s = time_steps(LocalUpdater(config), batch, args.steps)
        print(
            f"{label:<28}{step_s:>10.3f}{batch.tokens / step_s:>12.0f}"
            f"{batch.model_tokens / step_s:>13.0f}"
        )


if __name__ == "__main__":
    main()
