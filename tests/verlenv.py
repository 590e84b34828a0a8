"""verl 0.9.1's own virtualenv for the verl tests (tests/test_verl_compat.py,
tests/test_verl_agent_loop.py): ``ensure_venv()`` gives its python (``VERL_PY``, under
``$AGENTARIUM_VERL_VENV``, by default ``~/.cache/agentarium/verl-venv``). A venv not built yet is
built with ops/verl_venv.sh under ``AGENTARIUM_TEST_VERL=1``, fails the test under ``CI=true``,
and otherwise skips it, saying how to build it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("AGENTARIUM_VERL_VENV") or "~/.cache/agentarium/verl-venv").expanduser()
VERL_PY = VENV / "bin" / "python"


def ensure_venv() -> Path:
    if VERL_PY.exists():
        return VERL_PY
    how = f"build it with ops/verl_venv.sh (ops/setup.sh --test runs it) at {VENV}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"verl's virtualenv {VENV} is missing, and CI must run the verl tests: {how}")
    if os.environ.get("AGENTARIUM_TEST_VERL") != "1":
        reason = (
            f"verl's virtualenv {VENV} does not exist: {how}, or set AGENTARIUM_TEST_VERL=1 "
            "(verl 0.9.1 pins transformers < 5.11, so it cannot share .venv)"
        )
        print(reason)
        pytest.skip(reason)
    subprocess.run(
        ["bash", str(ROOT / "ops" / "verl_venv.sh")],
        check=True,
        env={**os.environ, "AGENTARIUM_VERL_VENV": str(VENV)},
    )
    return VERL_PY
