"""TRL's own GRPOTrainer (trl 1.16 from PyPI) learns on rollouts Agentarium runs.

Everything is real but the trainer's device: a nats-server, the local engine serving the tiny
model, a rollout consumer running ``examples.toy.any_digit`` and the weight syncer beside the
engine; TRL trains on the CPU through ``agentarium.integrations.trl``'s ``rollout_func`` and
publishes its weights after every step with the callback. With a learning rate the reward
rises within 20 steps; with learning rate 0 it does not; every step's rollouts were generated
by the weights TRL published after the step before (the engine's ``weight_version``).

The table tests pin what TRL receives for failed rollouts (no reward 0, no loss token) and how
prompts become groups.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="TRL is the `trl` extra: pip install -e '.[trl]'")

from trainlib import served  # noqa: E402
from trllib import VersionsSeen, services_running  # noqa: E402

from agentarium.examples.toy import any_digit  # noqa: E402
from agentarium.examples.trl_trainer import train  # noqa: E402
from agentarium.inference import EngineControl  # noqa: E402
from agentarium.integrations.config import RolloutConfig  # noqa: E402
from agentarium.integrations.samples import Sample, sample_of  # noqa: E402
from agentarium.integrations.trl import (  # noqa: E402
    AgentariumRollout,
    TaskRows,
    agent_reward,
    groups_of,
    sampling_of,
)
from agentarium.schemas import LLMCall, Trajectory  # noqa: E402

RUN, CONTROL, AGENT, STEPS, FROZEN = "trl", "trl-control", "digit", 20, 8


def _call(prompt, response, version="default"):
    return LLMCall(
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=[-1.0] * len(response),
        finish_reason="stop",
        weight_version=version,
    )


def _traj(job, status="ok", calls=(), reward=1.0):
    return Trajectory(
        job_id=job,
        agent=AGENT,
        task_id="p0",
        group_id="g",
        status=status,
        reward=reward if status == "ok" else None,
        calls=list(calls),
    )


def test_prompts_become_groups_of_at_most_num_generations():
    a, b = "say a", [{"role": "user", "content": "b"}]
    assert groups_of([a, a, a, b, b, b], 3) == [(0, 3), (3, 3)]
    assert groups_of([a, a, a, a], 2) == [(0, 2), (2, 2)]  # the same prompt twice in a batch
    assert groups_of([a, b, a], 8) == [(0, 1), (1, 1), (2, 1)]


def test_jobs_carry_trls_sampling_and_the_dataset_row_of_their_prompt():
    class Args:  # the GRPOConfig fields rollout_func reads
        temperature, top_p, top_k, max_completion_length = 0.7, 1.0, 0, 3

    sampling = sampling_of(Args())
    assert (sampling.temperature, sampling.top_k, sampling.max_new_tokens) == (0.7, -1, 3)
    chat = [{"role": "user", "content": "repeat 7"}]
    rows = TaskRows.of([{"prompt": chat, "answer": "7"}, {"prompt": "b", "answer": "x"}])
    assert rows.task([{"content": "repeat 7", "role": "user"}])["answer"] == "7"  # key order
    with pytest.raises(ValueError, match="in none of the rows"):
        rows.task("c")
    with pytest.raises(ValueError, match="share the prompt"):
        TaskRows.of([{"prompt": "b", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    rollout = AgentariumRollout(RolloutConfig(agent=AGENT, run=RUN), rows=rows.rows.values())
    jobs = rollout.jobs([chat, chat, "b"], [(0, 2), (2, 1)], sampling, training=True, step=4)
    assert [j.task["answer"] for j in jobs] == ["7", "7", "x"]
    assert [(j.sample_index, j.group_size) for j in jobs] == [(0, 2), (1, 2), (0, 1)]
    assert jobs[0].group_id == jobs[1].group_id != jobs[2].group_id
    assert jobs[0].sampling == sampling and jobs[0].metadata == {"trl_step": 4}
    again = rollout.jobs([chat, chat, "b"], [(0, 2), (2, 1)], sampling, training=True, step=4)
    assert not {j.job_id for j in jobs} & {j.job_id for j in again}  # fresh ids every call


def test_failed_rollouts_reach_trl_without_reward_or_loss_token():
    # the run ("default", _traj's) sampled the first turn with its version 5, the second with 6
    chained = [
        _call([1, 2], [3, 4], served("default", 5)),
        _call([1, 2, 3, 4, 9, 9], [6, 7], served("default", 6)),
    ]
    rerendered = [_call([1, 2], [3, 4]), _call([1, 2, 8, 9], [6, 7])]
    trajectories = [
        _traj("ok", calls=chained, reward=0.5),
        _traj("err", status="error"),
        _traj("late", status="timeout", calls=chained[:1]),
        None,  # never stored
        _traj("mis", calls=rerendered),
    ]
    samples = [sample_of(t) for t in trajectories]
    assert [s.status for s in samples] == ["ok", "error", "timeout", "missing", "mismatch"]
    # one multi-turn sequence: the environment's tokens (9, 9) are in it with mask 0
    assert samples[0].completion_ids == [3, 4, 9, 9, 6, 7]
    assert samples[0].mask == [1, 1, 0, 0, 1, 1]
    assert samples[0].weight_version == 5 and samples[0].turns == 2
    assert samples[0].token_versions == [5, 5, None, None, 6, 6]  # each token its own
    out = AgentariumRollout.output(samples, [(0, 5)], eos_id=258)
    assert out["agentarium_token_versions"] == [[5, 5, None, None, 6, 6]] + [[None]] * 4
    assert out["prompt_ids"] == [[1, 2]] * 5  # the group's prompt for the unusable ones
    assert out["completion_ids"][1:] == [[258]] * 4
    assert out["env_mask"][1:] == [[0]] * 4 and out["logprobs"][1:] == [[0.0]] * 4
    assert out["agentarium_reward"] == [0.5, None, None, None, None]
    assert out["agentarium_status"] == ["ok", "error", "timeout", "missing", "mismatch"]
    # the reward function hands TRL None, which TRL scores NaN: out of the group's statistics
    logged = {}
    rewards = agent_reward(
        [None] * 5, out["agentarium_reward"], log_metric=lambda k, v: logged.update({k: v})
    )
    assert rewards == [0.5, None, None, None, None] and logged == {"agentarium/failed_frac": 0.8}
    # a group where nothing came back still has a prompt
    lone = AgentariumRollout.output([Sample("missing")], [(0, 1)], eos_id=258)
    assert lone["prompt_ids"] == [[258]] and lone["env_mask"] == [[0]]


def _mean(values):
    return sum(values) / len(values)


def test_trl_grpo_learns_on_agentarium_rollouts(settings, tiny_dir, engine_url, tmp_path):
    """False-failure rate, measured and bounded: 6 runs here (AVX-512 machine, two cores shared
    with a run of tests/test_multitask_learning.py and other sessions' tests, load average
    6-13; 49-142 s each). The engine samples unseeded; TRL's seed fixes only its own side.
    - The base rate: 136 digits in 3,456 samples (the controls and each step 1): p = 0.039,
      <= 0.049 at 3 standard errors. Step 1 < 0.2 fails at >= 13 of 64: 1.4e-5 at p = 0.05
      (the old < 0.15, >= 10 of 64, was 1.2e-3 there); the control's mean < 0.15 over 512:
      1.3e-17.
    - The last 5 steps >= 0.6: every run read 1.0 from step 10 to 20; the reward first
      reached 0.5 at step 5-7 (mean 5.5, sd 0.84), and failing needs that past step 15, 11
      standard deviations late.
    - Steps 5-12 over the whole control's mean by 0.1. This was steps 5-8 over the control's
      steps 5-8, bounded at 4.5e-5 from those 6 runs (first reaching 0.5 at step 5-7), and it
      failed in the suite's first pass at 5234393: that run first reached 0.5 at step 10
      (rewards 0.0, 0.08, 0.05, 0.02, 0.02, 0.03, 0.16, 0.19, 0.28, 0.55, 0.73, ...), so the
      normal model of 6 runs was too narrow. Two runs right after read step 6 and step 5. Over
      the 9 runs the step that first reaches 0.5 has mean 6.0 and sd 1.7; from there the
      reward climbs to about 1.0 within 3-4 steps (every run), so steps 5-12 average under
      0.15 only when it comes at step 12 or later: z = 3.6, 1.6e-4 under a normal model of
      those 9 (the slow run above: 0.35 over 5-12, passing with margin 0.21).
    Together under 5e-4 a run.

    The runs are the issue-31 scenario: run A learns, then run B, the control (lr 0), runs on
    the same engine, as anyone runs a baseline after an experiment. B's syncer takes the
    engine over from A's weights (A's syncer has stopped): B must sample the base weights,
    which the engine's checksum shows exactly and B's reward near the random policy's shows as
    a user sees it; every B sample is stamped with B's versions, none with A's."""

    async def checksum() -> str:
        async with EngineControl() as control:
            return (await control.weights_checksum(engine_url))["checksum"]

    seen, control_seen = VersionsSeen(), VersionsSeen()
    services = dict(
        settings=settings,
        name="trl-test-services",
        agent=AGENT,
        agent_fn=any_digit,
        engine_url=engine_url,
        weights_dir=tmp_path / "w",
    )
    with services_running(run=RUN, **services) as loop:
        base = loop.call(checksum())
        config = RolloutConfig(agent=AGENT, run=RUN, deadline_s=60, grace_s=30)
        learned = train(
            config,
            model_dir=str(tiny_dir),
            steps=STEPS,
            settings=settings,
            seed=1,
            extra_rewards=[seen],
        )
        assert loop.call(checksum()) != base  # the engine serves run A's learned weights
    with services_running(run=CONTROL, **services) as loop:  # run B on the same engine
        config = RolloutConfig(agent=AGENT, run=CONTROL, deadline_s=60, grace_s=30)
        frozen = train(
            config,
            model_dir=str(tiny_dir),
            steps=FROZEN,
            lr=0.0,
            settings=settings,
            seed=1,
            extra_rewards=[control_seen],
        )
        assert loop.call(checksum()) == base  # B took the engine over: the base weights
    frozen_reward = [e["reward"] for e in frozen]
    learned_reward = [e["reward"] for e in learned]
    print(f"reward per step: lr 1e-2 {learned_reward}; lr 0 {frozen_reward}")  # shown with -s
    assert len(frozen_reward) == FROZEN and len(learned_reward) == STEPS
    # a random policy says a digit 10 times in 263 (about 0.04)
    # (step 1 samples the weights TRL starts from, as every step of the control does)
    assert learned_reward[0] < 0.2 and _mean(frozen_reward) < 0.15, frozen_reward  # docstring
    assert _mean(learned_reward[-5:]) >= 0.6, learned_reward
    # the control over the same steps: learning, not the pipeline, raised the reward
    assert _mean(learned_reward[4:12]) > _mean(frozen_reward) + 0.1, learned_reward
    # Each step's rollouts all came from the version published after the step before: each
    # run publishes version 1 at its start, then one a step, so step s (from 1) samples
    # version s of its own run, run A's and run B's alike (B's never A's: another run's
    # weights are no version of B's).
    assert seen.steps == [{s} for s in range(1, STEPS + 1)], seen.steps
    assert control_seen.steps == [{s} for s in range(1, FROZEN + 1)], control_seen.steps
