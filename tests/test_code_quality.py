"""The code style the project holds itself to (STYLE.md), checked on every test run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_lint_and_format_are_clean():
    lint = run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout[-3000:]
    fmt = run("ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout[-3000:]


PACKAGES = ("schemas", "broker", "producers", "consumers", "environments", "trainer", "agentarium")


# 126 s alone on an AVX2-only 2-core machine, over 300 s beside the first pass's other long
# tests there (56 s of CPU on the machine the suite's figures were measured on)
@pytest.mark.long(100)
@pytest.mark.timeout(900)
def test_mypy_on_every_package():
    result = run("mypy", "--ignore-missing-imports", *PACKAGES)
    assert result.returncode == 0, result.stdout[-3000:]


def test_checked_in_json_schemas_match_the_definitions():
    result = run("schemas.jsonschema", "--check")
    assert result.returncode == 0, result.stderr
