"""A small AgentBench task worker for the bridge's tests, in both of AgentBench's dialects.

It answers the HTTP routes of AgentBench's task worker under ``/api`` with their request and
reply shapes, written from the published models (not copied):

- ``classic``: AgentBench v0.2 (``src/server/task_worker.py``, ``src/typings/``). A reply
  carries ``output``, a ``TaskOutput`` (index, status, result, the whole ``history`` of
  ``{"role": "user"|"agent", "content"}``); the agent answers ``agent_response`` =
  ``{"status": "normal", "content": text}``; a task that raised answers HTTP 501 whose
  ``detail`` holds the output.
- ``fc``: AgentBench FC on AgentRL's worker (``agentrl-worker``: ``agentrl/worker/
  task_worker.py``, ``typings.py``). A reply carries the OpenAI messages new since the agent's
  last turn, the ``tools``, ``status``, ``finish``, the last ``reward`` and ``metric``
  (``/start_sample`` flat, with the session id in a header; ``/interact`` under ``env_out``);
  the agent answers ``messages``, a list of OpenAI assistant messages.

Both keep a session map limited by ``concurrency`` (HTTP 406 when full), answer 400 with
FastAPI's ``{"detail": ...}`` for an unknown or duplicate session, and run each sample as a
coroutine that hands turns to the agent and waits for its answer (AgentBench's
``Session.action``). The task: arithmetic questions, with a ``calculate`` tool and a final
answer; question 3 breaks the environment (the task raises, status ``task error``).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

QUESTIONS = [
    ("What is 17 + 25?", 42),
    ("What is 6 * 7 - 5?", 37),
    ("What is 120 / 8?", 15),
    ("What is 1 / 0 + 1?", None),  # the environment breaks: the task raises
]
MAX_ROUNDS = 4

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "commit_final_answer",
            "description": "Commit the final answer; the episode ends.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
            },
        },
    },
]

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> float:
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"not arithmetic: {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


class Cancelled(Exception):
    """The agent side cancelled the session (AgentBench's AgentOutputStatus.CANCELLED)."""


@dataclass
class Sample:
    """One session: the history and the turn hand-off between the task and the agent."""

    session_id: int
    index: int
    history: list = field(default_factory=list)
    to_agent: asyncio.Queue = field(default_factory=asyncio.Queue)
    to_env: asyncio.Queue = field(default_factory=asyncio.Queue)
    ptr: int = 0  # fc: where the messages new to the agent start
    task: asyncio.Task | None = None

    def snapshot(self, status: str = "running", result: Any = None) -> dict:
        return {"index": self.index, "status": status, "result": result, "history": self.history}

    async def action(self) -> dict:
        """Hand the turn to the agent; wait for its answer (and append it to the history)."""
        self.to_agent.put_nowait(self.snapshot())
        answer = await self.to_env.get()
        if answer.get("status") == "cancelled":
            raise Cancelled()
        return answer


class Worker:
    """The worker; ``dialect`` is ``classic`` or ``fc``. Counters are for the tests."""

    def __init__(self, dialect: str, *, concurrency: int = 4, broken: bool = False) -> None:
        assert dialect in ("classic", "fc"), dialect
        self.dialect = dialect
        self.concurrency = concurrency
        self.broken = broken  # answer /start_sample with a page that is not JSON
        self.sessions: dict[int, Sample] = {}
        self.cancelled: list[int] = []
        self.received: list[dict] = []  # every /interact body, as sent

    # ---- the task -------------------------------------------------------------------------

    async def run_sample(self, sample: Sample) -> tuple[str, Any]:
        question, answer = QUESTIONS[sample.index]
        if self.dialect == "classic":
            sample.history.append(
                {
                    "role": "user",
                    "content": f"{question}\nReply 'Action: calculate EXPR' or 'Action: answer X'.",
                }
            )
        else:
            sample.history.append({"role": "system", "content": "Answer with the tools."})
            sample.history.append({"role": "user", "content": question})
        for _ in range(MAX_ROUNDS):
            reply = await sample.action()
            if answer is None:
                1 / 0  # noqa: B018 - the environment breaks while handling the turn
            if self.dialect == "classic":
                done = self._classic_turn(sample, reply, answer)
            else:
                done = self._fc_turn(sample, reply, answer)
            if done is not None:
                return "completed", done
        if self.dialect == "fc":
            sample.history.append({"reward": 0.0, "score": 0.0, "metrics": {"score": 0.0}})
        return "task limit reached", {"result": False}

    def _classic_turn(self, sample: Sample, reply: dict, answer: int) -> Any:
        content = reply["content"] or ""
        sample.history.append({"role": "agent", "content": content})
        action, _, arg = content.partition("Action: ")[2].partition(" ")
        if action == "answer":
            return {"result": _same(arg, answer), "answer": arg}
        if action == "calculate":
            try:
                text = f"Result: {calculate(arg):g}"
            except (ValueError, SyntaxError, ZeroDivisionError) as exc:
                text = f"Error: {exc}"
        else:
            text = "Invalid action. Reply 'Action: calculate EXPR' or 'Action: answer X'."
        sample.history.append({"role": "user", "content": text})
        return None

    def _fc_turn(self, sample: Sample, reply: dict, answer: int) -> Any:
        messages = reply["messages"]
        sample.history.extend(messages)
        sample.ptr = len(sample.history)
        calls = [call for message in messages for call in message.get("tool_calls") or []]
        if not calls:
            sample.history.append({"role": "user", "content": "No tool calls found."})
            return None
        for call in calls:
            name = call["function"]["name"]
            try:
                args = json.loads(call["function"]["arguments"])
            except (TypeError, ValueError):
                self._tool(sample, call, "Error: the arguments are not JSON.")
                continue
            if name == "commit_final_answer":
                correct = _same(str(args.get("answer", "")), answer)
                score = 1.0 if correct else 0.0
                sample.history.append(
                    {"reward": score, "score": score, "metrics": {"correct": score, "score": score}}
                )
                return {"is_correct": correct, "answer": args.get("answer")}
            if name == "calculate":
                try:
                    self._tool(sample, call, f"{calculate(args['expression']):g}")
                except (KeyError, ValueError, SyntaxError, ZeroDivisionError) as exc:
                    self._tool(sample, call, f"Error: {exc}")
            else:
                self._tool(sample, call, "Invalid function call. Please call a tool instead.")
        return None

    @staticmethod
    def _tool(sample: Sample, call: dict, content: str) -> None:
        sample.history.append(
            {"role": "tool", "tool_call_id": call.get("id", ""), "content": content}
        )

    async def _drive(self, sample: Sample) -> None:
        try:
            status, result = await self.run_sample(sample)
        except Cancelled:
            status, result = "cancelled", None
        except Exception as exc:  # the task raised: AgentBench reports the traceback
            status, result = "task error", f"Traceback (most recent call last):\n{exc!r}"
        self.sessions.pop(sample.session_id, None)
        sample.to_agent.put_nowait(sample.snapshot(status, result))

    # ---- the replies ----------------------------------------------------------------------

    def _fc_reply(self, sample: Sample, output: dict) -> dict:
        new = output["history"][sample.ptr :]
        rewards = [item for item in new if "reward" in item and "role" not in item]
        return {
            "messages": [item for item in new if "role" in item],
            "tools": TOOLS,
            "status": output["status"],
            "finish": output["status"] != "running",
            "reward": rewards[-1]["reward"] if rewards else 0,
            "metric": rewards[-1]["metrics"] if rewards else {},
        }

    @staticmethod
    def _classic_output(output: dict) -> dict:
        return {**output, "history": list(output["history"])}

    # ---- the routes -----------------------------------------------------------------------

    async def get_indices(self, request: web.Request) -> web.Response:
        return web.json_response(list(range(len(QUESTIONS))))

    async def worker_status(self, request: web.Request) -> web.Response:
        return web.json_response({"concurrency": self.concurrency, "current": len(self.sessions)})

    async def start_sample(self, request: web.Request) -> web.Response:
        body = await request.json()
        session_id, index = body["session_id"], body["index"]
        if self.broken:
            return web.Response(text="<html>Internal proxy page</html>", content_type="text/html")
        if session_id in self.sessions:
            return _detail(400, "Session ID already exists")
        if len(self.sessions) >= self.concurrency:
            return _detail(406, f"Sample concurrency limit reached: {self.concurrency}")
        if not isinstance(index, (int, str)) or isinstance(index, bool):  # pydantic's check
            return _detail(422, f"bad index {index!r}")
        sample = Sample(session_id=session_id, index=index)
        self.sessions[session_id] = sample
        sample.task = asyncio.create_task(self._drive(sample))
        output = await sample.to_agent.get()
        if self.dialect == "classic":
            return web.json_response(
                {"session_id": session_id, "output": self._classic_output(output)}
            )
        return web.json_response(
            self._fc_reply(sample, output), headers={"session_id": str(session_id)}
        )

    async def interact(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append(body)
        sample = self.sessions.get(body["session_id"])
        if sample is None:
            return _detail(400, "No such session")
        if self.dialect == "classic":
            sample.to_env.put_nowait(body["agent_response"])
        else:
            sample.to_env.put_nowait({"status": "normal", "messages": body["messages"]})
        output = await sample.to_agent.get()
        if self.dialect == "classic":
            reply = {"session_id": sample.session_id, "output": self._classic_output(output)}
            if output["status"] == "task error":
                return web.json_response({"detail": reply}, status=501)
            return web.json_response(reply)
        return web.json_response(
            {"session_id": sample.session_id, "env_out": self._fc_reply(sample, output)}
        )

    async def cancel(self, request: web.Request) -> web.Response:
        body = await request.json()
        sample = self.sessions.get(body["session_id"])
        if sample is None:
            return _detail(400, "No such session")
        self.cancelled.append(sample.session_id)
        sample.to_env.put_nowait({"status": "cancelled"})
        assert sample.task is not None
        await sample.task
        return web.json_response({"session_id": sample.session_id})

    async def calculate_overall(self, request: web.Request) -> web.Response:
        body = await request.json()
        results = body["results"]
        right = sum(
            1
            for r in results
            if isinstance(r.get("result"), dict)
            and (r["result"].get("result") is True or r["result"].get("is_correct") is True)
        )
        return web.json_response({"total": len(results), "accuracy": right / max(1, len(results))})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/get_indices", self.get_indices)
        app.router.add_get("/api/worker_status", self.worker_status)
        app.router.add_post("/api/start_sample", self.start_sample)
        app.router.add_post("/api/interact", self.interact)
        app.router.add_post("/api/cancel", self.cancel)
        app.router.add_post("/api/calculate_overall", self.calculate_overall)
        return app


def _same(text: str, answer: int) -> bool:
    try:
        return float(text.strip()) == float(answer)
    except ValueError:
        return False


def _detail(status: int, detail: Any) -> web.Response:
    return web.json_response({"detail": detail}, status=status)


class WorkerThread:
    """Serve a ``Worker`` on its own event loop in a thread, so that blocking calls from the
    test (the bridge's synchronous ``indices()``) and the bridge's async calls both reach it."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> WorkerThread:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{port}/api"
        return self

    async def _start(self) -> int:
        self._runner = web.AppRunner(self.worker.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        """Shut the server down (the worker is gone: connections are refused)."""
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)

    async def _stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
        self._runner = None
        for sample in list(self.worker.sessions.values()):
            if sample.task is not None:
                sample.task.cancel()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
