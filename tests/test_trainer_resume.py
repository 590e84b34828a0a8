"""The trainer as a process (``python -m agentarium trainer``): SIGKILL mid-run and ``--resume`` train every
ok trajectory exactly once, as the checkpoints' job id lists show; validation trajectories
never enter a step; SIGTERM checkpoints and exits 0."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest
from trainlib import TrainerChild, publish

from agentarium.schemas import LLMCall, Trajectory, WeightUpdate, decode
from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.checkpoint import Checkpoints
from agentarium.trainer.metrics import read_metrics

RUN, AGENT = "resume", "toy"
ROOT = Path(__file__).resolve().parents[1]


def trajectories(groups: range, *, errors: bool = False) -> list[Trajectory]:
    """Groups of 4 for "repeat the digit": reward 1 when the answer is the prompt's digit."""
    out = []
    for g in groups:
        digit = g % 10
        size = 5 if errors and g % 3 == 0 else 4  # every third group has a failed member
        for i in range(size):
            answer = (digit + i) % 10
            call = LLMCall(
                prompt_ids=[257, 82, 58, 48 + digit, 258, 257],
                response_ids=[48 + answer, 258],
                response_logprobs=[-5.5, -5.6],
                finish_reason="stop",
            )
            failed = i == 4
            out.append(
                Trajectory(
                    job_id=f"job-{g}-{i}",
                    agent=AGENT,
                    task_id=f"task-{g}",
                    group_id=f"group-{g}",
                    group_size=size,
                    sample_index=i,
                    run=RUN,
                    status="timeout" if failed else "ok",
                    reward=None if failed else float(answer == digit),
                    error="slow" if failed else None,
                    calls=[call],
                    trace_id=f"{g:016x}{i:016x}",
                )
            )
    return out


def validation(n: int) -> list[Trajectory]:
    call = LLMCall(
        prompt_ids=[257, 50],
        response_ids=[50, 258],
        response_logprobs=[-1.0, -1.0],
        finish_reason="stop",
    )
    return [
        Trajectory(
            job_id=f"val-{i}",
            agent=AGENT,
            task_id=f"v{i}",
            group_id=f"val-{i // 4}",
            group_size=4,
            run=RUN,
            status="ok",
            reward=1.0,
            is_train=False,
            calls=[call],
        )
        for i in range(n)
    ]


async def trainer(nats_url: str, tmp: Path, *flags: str) -> TrainerChild:
    return await TrainerChild.start(
        nats_url, tmp, "--groups-per-step", "2", *flags, run=RUN, agent=AGENT
    )


@pytest.fixture
def model_dir():
    return ensure_tiny_model()


async def test_sigkill_then_resume_trains_every_trajectory_exactly_once(
    js, topology, nats_url, tmp_path, model_dir
):
    first_batch, second_batch = (
        trajectories(range(6), errors=True),
        trajectories(range(6, 10), errors=True),
    )
    await publish(js, topology, first_batch + validation(4))  # enough for three steps of 2 groups
    first = await trainer(nats_url, tmp_path, "--checkpoint-every", "2", "--max-steps", "5")
    await first.wait_for("checkpoint saved", step=2)
    await first.wait_for("step done", step=3)  # trained, not checkpointed; then waits for data
    first.proc.send_signal(signal.SIGKILL)
    assert await first.proc.wait() == -signal.SIGKILL

    kv = await js.key_value(topology.policy_bucket)
    last = decode(WeightUpdate, (await kv.get(RUN)).value).version  # 2 or 3: killed around there
    await publish(js, topology, second_batch + validation(8)[4:])
    second = await trainer(
        nats_url, tmp_path, "--checkpoint-every", "2", "--max-steps", "5", "--resume"
    )
    resumed = await second.wait_for("resumed")
    assert resumed["step"] == 2
    assert await second.exit_code() == 0
    # whatever the killed trainer published after its last checkpoint (v2), numbering continues
    # above it: one version number never names two sets of weights
    published = [e["version"] for e in second.events if e.get("event") == "version published"]
    assert last >= 2 and published == [last + 1, last + 2, last + 3]

    history = Checkpoints(tmp_path / "ckpt").history()
    assert [h["step"] for h in history] == [2, 4, 5]
    trained = Counter(j for h in history for j in h["trained_job_ids"])
    ok = {t.job_id for t in first_batch + second_batch if t.ok}
    assert set(trained) == ok, f"lost: {ok - set(trained)}, extra: {set(trained) - ok}"
    assert max(trained.values()) == 1, [j for j, n in trained.items() if n > 1]
    consumed = {j for h in history for j in h["consumed_job_ids"]}
    assert consumed == {t.job_id for t in first_batch + second_batch if not t.ok}
    assert not any(j.startswith("val-") for j in trained | Counter(consumed))
    # step 3 ran twice (killed before its checkpoint): the CSV keeps the resumed one
    assert [int(r["step"]) for r in read_metrics(tmp_path / "metrics.csv")] == [1, 2, 3, 4, 5]
    info = await js.consumer_info(topology.trajectories_stream, f"trainer-{RUN}-{AGENT}")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_sigterm_checkpoints_pending_steps_and_exits_zero(
    js, topology, nats_url, tmp_path, model_dir
):
    await publish(js, topology, trajectories(range(2)))
    proc = await trainer(nats_url, tmp_path, "--checkpoint-every", "100")
    await proc.wait_for("step done", step=1)
    proc.proc.send_signal(signal.SIGTERM)
    assert await proc.exit_code() == 0
    (state,) = Checkpoints(tmp_path / "ckpt").history()
    assert state["step"] == 1 and len(state["trained_job_ids"]) == 8
    info = await js.consumer_info(topology.trajectories_stream, f"trainer-{RUN}-{AGENT}")
    assert info.num_ack_pending == 0
