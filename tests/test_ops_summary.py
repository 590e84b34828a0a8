"""ops/test.sh's closing summary (ops/test_summary.sh): a line per tier, the total, and a
non-zero status when any tier failed; a tier that printed no pytest counts (the avx2 tier on
an AVX2 machine says it has nothing to add) must not end the summary early, as it once did
under `set -o pipefail` when grep found no counts line."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tier(logs: Path, name: str, output: str, rc: int, seconds: int) -> None:
    (logs / f"{name}.log").write_text(output)
    (logs / f"{name}.rc").write_text(f"{rc}\n")
    (logs / f"{name}.s").write_text(f"{seconds}\n")


def summary(logs: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "ops" / "test_summary.sh"), str(logs), *names],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_every_tier_gets_its_line_and_a_failure_fails_the_run(tmp_path):
    tier(tmp_path, "first-pass", "...\n1106 passed, 12 warnings in 706.97s (0:11:46)\n", 0, 709)
    tier(tmp_path, "avx2", "torch's kernels here are AVX2 already\n", 0, 1)
    tier(tmp_path, "nats_semantics", "2 failed, 54 passed, 66 deselected in 100.1s\n", 1, 106)
    tier(tmp_path, "chaos", "= 9 passed in 122.96s (0:02:02) =\n", 0, 138)
    result = summary(tmp_path, "first-pass", "avx2", "nats_semantics", "chaos")
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert lines[0] == "ops/test.sh: summary" and len(lines) == 6
    assert lines[1].split()[1:5] == ["first-pass", "passed", "1106", "passed,"]
    assert "no pytest counts" in lines[2] and "passed" in lines[2]
    assert "FAILED (rc 1)" in lines[3] and lines[3].endswith("1m46s")
    assert "9 passed" in lines[4]
    assert lines[5] == "suite: 1169 passed, 2 failed"


def test_all_passed_is_status_zero(tmp_path):
    tier(tmp_path, "first-pass", "5 passed in 1.0s\n", 0, 1)
    result = summary(tmp_path, "first-pass")
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "suite: 5 passed, 0 failed"
