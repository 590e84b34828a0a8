"""The light environment of bench/env_sessions.py, and the same environment behind HTTP.

``LightEnv``: a session opens with a system and a user message and one tool (``echo``); each
step answers the tool call with its arguments; the fifth step is ``done`` with reward 1, and
``close`` scores the episode by the steps it saw (1.0 after exactly five). No I/O, so what the
benchmark measures is the transport and the worker, not the environment.

    agentarium env serve light_env:LightEnv --capacity 3000    # PYTHONPATH=bench:.

``python bench/light_env.py --port P`` serves the same class over HTTP in the pattern of
AgentBench's task worker (``src/server/task_worker.py``; its FC variant's OpenAI messages):
one process, the sessions in a dict in memory, routes under ``/api``:

- ``POST /api/start_sample {"index", "session_id"}`` -> ``{"session_id", "output":
  {"messages", "tools", "status"}}`` (reset); 406 when the worker holds ``--concurrency``
  sessions, 400 for a session id it already holds;
- ``POST /api/interact {"session_id", "messages": [assistant]}`` -> ``{"session_id",
  "env_out": {"messages", "finish", "reward", "status"}}`` (step);
- ``POST /api/cancel {"session_id"}`` -> ``{"session_id", "outcome": {"score", "steps"}}``
  (close; AgentBench's cancel answers nothing useful, here it carries the outcome, so both
  sides of the benchmark make the same seven round trips per session);
- ``GET /api/worker_status`` -> ``{"concurrency", "current", "most"}``.

AgentBench's task worker has no routing of its own: with several workers, a controller (or,
here, the client) must send every request of a session to the worker that holds it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentarium.environments import Environment  # noqa: E402
from agentarium.schemas import Observation, SessionOutcome, StepResult  # noqa: E402

STEPS = 5
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Answers with its text.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
    }
]


class LightEnv(Environment):
    """Open, five steps, close: the benchmark's environment."""

    name = "light"

    def __init__(self) -> None:
        self.steps = 0
        self.index = ""

    async def reset(self, task: dict) -> Observation:
        self.index = str(task.get("index", ""))
        return Observation(
            messages=[
                {"role": "system", "content": "Call echo five times."},
                {"role": "user", "content": f"Task {self.index}: echo anything."},
            ],
            tools=TOOLS,
        )

    async def step(self, action: dict) -> StepResult:
        self.steps += 1
        calls = action.get("tool_calls") or [{}]
        arguments = (calls[0].get("function") or {}).get("arguments", "")
        done = self.steps >= STEPS
        return StepResult(
            messages=[
                {"role": "tool", "tool_call_id": calls[0].get("id", ""), "content": arguments}
            ],
            reward=1.0 if done else None,
            done=done,
        )

    async def close(self) -> SessionOutcome:
        return SessionOutcome(
            score=1.0 if self.steps == STEPS else 0.0, metrics={"steps": self.steps}
        )


# ---- the HTTP task worker -------------------------------------------------------------------


class TaskWorker:
    """AgentBench's task-worker pattern: one environment per session id, held in a dict."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.sessions: dict[int, LightEnv] = {}
        self.most = 0

    async def start_sample(self, request: web.Request) -> web.Response:
        body = await request.json()
        session_id = int(body["session_id"])
        if len(self.sessions) >= self.concurrency:
            return web.json_response({"detail": "no free worker"}, status=406)
        if session_id in self.sessions:
            return web.json_response({"detail": "Session ID already exists"}, status=400)
        env = LightEnv()
        self.sessions[session_id] = env
        self.most = max(self.most, len(self.sessions))
        obs = await env.reset({"index": body.get("index")})
        output = {"messages": obs.messages, "tools": obs.tools, "status": "running"}
        return web.json_response({"session_id": session_id, "output": output})

    async def interact(self, request: web.Request) -> web.Response:
        body = await request.json()
        env = self.sessions.get(int(body["session_id"]))
        if env is None:
            return web.json_response({"detail": "No such session"}, status=400)
        result = await env.step(body["messages"][-1])
        env_out = {
            "messages": result.messages,
            "finish": result.done,
            "reward": result.reward or 0.0,
            "status": "completed" if result.done else "running",
        }
        return web.json_response({"session_id": body["session_id"], "env_out": env_out})

    async def cancel(self, request: web.Request) -> web.Response:
        body = await request.json()
        env = self.sessions.pop(int(body["session_id"]), None)
        if env is None:
            return web.json_response({"detail": "No such session"}, status=400)
        outcome = await env.close()
        return web.json_response(
            {
                "session_id": body["session_id"],
                "outcome": {"score": outcome.score, "steps": env.steps},
            }
        )

    async def worker_status(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"concurrency": self.concurrency, "current": len(self.sessions), "most": self.most}
        )

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/api/start_sample", self.start_sample)
        app.router.add_post("/api/interact", self.interact)
        app.router.add_post("/api/cancel", self.cancel)
        app.router.add_get("/api/worker_status", self.worker_status)
        return app


async def serve(port: int, concurrency: int, backlog: int) -> None:
    runner = web.AppRunner(TaskWorker(concurrency).app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=backlog).start()
    print(json.dumps({"serving": f"http://127.0.0.1:{runner.addresses[0][1]}/api"}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="LightEnv as an AgentBench-style HTTP worker")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=10_000)
    parser.add_argument("--backlog", type=int, default=4096, help="the listen backlog")
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.port, args.concurrency, args.backlog))
    except KeyboardInterrupt:
        pass
