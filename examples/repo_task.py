"""The repository-fixing task for program agents (coding harnesses): a tiny repository whose
tests fail, and a reward of 1 when the agent left them passing.

    agentarium produce --agent swe --file examples/repo_tasks.jsonl --group-size 4 --run swe
    agentarium consumer --agent swe=exec:examples/harnesses/codex.sh --llm URL \\
        --program-setup agentarium.examples.repo_task:setup --program-scorer agentarium.examples.repo_task:score

A task (one line of ``examples/repo_tasks.jsonl``)::

    {"id": "fix-add", "prompt": "what the agent is asked",
     "files": {"calc.py": "...", "test_calc.py": "..."},     # the repository, path -> text
     "test": ["python3", "-m", "unittest", "-q"],            # exit 0: solved
     "reference": {"calc.py": "..."}}                         # a known fix, for checking tasks

``setup`` writes the files and makes the directory a git repository (harnesses expect one);
``score`` runs the test command there as the program's user, the program's environment
minimal, within ``TEST_TIMEOUT_S``, and returns ``{"reward": 1.0 | 0.0, "metrics": ...}``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

TEST_TIMEOUT_S = 60.0
_GIT = {"GIT_AUTHOR_NAME": "task", "GIT_AUTHOR_EMAIL": "task@localhost"}


def setup(task: dict, workdir: Path) -> None:
    files = task.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError(f"repo task {task.get('id')!r} has no 'files' (path -> text)")
    for relative, text in files.items():
        path = (workdir / relative).resolve()
        if workdir.resolve() not in path.parents:
            raise ValueError(
                f"repo task {task.get('id')!r}: {relative!r} is outside the repository"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir), **_GIT}
    env.update(
        GIT_COMMITTER_NAME=_GIT["GIT_AUTHOR_NAME"], GIT_COMMITTER_EMAIL=_GIT["GIT_AUTHOR_EMAIL"]
    )
    for argv in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "task"]):
        subprocess.run(argv, cwd=workdir, env=env, check=True, capture_output=True)


def score(task: dict, workdir: Path, output: Any) -> dict:
    """1.0 when the task's tests pass in ``workdir`` now; run as the program ran (its user)."""
    argv = task.get("test") or ["python3", "-m", "unittest", "-q"]
    changed = subprocess.run(  # before the tests run: what the agent changed
        ["git", "-c", "safe.directory=*", "status", "--porcelain"],
        cwd=workdir,
        capture_output=True,
        text=True,
    ).stdout
    user = {"user": output.user[0], "group": output.user[1]} if output.user else {}
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(workdir.parent / "home"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    try:
        done = subprocess.run(
            argv, cwd=workdir, env=env, capture_output=True, timeout=TEST_TIMEOUT_S, **user
        )
        passed = done.returncode == 0
    except subprocess.TimeoutExpired:
        passed = False
    return {
        "reward": float(passed),
        "metrics": {
            "tests_passed": float(passed),
            "files_changed": float(len(changed.splitlines())),
        },
    }
