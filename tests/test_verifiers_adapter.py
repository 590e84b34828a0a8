"""verifiers environments as agents, through a real worker on a real nats-server.

The environments are built from verifiers' own classes (tests/vf_envs.py: a SingleTurnEnv and
a ToolEnv on in-memory datasets) and named as the CLI names them (``verifiers:ENV_ID``,
``verifiers:module:function``). The LLM is a fake that follows SGLang's shapes and answers
from the prompt it is sent, so the rubric's reward depends on what went through the proxy.
"""

from __future__ import annotations

import re
import signal

import pytest
from fake_sglang import FakeSGLang, dead_url
from worker_env import tiny_template, worker_for

from agentarium.consumers import AgentLoadError, AgentSpec, VerifiersAgent, load_callable
from agentarium.consumers.agents.verifiers_agent import rollout_input
from agentarium.producers import TaskProducer, TrajectoryReader

ANSWERS = {"What is 2+3?": "5", "What is 4+4?": "7"}  # the second one is wrong (8)
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def reply(body: dict) -> tuple[list[int], str]:
    """Answer as a model would from the rendered prompt: call ``add`` when tools are offered
    and no tool answered yet, then repeat the tool's result; else the scripted answer."""
    template = tiny_template()
    prompt = template.decode(body["input_ids"])
    if "<tools>" in prompt:
        found = re.search(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.S)
        text = found.group(1) if found else TOOL_CALL
    else:
        text = next(a for q, a in ANSWERS.items() if q in prompt)
    return template.encode(text) + [template.eos_token_ids[0]], text


@pytest.fixture
async def fake():
    server = FakeSGLang(reply=reply)
    await server.start()
    yield server
    await server.close()


async def _run(js, agent, urls, tasks, run):
    await TaskProducer(js).submit("vf", tasks, run=run, group_size=1)
    async with worker_for(js, "vf", agent, urls) as worker:
        await worker.run()
    trajs = await TrajectoryReader(js).read(run)
    return sorted(trajs, key=lambda t: t.task_id)


async def test_a_single_turn_env_is_scored_by_its_rubric(js, fake):
    agent = load_callable("verifiers:vf_envs")  # vf.load_environment("vf_envs")
    assert isinstance(agent, VerifiersAgent)
    tasks = [
        {"task_id": "a", "question": "What is 2+3?", "answer": "5"},  # a row of its own
        {"task_id": "b", "example_id": 1},  # a row of the environment's dataset
    ]
    right, wrong = await _run(js, agent, [fake.url], tasks, "vf-single")
    assert (right.status, right.reward, right.metrics) == (
        "ok",
        1.0,
        {"correct_answer": 1.0, "num_turns": 1.0},
    )
    assert (wrong.status, wrong.reward, wrong.metrics) == (
        "ok",
        0.0,
        {"correct_answer": 0.0, "num_turns": 1.0},
    )
    template = tiny_template()
    for traj, answer in ((right, "5"), (wrong, "7")):
        (call,) = traj.calls  # the one model call, recorded token by token
        sent = next(r for r in fake.requests if r["input_ids"] == call.prompt_ids)
        assert call.response_ids == template.encode(answer) + [template.eos_token_ids[0]]
        assert len(call.response_logprobs) == len(call.response_ids)
        assert sent["sampling_params"]["temperature"] == 1.0  # the job's sampling
        assert call.messages[0] == {"role": "system", "content": "Answer with the number only."}
    assert wrong.calls[0].messages[-2] == {"role": "user", "content": "What is 4+4?"}


async def test_a_tool_env_calls_its_tool_through_the_proxy(js, fake):
    agent = load_callable("verifiers:vf_envs:tool_environment")
    tasks = [{"task_id": "t", "example_id": 0}]
    (traj,) = await _run(js, agent, [fake.url], tasks, "vf-tools")
    assert traj.status == "ok"
    assert traj.reward == 1.0  # the tool ran: add(2, 3) -> "5" -> the model repeats it
    assert traj.metrics == {
        "correct_answer": 1.0,
        "num_turns": 2.0,
        "total_tool_calls": 1.0,
        "add_calls": 1.0,
    }
    first, second = traj.calls
    assert first.finish_reason == "tool_calls"
    rendered = tiny_template().decode(first.prompt_ids)  # the tool was offered to the model
    (offered,) = re.findall(r"<tools>\n(.*?)\n</tools>", rendered, re.S)
    assert '"name": "add"' in offered
    # the second call's prompt extends the first with the call and the tool's result
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    assert second.messages[-2]["role"] == "tool" and second.messages[-2]["content"] == "5"
    assert second.response_ids == tiny_template().encode("5") + [tiny_template().eos_token_ids[0]]


async def test_an_unreachable_llm_is_an_error_not_a_zero(js):
    agent = load_callable("verifiers:vf_envs")
    tasks = [{"task_id": "a", "question": "What is 2+3?", "answer": "5"}]
    (traj,) = await _run(js, agent, [dead_url()], tasks, "vf-down")
    assert traj.status == "error"
    assert "LLM backend failed" in traj.error


def test_specs_and_rows():
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    agent = load_callable("verifiers:vf_envs:load_environment")
    # verifiers installs its own handlers when an environment is built: the loader restores
    # the process's, so a consumer still drains on SIGTERM
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    spec = AgentSpec.of(agent, "vf")
    assert (spec.style, spec.kind) == ("endpoint", "async")
    with pytest.raises(AgentLoadError, match="group-level"):
        load_callable("verifiers:vf_envs:group_scored_environment")
    with pytest.raises(AgentLoadError, match="no_such_env"):
        load_callable("verifiers:no_such_env")
    with pytest.raises(AgentLoadError, match="names no environment"):
        load_callable("verifiers:")
    # a string prompt is a question: the environment's system prompt comes first
    row = rollout_input(agent.env, {"prompt": "What is 2+3?", "answer": "5"})
    assert row["prompt"] == [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    with pytest.raises(ValueError, match="example_id"):
        rollout_input(agent.env, {"text": "?"})
