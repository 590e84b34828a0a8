"""AgentOrchestrator, the seed's API, end to end: real nats-server, in-process consumers, and a
FakeSGLang with known output ids, so every tensor of the training batch can be checked exactly."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest
from orchestrator_env import ThreadedFake

from agentarium import AgentOrchestrator
from agentarium.broker import NatsSettings, Topology
from agentarium.examples import openai_agent
from agentarium.orchestrator import BatchDataError

OUTPUT = [49, 50, 258]  # "1", "2", <|im_end|>
PAD = 256  # the tiny model's pad token (<|endoftext|>)


async def plain(task: dict, llm) -> dict:
    """A plain async agent: one call; the reward comes from the task, or NaN on request."""
    await llm.chat([{"role": "user", "content": task["prompt"]}], max_new_tokens=8)
    reward = float("nan") if task.get("fail") else float(task["n"])
    return {"reward": reward, "metrics": {"n": float(task["n"])}}


async def two_turns(task: dict, llm) -> float:
    """Answer, get a tool observation, answer again: a concatenable multi-turn rollout."""
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await llm.chat(messages, max_new_tokens=8)
    messages += [first.message, {"role": "user", "content": "observation: 7"}]
    await llm.chat(messages, max_new_tokens=8)
    return 1.0


@pytest.fixture(scope="module")
def fake():
    with ThreadedFake(output_ids=OUTPUT, text="12") as server:
        yield server


@pytest.fixture
def orch(nats_url, fake):
    orchestrator = AgentOrchestrator(
        [fake.url],
        nats_url=nats_url,
        group_size=2,
        advertise_host="127.0.0.1",
        proxy_host="127.0.0.1",
        concurrency=8,
        attempts=1,
        progress=False,
    )
    yield orchestrator
    orchestrator.close()


def tasks_stored(nats_url: str) -> int:
    async def count() -> int:
        nc = await NatsSettings(url=nats_url).connect()
        try:
            return (await nc.jetstream().stream_info(Topology().tasks_stream)).state.messages
        finally:
            await nc.close()

    return asyncio.run(count())


def test_training_and_validation_loops(orch, fake):
    orch.register_agent_type("plain", plain)
    orch.register_agent_type("multi", two_turns)

    # training step: verl-style columns (numpy object arrays), agent per row
    data = {
        "prompt": np.array(["a", "bbb", "cc"], dtype=object),
        "n": np.array([1, 2, 3]),
        "agent_name": np.array(["plain", "plain", "multi"], dtype=object),
    }
    state = orch.initialize_batch_processing(data=data, is_train=True)
    assert state.batch_id.startswith("b000000-") and len(state.job_ids) == 6
    assert orch.wait_for_batch_completion(timeout=60) == {
        "jobs": 6,
        "ok": 6,
        "error": 0,
        "timeout": 0,
    }
    P, R = 96, 40
    batch, metrics = orch.generate_training_batch(
        max_prompt_length=P, max_response_length=R, device="cpu"
    )

    trajectories = orch.trajectories()
    assert len(batch) == 6 and batch["input_ids"].shape == (6, P + R)
    assert batch["prompts"].shape == (6, P) and batch["responses"].shape == (6, R)
    for key in ("attention_mask", "position_ids"):
        assert batch[key].shape == (6, P + R)
    for key in ("response_mask", "rollout_log_probs", "token_level_scores"):
        assert batch[key].shape == (6, R)
    for i, traj in enumerate(trajectories):
        assert batch["job_id"][i] == traj.job_id and batch["uid"][i] == traj.group_id
        assert batch["status"][i] == "ok" and batch["agent_name"][i] == traj.agent
        prompt = traj.calls[0].prompt_ids
        # prompt left-padded, response right-padded
        assert batch["prompts"][i, P - len(prompt) :].tolist() == prompt
        assert set(batch["prompts"][i, : P - len(prompt)].tolist()) == {PAD}
        assert batch["attention_mask"][i, :P].tolist() == [0] * (P - len(prompt)) + [1] * len(
            prompt
        )
        assert batch["position_ids"][i, P - len(prompt)] == 0
        assert (
            batch["input_ids"][i].tolist()
            == batch["prompts"][i].tolist() + batch["responses"][i].tolist()
        )
        if traj.agent == "plain":
            assert batch["responses"][i, :3].tolist() == OUTPUT
            assert set(batch["responses"][i, 3:].tolist()) == {PAD}
            assert batch["response_mask"][i].tolist() == [1, 1, 1] + [0] * (R - 3)
            assert batch["rollout_log_probs"][i, :3].tolist() == pytest.approx([-0.1, -0.2, -0.3])
            assert batch["token_level_scores"][i].tolist() == [0, 0, traj.reward] + [0] * (R - 3)
            assert traj.reward == traj.task["n"]
        else:  # concatenated: reply 1, the chat markup and observation (mask 0), reply 2
            second = traj.calls[1]
            gap = len(second.prompt_ids) - len(prompt) - 3
            mask = [1, 1, 1] + [0] * gap + [1, 1, 1]
            assert batch["response_mask"][i, : len(mask)].tolist() == mask
            assert (
                batch["responses"][i, : len(mask)].tolist()
                == second.prompt_ids[len(prompt) :] + OUTPUT
            )
            scores = batch["token_level_scores"][i].tolist()
            assert scores[len(mask) - 1] == 1.0 and sum(scores) == 1.0
    groups = {}
    for uid, job in zip(batch["uid"], batch["job_id"], strict=True):
        groups.setdefault(uid, []).append(job)
    assert sorted(len(v) for v in groups.values()) == [2, 2, 2]
    assert metrics["batch/concatenated"] == 2 and metrics["batch/truncated_prompts"] == 0
    assert metrics["plain/reward_mean"] == 1.5 and metrics["multi/turns_mean"] == 2
    assert metrics["overall/ok"] == 6 and metrics["batch/missing"] == 0

    # truncation is counted, never silent; per-call mode gives one row per call
    small, counts = orch.generate_training_batch(
        max_prompt_length=8, max_response_length=2, multi_turn="per-call"
    )
    assert len(small) == 8 and counts["batch/truncated_prompts"] == 8
    assert counts["batch/truncated_responses"] == 8 and counts["batch/truncated_model_tokens"] == 8
    assert small["token_level_scores"][:, 1].tolist() == [1, 1, 2, 2, 1, 1, 1, 1]
    assert small["call_index"].tolist() == [0, 0, 0, 0, 0, 1, 0, 1]
    orch.reset_orchestrator_state()

    # validation step: a failed rollout is an error, not a reward of 0
    val = [{"prompt": "x", "n": 1}, {"prompt": "y", "n": 0}, {"prompt": "z", "n": 1, "fail": True}]
    orch.initialize_batch_processing(data=val, is_train=False, agent="plain", group_size=3)
    assert orch.wait_for_batch_completion(timeout=60)["error"] == 3
    metrics = orch.collect_validation_metrics()
    assert metrics["plain/rollouts"] == 9 and metrics["plain/errors"] == 3
    assert (
        metrics["plain/reward_mean"] == pytest.approx(0.5) and metrics["plain/success_rate"] == 0.5
    )
    assert metrics["plain/pass@1"] == 0.5 and metrics["plain/pass@3"] == 0.5
    assert metrics["overall/latency_p50_s"] > 0 and metrics["overall/turns_mean"] == 1
    assert all(t.is_train is False for t in orch.trajectories())
    val_batch, val_counts = orch.generate_training_batch(16, 4)
    assert len(val_batch) == 6 and val_counts["batch/dropped_error"] == 3
    orch.reset_orchestrator_state()


def test_openai_sdk_and_plain_async_agents_routed_by_agent_name(orch, fake):
    orch.register_agent_type("sdk", openai_agent.rollout, model="tiny")
    orch.register_agent_type("plain", plain)
    rows = [
        {"prompt": f"p{i}", "answer": "12", "n": i, "agent_name": "sdk" if i % 2 else "plain"}
        for i in range(4)
    ]
    orch.initialize_batch_processing(rows, is_train=True, group_size=1)
    orch.wait_for_batch_completion(timeout=60)
    trajectories = orch.trajectories()
    assert [t.agent for t in trajectories] == ["plain", "sdk", "plain", "sdk"]
    for traj in trajectories:
        assert traj.status == "ok", traj.error
        [call] = traj.calls
        assert call.response_ids == OUTPUT and call.prompt_ids  # traced token by token
        assert call.backend == fake.url
    assert [t.reward for t in trajectories if t.agent == "sdk"] == [
        1.0,
        1.0,
    ]  # "12" starts with "12"
    metrics = orch.collect_validation_metrics()
    assert metrics["sdk/rollouts"] == 2 and metrics["plain/rollouts"] == 2
    orch.reset_orchestrator_state()


def test_bad_data_fails_fast_before_anything_is_published(orch, nats_url):
    orch.register_agent_type("a", plain)
    orch.register_agent_type("b", plain)
    before = tasks_stored(nats_url)
    cases = [
        ([{"prompt": "x", "n": 1}], "name no agent"),
        ([{"prompt": "x", "n": 1, "agent_name": "nobody"}], "'nobody', which is not registered"),
        ([], "empty"),
        ({}, "empty"),
        ({"prompt": ["x", "y"], "n": [1], "agent_name": ["a", "a"]}, "ragged columns"),
        ({"prompt": "x", "n": 1}, "single task"),
        ([{"id": 1, "agent_name": "a"}, {"id": 1, "agent_name": "b"}], "share task id"),
        ([{"prompt": object(), "agent_name": "a"}], "cannot be sent as JSON"),
    ]
    for data, message in cases:
        with pytest.raises(BatchDataError, match=message):
            orch.initialize_batch_processing(data, is_train=True)
    assert tasks_stored(nats_url) == before
    with pytest.raises(RuntimeError, match="initialize_batch_processing"):
        orch.wait_for_batch_completion()
    # a good batch still goes through afterwards
    orch.initialize_batch_processing([{"prompt": "x", "n": 1, "agent_name": "b"}], is_train=True)
    assert orch.wait_for_batch_completion(timeout=60)["ok"] == 2


def test_verl_dataproto_columns_progress_bar_and_reset(orch, capsys):
    orch.register_agent_type("plain", plain)
    orch.progress = True  # draw the bar even though pytest's stderr is not a terminal
    proto = SimpleNamespace(
        non_tensor_batch={
            "prompt": np.array(["q"], dtype=object),
            "n": np.array([2]),
            "data_source": np.array(["x/y"]),
        }
    )
    orch.initialize_batch_processing(proto, is_train=True)
    orch.wait_for_batch_completion(timeout=60)
    assert "2/2 rollouts  ok=2" in capsys.readouterr().err
    batch, _ = orch.generate_training_batch(128, 8)
    assert not any(math.isnan(x) for x in batch["token_level_scores"].flatten().tolist())
    with pytest.raises(RuntimeError, match="reset_orchestrator_state"):
        orch.initialize_batch_processing([{"prompt": "q", "n": 2}], is_train=True)


def test_embedded_broker_when_no_nats_url(fake):
    with AgentOrchestrator(
        [fake.url], advertise_host="127.0.0.1", proxy_host="127.0.0.1", progress=False
    ) as orch:
        server = orch._runtime.core.server
        assert server is not None and orch.nats_url == server.url
        orch.register_agent_type("plain", plain)
        orch.initialize_batch_processing([{"prompt": "q", "n": 1}], is_train=False)
        assert orch.wait_for_batch_completion(timeout=60)["ok"] == 1
    assert server._proc.poll() is not None  # stopped with the orchestrator
    with pytest.raises(RuntimeError, match="closed"):
        orch.initialize_batch_processing([{"prompt": "q", "n": 1}])
