"""The AgentBench bridge: an AgentBench task worker, served unchanged as an environment.

AgentBench (THUDM/AgentBench) runs each benchmark as an HTTP *task worker* that a controller
drives: ``/start_sample`` opens a session on a task index, ``/interact`` hands the agent's turn
in and waits for the environment's, ``/cancel`` ends a session early, ``/get_indices`` lists
the tasks, ``/worker_status`` tells the load and ``/calculate_overall`` scores many results.
``AgentBenchEnvironment`` plays that controller for one session, so ``agentarium env serve``
serves any AgentBench task over NATS (``bridge_class(url)`` builds the class for a worker).

Two dialects answer on those routes; the bridge tells them apart by the first reply's shape
(or is told: ``dialect="fc"|"classic"``):

- ``fc``: AgentBench FC, the function-calling AgentBench on AgentRL's worker
  (``agentrl-worker``): OpenAI messages and ``tools`` both ways, the assistant message goes in
  as it is, a reward comes back with the last turn. This interface's own shape.
- ``classic``: AgentBench v0.2: text turns ``{"role": "user"|"agent", "content"}``; the
  assistant message's ``content`` goes in; the score is read from the sample's ``result``.

docs/design.md ("The AgentBench bridge") maps every field. Errors, by what the caller does:

AgentBenchError          (code 500) the root; ``code`` is the ENV_ERROR_CODES code to answer
├── WorkerUnavailable    (503) the worker cannot take a session now: unreachable, timed out, or
│                        full (HTTP 406); try again later or on another worker
├── SessionLost          (404) the worker no longer holds the session: it restarted, died or
│                        stopped answering mid-session; the rollout is an error, never a 0
├── BadTask              (400) the task is not ``{"index": id}`` of ``indices()`` (nor a
│                        ``custom_task`` for a function-calling worker)
├── TaskFailed           (500) the task itself raised on the worker (status ``task error``)
└── WorkerProtocolError  (500) an answer outside the protocol: another HTTP error, a body that
                         is not JSON, a missing field
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from typing import Any, ClassVar

import aiohttp

from agentarium.schemas import Observation, SessionOutcome, StepResult

from .agentbench_http import (
    AgentBenchError,
    BadTask,
    SessionIdTaken,
    SessionLost,
    TaskFailed,
    WorkerProtocolError,
    WorkerUnavailable,
    request,
    request_sync,
    traceback_tail,
    worker_api,
)
from .base import Environment

__all__ = [
    "AgentBenchEnvironment",
    "AgentBenchError",
    "BadTask",
    "SessionLost",
    "TaskFailed",
    "WorkerProtocolError",
    "WorkerUnavailable",
    "bridge_class",
    "worker_api",
]

log = logging.getLogger("agentarium.environments")

DIALECTS = ("auto", "fc", "classic")
RUNNING, TASK_ERROR, CANCELLED = "running", "task error", "cancelled"
# A classic sample's result has no common score field: these are read in this order.
SCORE_KEYS = ("score", "reward", "result", "is_correct", "correct", "success")
RESULT_INFO_CHARS = 4096  # a bigger result goes into the outcome's info cut to this


def bridge_class(url: str, **options: Any) -> type[AgentBenchEnvironment]:
    """The environment class fronting the AgentBench worker at ``url`` (what
    ``agentarium env bridge --agentbench URL`` serves); options as ``for_url``."""
    return AgentBenchEnvironment.for_url(url, **options)


class AgentBenchEnvironment(Environment):
    """One session on an AgentBench task worker. Bind it to a worker with ``for_url``."""

    name = "agentbench"
    url: ClassVar[str] = ""
    dialect: ClassVar[str] = "auto"
    timeout_s: ClassVar[float] = 600.0  # one request: an /interact waits for the environment
    connect_timeout_s: ClassVar[float] = 10.0
    score_key: ClassVar[str | None] = None  # classic: the result field holding the score
    _index_table: ClassVar[dict[str, Any] | None] = None  # str(index) -> the worker's index

    @classmethod
    def for_url(
        cls,
        url: str,
        *,
        name: str | None = None,
        dialect: str = "auto",
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        score_key: str | None = None,
    ) -> type[AgentBenchEnvironment]:
        """A subclass bound to the worker at ``url``; its instances are built with ``cls()``."""
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r}: expected one of {', '.join(DIALECTS)}")
        if not (timeout_s > 0 and connect_timeout_s > 0):
            raise ValueError("timeout_s and connect_timeout_s must be > 0")
        attrs = {
            "__module__": cls.__module__,
            "__doc__": f"The AgentBench task worker at {worker_api(url)}.",
            "url": worker_api(url),
            "name": name or cls.name,
            "dialect": dialect,
            "timeout_s": float(timeout_s),
            "connect_timeout_s": float(connect_timeout_s),
            "score_key": score_key,
            "_index_table": None,
        }
        return type("AgentBenchBridge", (cls,), attrs)

    def __init__(self) -> None:
        if not self.url:
            raise ValueError(
                "AgentBenchEnvironment has no worker URL: build the class with "
                "AgentBenchEnvironment.for_url(URL) (agentarium env bridge --agentbench URL)"
            )
        self._http: aiohttp.ClientSession | None = None
        self._session_id: int | None = None
        self._dialect = self.dialect
        self._index: Any = None
        self._status = ""
        self._done = False
        self._reward = 0.0  # fc: the reward of the latest reply
        self._metric: dict = {}
        self._result: Any = None  # classic: the sample's result once finished
        self._steps = 0
        self._gone = False  # the worker no longer holds the session

    # ---- the interface --------------------------------------------------------------------

    async def reset(self, task: dict) -> Observation:
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
        )
        try:
            index, custom = await self._resolve(task)
            body: dict[str, Any] = {"index": index}
            if custom is not None:
                body["custom_task"] = custom
            reply = await self._start(body)
            self._index = index
            dialect = self._detect(reply)
            if custom is not None and dialect == "classic":
                raise BadTask("a classic AgentBench worker takes only {'index': id} tasks")
            if dialect == "fc":
                messages, tools = self._fc_turn(reply), _openai_tools(reply.get("tools"))
            else:
                messages, tools = self._classic_turn(reply, opening=True), []
        except BaseException:
            await self._abandon()
            raise
        info = {"session_id": str(self._session_id), "index": index, "dialect": dialect}
        info.update(status=self._status, done=self._done)
        return Observation(messages=messages, tools=tools, info=info)

    async def step(self, action: dict) -> StepResult:
        if self._done:  # the worker ended the episode already; nothing to send
            return StepResult(seq=self._steps, done=True, info={"status": self._status})
        self._steps += 1
        reward: float | None
        body: dict[str, Any]
        if self._dialect == "fc":
            body = {"session_id": self._session_id, "messages": [_assistant(action, self._steps)]}
            reply = await self._call("/interact", body)
            env_out = reply.get("env_out") if isinstance(reply, dict) else None
            messages, reward = self._fc_turn(env_out), self._reward
        else:
            response = {"status": "normal", "content": _text(action.get("content"))}
            body = {"session_id": self._session_id, "agent_response": response}
            messages = self._classic_turn(await self._call("/interact", body), opening=False)
            reward = self._score() if self._done else None
        info: dict[str, Any] = {"status": self._status}
        if self._metric:
            info["metric"] = self._metric
        return StepResult(
            seq=self._steps, messages=messages, reward=reward, done=self._done, info=info
        )

    async def close(self) -> SessionOutcome:
        info: dict[str, Any] = {"index": self._index, "dialect": self._dialect}
        try:
            if self._session_id is not None and not (self._done or self._gone):
                await self._cancel(info)
        finally:
            await self._close_http()
        score = self._score() if self._done else 0.0
        if self._gone and not self._done:
            self._status = "lost"
        info["status"] = self._status
        metrics = _numbers(self._metric) if self._dialect == "fc" else {}
        if self._result is not None:
            text = json.dumps(self._result, default=str)
            info["result"] = (
                self._result if len(text) <= RESULT_INFO_CHARS else text[:RESULT_INFO_CHARS]
            )
        return SessionOutcome(score=score, metrics=metrics, info=info, steps=self._steps)

    @classmethod
    def indices(cls) -> list[str]:
        """The worker's task ids (``/get_indices``), as strings; fetched once per class. This
        blocks (the interface is synchronous): call it before serving, not inside a step."""
        if cls._index_table is None:
            cls._index_table = _table(request_sync(cls._bound_url(), "/get_indices", None, 30.0))
        return list(cls._index_table)

    @classmethod
    def overall(cls, outcomes: Sequence[SessionOutcome]) -> dict[str, float] | None:
        """The mean score, plus the numbers of the worker's own ``/calculate_overall`` over
        these outcomes (prefixed ``worker.``) when it can compute them."""
        scores = super().overall(outcomes)
        if scores is None:
            return None
        results = [_task_output(o) for o in outcomes]
        try:
            body = {"name": cls.name, "results": results}
            answer = request_sync(cls._bound_url(), "/calculate_overall", body, cls.timeout_s)
        except AgentBenchError as exc:
            log.warning("agentbench overall: the worker could not score: %s", exc)
            return scores
        scores.update(_numbers(answer, "worker"))
        return scores

    @classmethod
    async def worker_status(cls) -> dict[str, int]:
        """The worker's load (``/worker_status``): ``{"concurrency": n, "current": n}``."""
        timeout = aiohttp.ClientTimeout(total=30.0, sock_connect=cls.connect_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            answer = await request(http, cls._bound_url(), "/worker_status", None, lost=False)
        try:
            return {"concurrency": int(answer["concurrency"]), "current": int(answer["current"])}
        except (TypeError, KeyError, ValueError):
            raise WorkerProtocolError(f"/worker_status answered {answer!r}") from None

    # ---- the session ----------------------------------------------------------------------

    @classmethod
    def _bound_url(cls) -> str:
        if not cls.url:
            raise ValueError("AgentBenchEnvironment has no worker URL: use for_url(URL)")
        return cls.url

    async def _call(self, path: str, body: dict | None, **kwargs: Any) -> Any:
        assert self._http is not None, "reset() first"
        try:
            return await request(self._http, self.url, path, body, lost=True, **kwargs)
        except SessionLost:
            self._gone = True  # nothing left to cancel
            raise
        except TaskFailed:  # classic: HTTP 501, the worker has ended the sample
            self._status, self._done = TASK_ERROR, True
            raise

    async def _resolve(self, task: dict) -> tuple[Any, dict | None]:
        """The worker's own index for ``task`` (and the custom task, index -1, if any)."""
        if not isinstance(task, dict):
            raise BadTask(f"an AgentBench task is a dict, got {type(task).__name__}")
        if "index" in task:
            index = task["index"]
            if isinstance(index, bool) or not isinstance(index, (int, str)):
                raise BadTask(f"task index {index!r}: expected an int or a string")
            if isinstance(index, int):
                return index, None
            table = await self._indices_async()
            if index not in table:
                sample = ", ".join(list(table)[:5])
                raise BadTask(
                    f"task index {index!r} is not one of the worker's {len(table)} tasks "
                    f"({sample}{', ...' if len(table) > 5 else ''})"
                )
            return table[index], None
        if isinstance(task.get("custom_task"), dict):
            if self.dialect == "classic":
                raise BadTask("a classic AgentBench worker takes only {'index': id} tasks")
            return -1, task["custom_task"]  # AgentRL's worker: index -1 runs the custom task
        raise BadTask(
            "an AgentBench task is {'index': id} (one of indices()) or, for a "
            "function-calling worker, {'custom_task': {...}}"
        )

    async def _indices_async(self) -> dict[str, Any]:
        cls = type(self)
        if cls._index_table is None:
            assert self._http is not None
            answer = await request(self._http, self.url, "/get_indices", None, lost=False)
            cls._index_table = _table(answer)
        return cls._index_table

    async def _start(self, body: dict) -> Any:
        """``/start_sample`` with a fresh session id (ints chosen by the controller, here)."""
        assert self._http is not None
        for _ in range(3):
            session_id = secrets.randbits(53)
            try:
                reply = await request(
                    self._http,
                    self.url,
                    "/start_sample",
                    {**body, "session_id": session_id},
                    lost=False,
                )
            except SessionIdTaken:
                continue
            self._session_id = session_id
            return reply
        raise WorkerProtocolError("/start_sample refused three fresh session ids as taken")

    def _detect(self, reply: Any) -> str:
        if isinstance(reply, dict) and isinstance(reply.get("output"), dict):
            found = "classic"
        elif isinstance(reply, dict) and "messages" in reply and "finish" in reply:
            found = "fc"
        else:
            raise WorkerProtocolError(
                f"/start_sample answered neither AgentBench shape: {str(reply)[:300]}"
            )
        if self.dialect != "auto" and found != self.dialect:
            raise WorkerProtocolError(
                f"the bridge expects the {self.dialect} dialect but the worker answers {found}"
            )
        self._dialect = found
        return found

    def _fc_turn(self, env_out: Any) -> list[dict]:
        """Read a function-calling reply: new messages, status, finish, reward, metric."""
        try:
            messages, status, finish = env_out["messages"], env_out["status"], env_out["finish"]
            reward = float(env_out.get("reward") or 0.0)
            metric = env_out.get("metric") or {}
        except (TypeError, KeyError, ValueError):
            raise WorkerProtocolError(
                f"a reply without the fc fields: {str(env_out)[:300]}"
            ) from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise WorkerProtocolError(f"messages is not a list of objects: {str(messages)[:300]}")
        self._status, self._done = str(status), bool(finish) or status != RUNNING
        self._reward, self._metric = reward, metric if isinstance(metric, dict) else {}
        if self._status == TASK_ERROR:
            raise TaskFailed(f"the AgentBench task failed on the worker at {self.url}")
        return messages

    def _classic_turn(self, reply: Any, *, opening: bool) -> list[dict]:
        """Read a classic reply: the new turns (after the agent's last one), status, result."""
        output = reply.get("output") if isinstance(reply, dict) else None
        if not isinstance(output, dict) or not isinstance(output.get("status"), str):
            raise WorkerProtocolError(f"a reply without output.status: {str(reply)[:300]}")
        history = output.get("history") or []
        if not isinstance(history, list) or not all(
            isinstance(h, dict) and "role" in h for h in history
        ):
            raise WorkerProtocolError(f"output.history is not chat items: {str(history)[:300]}")
        self._status, self._result = output["status"], output.get("result")
        self._done = self._status != RUNNING
        if self._status == TASK_ERROR:
            raise TaskFailed(traceback_tail(self._result, self.url))
        if not opening:  # the worker sends the whole history: keep what followed our turn
            agent = [i for i, h in enumerate(history) if h["role"] == "agent"]
            history = history[agent[-1] + 1 :] if agent else history
        return [
            {"role": "assistant" if h["role"] == "agent" else "user", "content": h.get("content")}
            for h in history
        ]

    def _score(self) -> float:
        if self._dialect == "fc":
            return self._reward
        return _result_score(self._result, self.score_key)

    async def _cancel(self, info: dict) -> None:
        """``/cancel`` an unfinished session; the episode scores 0 whatever the answer."""
        try:
            await self._call("/cancel", {"session_id": self._session_id}, timeout=60.0)
        except SessionLost as exc:
            if "no such session" not in str(exc):  # gone, not merely finished: say so
                info["cancel_error"] = str(exc)
        except AgentBenchError as exc:
            info["cancel_error"] = str(exc)
            log.warning("agentbench: /cancel of session %s failed: %s", self._session_id, exc)
        self._status = CANCELLED

    async def _abandon(self) -> None:
        """A failed reset: cancel what the worker may hold, drop the connection."""
        try:
            if self._session_id is not None and not (self._done or self._gone):
                await self._cancel({})
            self._gone = True
        finally:
            await self._close_http()

    async def _close_http(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


# ---- translations ---------------------------------------------------------------------------


def _assistant(action: dict, turn: int) -> dict:
    """The assistant message as an OpenAI ``ChatCompletionAssistantMessageParam`` (AgentRL
    validates it): role, content, tool calls with ids and JSON-string arguments."""
    message: dict[str, Any] = {"role": "assistant", "content": action.get("content")}
    calls = []
    for i, call in enumerate(action.get("tool_calls") or []):
        if not isinstance(call, dict):
            continue
        function = call["function"] if isinstance(call.get("function"), dict) else {}
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append(
            {
                "id": str(call.get("id") or f"call_{turn}_{i}"),
                "type": "function",
                "function": {"name": str(function.get("name", "")), "arguments": arguments},
            }
        )
    if calls:
        message["tool_calls"] = calls
    return message


def _text(content: Any) -> str:
    """A classic worker reads text: the content, its text parts joined, or ''."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _openai_tools(tools: Any) -> list[dict]:
    """The worker's tools in OpenAI's shape (AgentRL also accepts Anthropic's ``input_schema``)."""
    out = []
    for tool in tools or []:
        if isinstance(tool, dict) and "input_schema" in tool and "function" not in tool:
            function = {"name": tool.get("name", ""), "parameters": tool["input_schema"]}
            if tool.get("description"):
                function["description"] = tool["description"]
            tool = {"type": "function", "function": function}
        if isinstance(tool, dict):
            out.append(tool)
    return out


def _result_score(result: Any, key: str | None) -> float:
    """A classic sample's score: ``result[key]`` when configured, a bare number or bool, else
    the first number or bool among SCORE_KEYS; 0 when none (scored by ``overall`` only)."""
    if isinstance(result, dict):
        for name in (key,) if key else SCORE_KEYS:
            value = result.get(name)
            if isinstance(value, (bool, int, float)):
                return float(value)
        return 0.0
    if isinstance(result, (bool, int, float)):
        return float(result)
    return 0.0


def _numbers(value: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a JSON value, keyed by their dotted path (bools count as 0/1)."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return {prefix or "value": float(value)}
    if isinstance(value, dict):
        out: dict[str, float] = {}
        for key, item in value.items():
            out.update(_numbers(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {}


def _table(answer: Any) -> dict[str, Any]:
    if not isinstance(answer, list) or not all(
        isinstance(i, (int, str)) and not isinstance(i, bool) for i in answer
    ):
        raise WorkerProtocolError(f"/get_indices answered {str(answer)[:300]}")
    return {str(i): i for i in answer}


def _task_output(outcome: SessionOutcome) -> dict:
    """An outcome as AgentBench's ``TaskOutput`` for ``/calculate_overall``."""
    status = str(outcome.info.get("status") or "unknown")
    if status == CANCELLED and outcome.info.get("dialect") == "classic":
        status = "unknown"  # v0.2's SampleStatus has no cancelled
    return {
        "index": outcome.info.get("index"),
        "status": status,
        "result": outcome.info.get("result"),
        "history": [],
    }
