"""The orchestrator's training batch, read by verl 0.9.1 itself: DataProto + GRPO advantages.

verl pins transformers < 5.11, which would disturb this project's environment, so verl lives
in its own virtualenv (``$AGENTARIUM_VERL_VENV``, default ``~/.cache/agentarium/verl-venv``):
verl 0.9.1 without its dependencies, plus what ``verl.protocol`` and ``core_algos`` import
(torch 2.13.0, tensordict, omegaconf, hydra-core, codetiming, orjson, numpy, ray,
transformers < 5.11). ``ops/verl_venv.sh`` builds it, and ``ops/setup.sh --test`` (so the
test command, ops/test.sh) runs that. Without it the verl tests skip, saying how to build it,
unless ``AGENTARIUM_TEST_VERL=1`` (build it now) or ``CI=true`` (fail: CI must run them).
Batches cross over as ``.npz`` files, their meta_info as JSON.

The batch-only tests (no verl) pin what tensorize promises verl: the trainer's own advantages
for multi-row trajectories, failed rows out of group statistics, unreproducible sampling left
out and mixed temperatures refused.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest
from verlenv import ensure_venv

from agentarium.orchestrator import tensorize
from agentarium.schemas import LLMCall, Trajectory
from agentarium.trainer import grpo_advantages

# Reads each batch into a DataProto, runs verl's own GRPO estimator on it, and hands the batch
# to DataProto.to_tensordict the way verl's trainer does before an actor update (with its own
# meta_info["temperature"]), so no column of ours may collide with that key.
SCRIPT = r"""
import json, sys
import numpy as np, torch
from verl import DataProto
from verl.trainer.ppo import core_algos

out = {}
for path in sys.argv[1:]:
    raw = np.load(path, allow_pickle=False)
    tensors = {k[2:]: torch.from_numpy(raw[k]) for k in raw.files if k.startswith("t.")}
    non_tensors = {k[2:]: raw[k].astype(object) for k in raw.files if k.startswith("n.")}
    with open(path + ".meta.json") as f:
        meta = json.load(f)
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
    assert len(data) == tensors["input_ids"].shape[0]
    adv, ret = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=data.batch["token_level_scores"],
        response_mask=data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
    )
    data.meta_info["temperature"] = 1.0  # what RayPPOTrainer._update_actor sets
    data.to_tensordict()
    first = data[0:2]  # a slice keeps tensors and non-tensors aligned
    out[path] = {
        "advantages": adv.tolist(),
        "rows": len(data),
        "first_uids": list(first.non_tensor_batch["uid"]),
    }
