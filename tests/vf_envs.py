"""verifiers environments built from verifiers' own classes, for the adapter's tests
(verifiers' environment hub is not reachable here: the datasets are small and in memory).

``load_environment`` makes this module a verifiers environment package, loadable as
``verifiers:vf_envs``; ``tool_environment`` is loadable as ``verifiers:vf_envs:tool_environment``.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Answer with the number only."
QUESTIONS = [
    {"question": "What is 2+3?", "answer": "5"},
    {"question": "What is 4+4?", "answer": "8"},
]


def correct_answer(completion, answer, parser, **kwargs) -> float:
    """1 when the last assistant message is the answer."""
    return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0


def load_environment() -> vf.Environment:
    """A SingleTurnEnv: one question, one reply, scored by exact match."""
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(QUESTIONS),
        system_prompt=SYSTEM_PROMPT,
        rubric=vf.Rubric(funcs=[correct_answer]),
    )


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def tool_environment() -> vf.Environment:
    """A ToolEnv with one tool, ``add``: the model calls it, then answers."""
    return vf.ToolEnv(
        dataset=Dataset.from_list([{"question": "What is 2+3? Use the add tool.", "answer": "5"}]),
        tools=[add],
        max_turns=4,
        rubric=vf.Rubric(funcs=[correct_answer]),
    )


def group_scored_environment() -> vf.Environment:
    """A rubric that scores a group together: refused (each job is scored alone)."""

    def best_of_group(completions, answers, **kwargs) -> list[float]:
        return [1.0 for _ in completions]

    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(QUESTIONS), rubric=vf.Rubric(funcs=[best_of_group])
    )
