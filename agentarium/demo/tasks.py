"""The demo's task families: how each makes its tasks, which agent scores them, its reward range.

A task family is one agent name on the wire (``repeat``, ``next``), served by its own consumer,
so ``agentarium demo --task-set repeat,next`` trains one policy on two agents at once. The two
differ where per-task advantage normalisation matters: ``repeat`` pays 0 or 1, ``next`` pays
graded credit (0.5 for a neighbouring digit, which is also what echoing the prompt earns) and
has to be learnt against the pull of ``repeat``.

The single-task demo (no ``--task-set``) keeps its historic agent name ``toy`` and its exact
task stream: ``digit_tasks`` with ``repeat`` draws the same digits from the same seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TaskFamily:
    name: str  # the agent name on the wire
    agent: str  # module:function the consumer runs
    verb: str  # the prompt is "<verb> <digit>"
    offset: int  # the answer is (digit + offset) mod 10
    neighbour_credit: float  # reward for a digit one away from the answer (the agent's rule)
    about: str
    reward_low: float = 0.0
    reward_high: float = 1.0

    @property
    def reward_range(self) -> float:
        return self.reward_high - self.reward_low

    def prompt(self, answer: str) -> str:
        """The prompt whose answer is the digit ``answer``."""
        return f"{self.verb} {(int(answer) - self.offset) % 10}"

    def best_constant(self, digits: str) -> float:
        """The mean reward of the best policy that ignores the prompt (always one digit), the
        answers drawn from ``digits``."""

        def credit(reply: int, answer: int) -> float:
            if reply == answer:
                return self.reward_high
            if (reply - answer) % 10 in (1, 9):
                return self.neighbour_credit
            return self.reward_low

        pool = sorted({int(d) for d in digits})
        return max(sum(credit(c, a) for a in pool) / len(pool) for c in range(10))


FAMILIES: dict[str, TaskFamily] = {
    family.name: family
    for family in (
        TaskFamily(
            name="repeat",
            agent="agentarium.examples.toy:rollout",
            verb="repeat",
            offset=0,
            neighbour_credit=0.0,
            about="`repeat 7` -> 7; reward 1 for the digit, else 0",
        ),
        TaskFamily(
            name="next",
            agent="agentarium.examples.toy:next_digit",
            verb="next",
            offset=1,
            neighbour_credit=0.5,
            about="`next 7` -> 8 (9 -> 0); reward 1 for the digit, 0.5 for a neighbour of it, else 0",
        ),
    )
}


def parse_task_set(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"repeat,next"`` (or a sequence of such, one per --task-set) -> known, distinct family
    names, in order."""
    items = [value] if isinstance(value, str) else value
    names = [n.strip() for item in items for n in item.split(",")]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(
            f"--task-set: unknown task {', '.join(map(repr, unknown))}; "
            f"choose from {', '.join(FAMILIES)} (comma-separated, e.g. repeat,next)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--task-set names a task twice: {','.join(names)}")
    return tuple(names)


def digit_tasks(
    rng: random.Random, n: int, prefix: str, digits: str = "0123456789", family: str = "repeat"
) -> list[dict]:
    """``n`` one-token tasks of ``family``, each answer a digit drawn from ``digits`` (one rng
    draw per task), so ``digits="7"`` makes every task of every family answer 7: a micro-task
    that needs no conditioning on the prompt."""
    spec = FAMILIES[family]
    tasks = []
    for i in range(n):
        answer = rng.choice(digits)
        tasks.append(
            {
                "task_id": f"{prefix}-{i}",
                "prompt": spec.prompt(answer),
                "answer": answer,
                "max_new_tokens": 1,
            }
        )
    return tasks


def split_groups(groups: int, families: Sequence[str]) -> dict[str, int]:
    """A step's groups shared out in equal proportion, the remainder to the first families."""
    share, extra = divmod(groups, len(families))
    return {name: share + (1 if i < extra else 0) for i, name in enumerate(families)}
