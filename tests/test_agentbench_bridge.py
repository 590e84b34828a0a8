"""The AgentBench bridge against a small worker that speaks AgentBench's HTTP shapes.

tests/agentbench_worker.py serves both dialects (classic AgentBench v0.2 text turns, and the
function-calling AgentBench FC on AgentRL's worker); the bridge class is driven directly, as
``agentarium env serve`` would: ``cls()``, reset, steps, close.
"""

from __future__ import annotations

import socket

import pytest
from agentbench_worker import TOOLS, Worker, WorkerThread

from agentarium.environments import AgentBenchEnvironment, AgentBenchError, bridge_class
from agentarium.environments.agentbench import (
    BadTask,
    SessionLost,
    TaskFailed,
    WorkerProtocolError,
    WorkerUnavailable,
)


@pytest.fixture(params=["classic", "fc"])
def served(request):
    with WorkerThread(Worker(request.param)) as thread:
        yield thread


def _say(dialect: str, kind: str, text: str, call_id: str = "c1") -> dict:
    """The assistant's turn: a tool call (fc) or the classic task's text format."""
    if dialect == "classic":
        return {"role": "assistant", "content": f"Action: {kind} {text}"}
    name, key = (
        ("calculate", "expression") if kind == "calculate" else ("commit_final_answer", "answer")
    )
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": {key: text}}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_indices_and_status_come_from_the_worker(served):
    env_class = bridge_class(served.url)
    assert env_class.indices() == ["0", "1", "2", "3"]
    assert env_class.name == "agentbench"
    assert bridge_class(served.url, name="mathqa").name == "mathqa"


async def test_worker_status(served):
    env_class = bridge_class(served.url)
    assert await env_class.worker_status() == {"concurrency": 4, "current": 0}


async def test_a_solved_episode_scores_one(served):
    dialect = served.worker.dialect
    env = bridge_class(served.url)()
    observation = await env.reset({"index": 0})
    assert observation.info["dialect"] == dialect
    assert "17 + 25" in observation.messages[-1]["content"]
    assert observation.messages[-1]["role"] == "user"
    assert await bridge_class(served.url).worker_status() == {"concurrency": 4, "current": 1}

    first = await env.step(_say(dialect, "calculate", "17+25"))
    assert not first.done
    assert first.seq == 1
    assert "42" in first.messages[-1]["content"]
    if dialect == "fc":  # the tool result answers the call it belongs to
        assert first.messages == [{"role": "tool", "tool_call_id": "c1", "content": "42"}]
    else:
        assert first.messages == [{"role": "user", "content": "Result: 42"}]

    last = await env.step(_say(dialect, "answer", "42", call_id="c2"))
    assert last.done
    assert last.reward == 1.0
    outcome = await env.close()
    assert outcome.score == 1.0
    assert outcome.steps == 2
    assert outcome.info["status"] == "completed"
    assert served.worker.sessions == {}
    assert served.worker.cancelled == []  # a finished episode is not cancelled


async def test_a_wrong_answer_scores_zero(served):
    dialect = served.worker.dialect
    env = bridge_class(served.url)()
    await env.reset({"index": 1})
    result = await env.step(_say(dialect, "answer", "36"))
    assert result.done
    outcome = await env.close()
    assert outcome.score == 0.0
    assert outcome.info["status"] == "completed"
    assert outcome.steps == 1


async def test_the_turn_limit_scores_zero(served):
    dialect = served.worker.dialect
    env = bridge_class(served.url)()
    await env.reset({"index": 2})
    results = [await env.step(_say(dialect, "calculate", "1+1")) for _ in range(4)]
    assert [r.done for r in results] == [False, False, False, True]
    outcome = await env.close()
    assert (outcome.score, outcome.info["status"]) == (0.0, "task limit reached")


async def test_closing_early_cancels_the_session(served):
    dialect = served.worker.dialect
    env = bridge_class(served.url)()
    observation = await env.reset({"index": 0})
    await env.step(_say(dialect, "calculate", "2*3"))
    outcome = await env.close()
    assert outcome.score == 0.0
    assert outcome.info["status"] == "cancelled"
    assert "cancel_error" not in outcome.info
    assert served.worker.cancelled == [int(observation.info["session_id"])]
    assert await bridge_class(served.url).worker_status() == {"concurrency": 4, "current": 0}


async def test_a_task_that_raises_is_an_error_not_a_zero(served):
    dialect = served.worker.dialect
    env = bridge_class(served.url)()
    await env.reset({"index": 3})
    with pytest.raises(TaskFailed) as caught:
        await env.step(_say(dialect, "calculate", "1/0"))
    assert caught.value.code == 500
    if dialect == "classic":  # v0.2 sends the traceback: its last line is the message
        assert "ZeroDivisionError" in str(caught.value)
    outcome = await env.close()
    assert outcome.info["status"] == "task error"
    assert served.worker.cancelled == []


