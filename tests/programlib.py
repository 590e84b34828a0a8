"""Scorer and setup functions for the program agents of tests/test_program_agent.py."""

from __future__ import annotations

import json
from pathlib import Path

from agentarium.consumers import ProgramOutput


def score(task: dict, workdir: Path, output: ProgramOutput) -> dict:
    """programs/ask.sh's reward: its reply (response.json, in the working directory) is the
    task's answer."""
    response = json.loads((workdir / "response.json").read_text())
    reply = response["choices"][0]["message"]["content"]
    return {
        "reward": float(reply.strip() == task["answer"]),
        "metrics": {"reply_chars": len(reply), "exit_code": output.exit_code or 0},
    }


def setup(task: dict, workdir: Path) -> None:
    (workdir / "given.txt").write_text(task["prompt"])
