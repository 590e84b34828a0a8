"""The orchestrator's training batch, read by verl 0.9.1 itself: DataProto + GRPO advantages.

verl pins transformers < 5.11, which would disturb this project's environment, so verl lives
in its own virtualenv (``$AGENTARIUM_VERL_VENV``, default ``~/.cache/agentarium/verl-venv``):
verl 0.9.1 without its dependencies, plus what ``verl.protocol`` and ``core_algos`` import
(torch 2.13.0, tensordict, omegaconf, hydra-core, codetiming, orjson, ray, transformers < 5.11).
The test builds it when ``AGENTARIUM_TEST_VERL=1`` is set and uses it whenever it exists;
otherwise it is skipped, saying why. The batch crosses over as an ``.npz`` file.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from agentarium.orchestrator import tensorize
from schemas import LLMCall, Trajectory

HOME = Path(os.environ.get("AGENTARIUM_HOME") or "~/.cache/agentarium").expanduser()
VENV = Path(os.environ.get("AGENTARIUM_VERL_VENV") or HOME / "verl-venv").expanduser()
VERL_PY = VENV / "bin" / "python"
# verl.protocol imports ray and transformers too; pins as verl 0.9.1 declares them.
PACKAGES = [
    "tensordict>=0.8,<=0.10,!=0.9.0",
    "omegaconf",
    "hydra-core",
    "codetiming",
    "orjson",
    "numpy",
    "ray>=2.41",
    "transformers>=5.5.3,<5.11,!=5.6.0",
]

SCRIPT = r"""
import json, sys
import numpy as np, torch
from verl import DataProto
from verl.trainer.ppo import core_algos

raw = np.load(sys.argv[1], allow_pickle=False)
tensors = {k[2:]: torch.from_numpy(raw[k]) for k in raw.files if k.startswith("t.")}
non_tensors = {k[2:]: raw[k].astype(object) for k in raw.files if k.startswith("n.")}
data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
assert len(data) == tensors["input_ids"].shape[0]
adv, ret = core_algos.compute_grpo_outcome_advantage(
    token_level_rewards=data.batch["token_level_scores"],
    response_mask=data.batch["response_mask"],
    index=data.non_tensor_batch["uid"],
)
# a slice must keep tensors and non-tensors aligned
first = data[0:2]
print(json.dumps({"advantages": adv.tolist(), "rows": len(data), "first_uids": list(first.non_tensor_batch["uid"])}))
"""


def _build_venv() -> None:
    """Create the verl virtualenv (minutes: downloads torch's CPU build and verl)."""
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VERL_PY), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "--no-deps", "verl==0.9.1"], check=True)
    subprocess.run([*pip, *PACKAGES], check=True)


@pytest.fixture(scope="module")
def verl_python() -> Path:
    if not VERL_PY.exists():
        if os.environ.get("AGENTARIUM_TEST_VERL") != "1":
            reason = (
                f"verl's virtualenv {VENV} does not exist: set AGENTARIUM_TEST_VERL=1 to build "
                "it (verl 0.9.1 pins transformers < 5.11, so it cannot share .venv)"
            )
            print(reason)
            pytest.skip(reason)
        _build_venv()
    return VERL_PY


def _call(prompt: list[int], response: list[int]) -> LLMCall:
    return LLMCall(
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=[-0.5] * len(response),
        finish_reason="stop",
    )


def _traj(job: str, group: str, reward: float, status: str = "ok") -> Trajectory:
    calls = [_call([1, 2, 3], [7, 8, 9])] if status == "ok" else []
    return Trajectory(
        job_id=job,
        agent="a",
        task_id=group,
        group_id=group,
        group_size=3,
        status=status,
        reward=reward if status == "ok" else None,
        calls=calls,
    )


def test_dataproto_and_grpo_advantages(verl_python, tmp_path):
    trajectories = [
        _traj("j0", "g0", 1.0),
        _traj("j1", "g0", 0.0),
        _traj("j2", "g0", 0.5),
        _traj("j3", "g1", 2.0),
        _traj("j4", "g1", 2.0),
        _traj("j5", "g1", 0.0, status="error"),
    ]
    batch, metrics = tensorize(
        trajectories, max_prompt_length=6, max_response_length=5, pad_token_id=0
    )
    assert metrics["batch/dropped_error"] == 1 and len(batch) == 5
    path = batch.save(tmp_path / "batch.npz")
    script = tmp_path / "verl_check.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [str(verl_python), str(script), str(path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rows"] == 5 and result["first_uids"] == ["g0", "g0"]
    # verl: (score - group mean) / (unbiased group std + 1e-6), on response tokens only
    rewards = {"g0": [1.0, 0.0, 0.5], "g1": [2.0, 2.0]}
    expected = []
    for values in rewards.values():
        mean, std = statistics.fmean(values), statistics.stdev(values)
        expected += [(v - mean) / (std + 1e-6) for v in values]
    for row, want in zip(result["advantages"], expected, strict=True):
        assert row[:3] == pytest.approx([want] * 3, abs=1e-5)
        assert row[3:] == [0.0, 0.0]  # padding carries no advantage