async def test_function_calling_tools_and_messages_pass_through():
    with WorkerThread(Worker("fc")) as served:
        env = bridge_class(served.url, dialect="fc")()
        observation = await env.reset({"index": "0"})  # a string index maps to the worker's int
        assert observation.tools == TOOLS
        assert [m["role"] for m in observation.messages] == ["system", "user"]
        await env.step(_say("fc", "calculate", "17+25"))
        # the assistant message reaches the worker as an OpenAI message; dict arguments as JSON
        assert served.worker.received[0]["messages"] == [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "calculate", "arguments": '{"expression": "17+25"}'},
                    }
                ],
            }
        ]
        result = await env.step(
            {
                "role": "assistant",
                "content": "done",
                "tool_calls": [
                    {"function": {"name": "commit_final_answer", "arguments": '{"answer": "42"}'}}
                ],
            }
        )
        assert result.done and result.reward == 1.0
        assert result.info["metric"] == {"correct": 1.0, "score": 1.0}
        assert served.worker.received[1]["messages"][0]["tool_calls"][0]["id"] == "call_2_0"
        outcome = await env.close()
        assert outcome.score == 1.0
        assert outcome.metrics == {"correct": 1.0, "score": 1.0}


async def test_classic_turns_map_roles_and_take_the_content():
    with WorkerThread(Worker("classic")) as served:
        env = bridge_class(served.url, dialect="classic")()
        observation = await env.reset({"index": 0})
        assert observation.tools == []
        assert observation.messages[0]["role"] == "user"
        await env.step(
            {"role": "assistant", "content": [{"type": "text", "text": "Action: answer 42"}]}
        )
        assert served.worker.received[0]["agent_response"] == {
            "status": "normal",
            "content": "Action: answer 42",
        }
        outcome = await env.close()
        assert outcome.score == 1.0  # read from the sample's result {"result": true, ...}
        assert outcome.info["result"] == {"result": True, "answer": "42"}


def test_overall_adds_the_workers_own_numbers():
    from agentarium.schemas import SessionOutcome

    with WorkerThread(Worker("classic")) as served:
        outcomes = [
            SessionOutcome(
                score=1.0, info={"index": 0, "status": "completed", "result": {"result": True}}
            ),
            SessionOutcome(
                score=0.0, info={"index": 1, "status": "completed", "result": {"result": False}}
            ),
        ]
        assert bridge_class(served.url).overall(outcomes) == {
            "score": 0.5,
            "worker.total": 2.0,
            "worker.accuracy": 0.5,
        }


async def test_a_full_worker_is_unavailable():
    with WorkerThread(Worker("fc", concurrency=1)) as served:
        env_class = bridge_class(served.url)
        first = env_class()
        await first.reset({"index": 0})
        with pytest.raises(WorkerUnavailable, match="full") as caught:
            await env_class().reset({"index": 1})
        assert caught.value.code == 503
        await first.close()


async def test_bad_tasks_are_refused_before_any_session():
    with WorkerThread(Worker("classic")) as served:
        env_class = bridge_class(served.url)
        for task in ({"index": "nine"}, {"question": "?"}, {"index": True}):
            with pytest.raises(BadTask) as caught:
                await env_class().reset(task)
            assert caught.value.code == 400
        with pytest.raises(BadTask, match="classic"):  # a custom task on a classic worker
            await env_class().reset({"custom_task": {"q": "?"}})
        assert served.worker.sessions == {}  # the session it opened was cancelled


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_a_worker_that_is_down_is_unavailable_with_its_url():
    url = _closed_port_url()
    env_class = bridge_class(url)
    assert env_class.url == url + "/api"  # a bare host:port gets AgentBench's /api
    with pytest.raises(WorkerUnavailable, match=r"unreachable") as caught:
        await env_class().reset({"index": 0})
    assert url in str(caught.value)
    with pytest.raises(WorkerUnavailable):
        env_class.indices()


async def test_a_worker_that_dies_mid_session_loses_the_session():
    with WorkerThread(Worker("fc")) as served:
        env = bridge_class(served.url)()
        await env.reset({"index": 0})
        served.stop()
        with pytest.raises(SessionLost, match="mid-session") as caught:
            await env.step(_say("fc", "calculate", "1+1"))
        assert caught.value.code == 404
        outcome = await env.close()  # nothing to cancel: the close is quick and says so
        assert outcome.info["status"] == "lost"
        assert outcome.score == 0.0


async def test_an_answer_that_is_not_json_is_a_protocol_error():
    with WorkerThread(Worker("fc", broken=True)) as served:
        with pytest.raises(WorkerProtocolError, match="not JSON"):
            await bridge_class(served.url)().reset({"index": 0})


def test_the_class_needs_a_url():
    with pytest.raises(ValueError, match="for_url"):
        AgentBenchEnvironment()
    with pytest.raises(ValueError, match="expected"):
        bridge_class("localhost:5001")
    with pytest.raises(ValueError, match="dialect"):
        bridge_class("http://127.0.0.1:5001/api", dialect="v3")
    assert issubclass(WorkerUnavailable, AgentBenchError)