print(json.dumps(out))
"""


def _call(prompt: list[int], response: list[int], **kw) -> LLMCall:
    return LLMCall(
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=[-0.5] * len(response),
        finish_reason="stop",
        **kw,
    )


def _traj(
    job: str, group: str, reward: float, status: str = "ok", calls: list[LLMCall] | None = None
) -> Trajectory:
    if calls is None:
        calls = [_call([1, 2, 3], [7, 8, 9])]
    return Trajectory(
        job_id=job,
        agent="a",
        task_id=group,
        group_id=group,
        group_size=3,
        status=status,
        reward=reward if status == "ok" else None,
        calls=calls if status == "ok" else [],
    )


def _two_calls(chained: bool) -> list[LLMCall]:
    """Two calls; the second prompt extends the first exchange (chained) or re-renders it."""
    second_prompt = [1, 2, 3, 7, 8, 4] if chained else [1, 2, 3, 9, 8, 4]
    return [_call([1, 2, 3], [7, 8]), _call(second_prompt, [5, 6])]


def _batch(trajectories, **kw):
    return tensorize(trajectories, max_prompt_length=6, max_response_length=5, pad_token_id=0, **kw)


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def _z(values: list[float]) -> list[float]:
    """verl's and the trainer's GRPO: (r - mean) / (unbiased std + 1e-6)."""
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / (std + 1e-6) for v in values]


# ---- the batches verl reads (built once, verl started once) --------------------------------
REWARDS = {"j0": 1.0, "j1": 0.0, "j2": 0.5}


def _basic():
    return [
        _traj("j0", "g0", 1.0),
        _traj("j1", "g0", 0.0),
        _traj("j2", "g0", 0.5),
        _traj("j3", "g1", 2.0),
        _traj("j4", "g1", 2.0),
        _traj("j5", "g1", 0.0, status="error"),
    ]


def _multi_row():
    # j0 and j2 re-render their history: concat is refused, each becomes two rows
    return [
        _traj("j0", "m", REWARDS["j0"], calls=_two_calls(chained=False)),
        _traj("j1", "m", REWARDS["j1"]),
        _traj("j2", "m", REWARDS["j2"], calls=_two_calls(chained=False)),
    ]


def _concat():
    return [
        _traj("j0", "c", REWARDS["j0"], calls=_two_calls(chained=True)),
        _traj("j1", "c", REWARDS["j1"]),
        _traj("j2", "c", REWARDS["j2"], calls=_two_calls(chained=True)),
    ]


def _with_failed():
    return [
        _traj("j0", "f", REWARDS["j0"]),
        _traj("j1", "f", REWARDS["j1"]),
        _traj("j2", "f", REWARDS["j2"]),
        _traj("j3", "f", 0.0, status="error"),
        _traj("j4", "f", 0.0, status="timeout"),
    ]


CASES = {
    "basic": (_basic, {}),
    "multi_row": (_multi_row, {}),
    "per_call": (_concat, {"multi_turn": "per-call"}),
    "concat": (_concat, {}),
    "with_failed": (_with_failed, {"include_failed": True}),
}


@pytest.fixture(scope="module")
def verl(tmp_path_factory) -> dict[str, dict]:
    """Every case's batch through verl 0.9.1, in one verl process: case -> verl's results."""
    python = ensure_venv()
    tmp = tmp_path_factory.mktemp("verl")
    paths = {}
    for name, (make, kwargs) in CASES.items():
        batch, _ = _batch(make(), **kwargs)
        path = batch.save(tmp / f"{name}.npz")
        Path(f"{path}.meta.json").write_text(json.dumps(batch.meta_info))
        paths[name] = str(path)
    script = tmp / "verl_check.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [str(python), str(script), *paths.values()], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    return {name: results[path] for name, path in paths.items()}


def test_dataproto_and_grpo_advantages(verl):
    batch, metrics = _batch(_basic())
    assert metrics["batch/dropped_error"] == 1 and len(batch) == 5
    result = verl["basic"]
    assert result["rows"] == 5 and result["first_uids"] == ["g0", "g0"]
    # verl: (score - group mean) / (unbiased group std + 1e-6), on response tokens only
    expected = _z([1.0, 0.0, 0.5]) + _z([2.0, 2.0])
    for row, want in zip(result["advantages"], expected, strict=True):
        assert row[:3] == pytest.approx([want] * 3, abs=1e-5)
        assert row[3:] == [0.0, 0.0]  # padding carries no advantage
    # one row per trajectory: the advantages the batch ships are verl's own
    assert _flat(batch["advantages"].tolist()) == pytest.approx(
        _flat(result["advantages"]), abs=1e-5
    )


def test_multi_row_trajectories_carry_the_trainers_advantages(verl):
    trainer = dict(zip(REWARDS, grpo_advantages(list(REWARDS.values())), strict=True))
    for case in ("multi_row", "per_call"):
        batch, metrics = _batch(CASES[case][0](), **CASES[case][1])
        assert len(batch) == 5 and batch.meta_info["multi_row_trajectories"] == 2
        assert metrics["batch/multi_row_trajectories"] == 2
        mask = batch["response_mask"].bool()
        for i, job in enumerate(batch["job_id"]):
            # the trainer's GRPO advantage of the trajectory, each trajectory counted once
            shipped = batch["advantages"][i]
            assert shipped[mask[i]].tolist() == pytest.approx([trainer[job]] * int(mask[i].sum()))
            assert shipped[~mask[i]].tolist() == [0.0] * int((~mask[i]).sum())
        # verl's own estimator counts j0 and j2 twice (one per row, same uid): other numbers
        by_row = [REWARDS[j] for j in batch["job_id"]]
        verl_adv = [
            row[int(m.nonzero()[0])] for row, m in zip(verl[case]["advantages"], mask, strict=True)
        ]
        assert verl_adv == pytest.approx(_z(by_row), abs=1e-5)
        assert verl_adv != pytest.approx([trainer[j] for j in batch["job_id"]], abs=1e-3)
    # when every trajectory chains (concat) it is one row, and verl agrees with the trainer
    batch, metrics = _batch(_concat())
    assert len(batch) == 3 and batch.meta_info["multi_row_trajectories"] == 0
    assert metrics["batch/concatenated"] == 2
    assert _flat(batch["advantages"].tolist()) == pytest.approx(
        _flat(verl["concat"]["advantages"]), abs=1e-5
    )


def test_failed_rows_do_not_move_verls_group_statistics(verl):
    # verl's GRPO on the batch: the ok rows have exactly the advantages of the ok members alone
    advantages = verl["with_failed"]["advantages"]
    for row, want in zip(advantages[:3], _z([1.0, 0.0, 0.5]), strict=True):
        assert row[:3] == pytest.approx([want] * 3, abs=1e-5)
    assert advantages[3] == [0.0] * 5 and advantages[4] == [0.0] * 5
    batch, metrics = _batch(_with_failed(), include_failed=True)
    assert len(batch) == 5 and metrics["batch/dropped_error"] == 1
    failed = [i for i, s in enumerate(batch["status"]) if s != "ok"]
    assert failed == [3, 4]
    for i in failed:
        assert batch["uid"][i] != "f"  # a group of its own: out of f's statistics
        assert batch["response_mask"][i].tolist() == [0] * 5
        assert batch["token_level_scores"][i].tolist() == [0.0] * 5
        assert batch["advantages"][i].tolist() == [0.0] * 5
    assert _flat(batch["advantages"].tolist()) == pytest.approx(_flat(advantages), abs=1e-5)


def test_unreproducible_sampling_is_left_out_as_the_trainer_does():
    trajectories = [
        _traj("j0", "g", 1.0),
        _traj("j1", "g", 0.0, calls=[_call([1, 2, 3], [7, 8, 9], top_p=0.9)]),
        _traj("j2", "g", 0.5, calls=[_call([1, 2, 3], [7, 8, 9], top_k=20)]),
        _traj("j3", "g", 0.5, calls=[_call([1, 2, 3], [7, 8, 9], temperature=0.0)]),
        _traj("j4", "g", 0.0),
    ]
    batch, metrics = _batch(trajectories)
    assert list(batch["job_id"]) == ["j0", "j4"] and metrics["batch/refused"] == 3
    refused = batch.meta_info["refused"]
    assert sorted(refused) == ["j1", "j2", "j3"]
    assert "top_p=0.9" in refused["j1"] and "top_k=20" in refused["j2"]
    assert "greedy" in refused["j3"]
    # the group's statistics are those of its trainable members
    assert batch["advantages"][:, 2].tolist() == pytest.approx(grpo_advantages([1.0, 0.0]))


def test_mixed_temperatures_are_refused_naming_the_jobs():
    warm = [_call([1, 2, 3], [7, 8, 9], temperature=0.7)]
    batch, _ = _batch([_traj("j0", "g", 1.0, calls=warm), _traj("j1", "g", 0.0, calls=warm)])
    assert batch.meta_info["rollout_temperature"] == 0.7
    mixed = [_traj("j0", "g", 1.0, calls=warm), _traj("j1", "g", 0.0), _traj("j2", "g", 0.5)]
    with pytest.raises(ValueError, match=r"T=0\.7: job j0; T=1\.0: jobs j1, j2") as err:
        _batch(mixed)
    assert "actor_rollout_ref.rollout.temperature" in str(err.value)
