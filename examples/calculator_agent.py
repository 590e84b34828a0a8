"""The seed's training example: a LangChain agent with one calculator tool, on arithmetic it
cannot do in its head (``agentarium demo --model smol --recipe calc``).

The task: ``What is 537 + 86?`` -- one operation on two- and three-digit operands (``+`` and
``-`` on a three-digit and a two-digit number, ``*`` on two two-digit numbers). Tasks look like
``{"task_id": "calc-b3-5", "a": 537, "op": "+", "b": 86, "answer": "623"}``. SmolLM2-135M-Instruct
answers none of them right unaided (0 of 72 samples at temperature 1, base weights: a bare
guess such as ``817`` for 237 + 83); with the tool it has to write a well-formed call with the
right expression, then copy the tool's result as its answer. The reward is 1.0 when the final
reply, stripped (a trailing period too), is exactly the answer, else 0.0.

The agent is the seed's pattern: ``rollout(task, endpoint, model)`` builds a LangChain
``ChatOpenAI`` on the rollout's endpoint (the consumer's tracing proxy, so every call is
recorded token-exactly), binds the calculator tool and runs the tool-calling loop: call the
model; run each tool call it made and send the results back as ``ToolMessage``s; stop at a
reply without tool calls (its answer) or after ``MAX_TURNS`` calls. Three solved examples
come first as chat history, each a question, a calculator call, its result and the bare
answer: the model imitates them. At the base weights it calls the tool in about half the
rollouts (0.52 in a k = 4 eval of the 40 held-out problems) and gets 0.82 of those right, none
of the others, which gives GRPO's groups spread to learn from.

SmolLM2's chat template renders no tools: the consumer runs with ``--tool-fallback``
(formats/tool_fallback.py), which writes the tool into the system message, earlier calls as
``<tool_call>`` blocks and results as ``<tool_response>`` turns, and parses the model's
``<tool_call>`` blocks into OpenAI tool calls. Tool results are environment tokens: the trainer
masks them out of the loss, and the whole conversation is one row.

Two faces of the same agent:

- ``rollout``, an ``async def``, for ``agentarium consumer --agent calc=agentarium.examples.
  calculator_agent:rollout --tool-fallback`` (what the demo runs: 64 rollouts at once on one
  event loop);
- ``ray_rollout``, the same loop as a Ray remote function, for the orchestrator as the seed
  writes it (Ray 2.60 refuses ``async def`` under ``@ray.remote``, so it runs the loop with
  ``asyncio.run``)::

      orch = AgentOrchestrator(server_addresses=[...], tool_fallback=True)
      orch.register_agent_type("calc", ray_rollout)

Metrics per rollout: ``called_tool`` (1 when any call was made), ``tool_calls``,
``tool_errors`` (calls the calculator refused: a wrong name, bad arguments), ``turns`` (model
calls) and ``bare_number`` (the answer is a number).

Held-out split: a problem is kept out of training when ``(a + 3 * b) % 10 == 0``; ``eval_tasks``
is a fixed draw of 40 of them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import Any

import ray

from .calculator import evaluate

OPS = ("+", "-", "*")
SYSTEM = "Answer with the number only. Use the calculator tool."
QUESTION = "What is {a} {op} {b}?"
SHOTS = ((24, "*", 13), (85, "-", 38), (316, "+", 97))  # solved with the tool, every prompt
MAX_TURNS = 3  # model calls per rollout: a tool call, a retry, the answer
MAX_NEW_TOKENS = 48  # a call in the fallback's format is about 30 tokens
EVAL_TASKS = 40
EVAL_SEED = 20261205


def answer_of(a: int, op: str, b: int) -> str:
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def held_out(a: int, op: str, b: int) -> bool:
    """The problems kept out of training (eval's)."""
    return (a + 3 * b) % 10 == 0


def draw(rng: random.Random) -> tuple[int, str, int]:
    """One problem: a three-digit and a two-digit operand for + and -, two two-digit ones for *."""
    op = rng.choice(OPS)
    a = rng.randint(10, 99) if op == "*" else rng.randint(100, 999)
    return a, op, rng.randint(10, 99)


def task(a: int, op: str, b: int, task_id: str) -> dict:
    return {"task_id": task_id, "a": a, "op": op, "b": b, "answer": answer_of(a, op, b)}


def calc_tasks(rng: random.Random, n: int, prefix: str) -> list[dict]:
    """``n`` training problems (none held out)."""
    out: list[dict] = []
    while len(out) < n:
        a, op, b = draw(rng)
        if not held_out(a, op, b):
            out.append(task(a, op, b, f"{prefix}-{len(out)}"))
    return out


def eval_tasks() -> list[dict]:
    """The held-out problems the demo evaluates on: a fixed draw, the same on every machine."""
    rng = random.Random(EVAL_SEED)
    out: list[dict] = []
    seen: set[tuple[int, str, int]] = set()
    while len(out) < EVAL_TASKS:
        a, op, b = draw(rng)
        if held_out(a, op, b) and (a, op, b) not in seen:
            seen.add((a, op, b))
            out.append(task(a, op, b, f"calc-{a}{'pms'[OPS.index(op)]}{b}"))
    return out


def calculator_tool():
    """The LangChain tool (its JSON schema is what the model sees)."""
    from langchain_core.tools import tool

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        value = evaluate(expression)
        return str(int(value) if float(value).is_integer() else value)

    return calculator


def history(question: str) -> list:
    """The system message, the solved examples and the question, as LangChain messages."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    messages: list = [SystemMessage(SYSTEM)]
    for i, (a, op, b) in enumerate(SHOTS):
        call = {"name": "calculator", "args": {"expression": f"{a} {op} {b}"}, "id": f"call_{i}"}
        messages += [
            HumanMessage(QUESTION.format(a=a, op=op, b=b)),
            AIMessage("", tool_calls=[call]),
            ToolMessage(answer_of(a, op, b), tool_call_id=call["id"]),
            AIMessage(answer_of(a, op, b)),
        ]
    messages.append(HumanMessage(question))
    return messages


def _run_tool(tool, call: Mapping[str, Any]) -> tuple[str, bool]:
    """The tool's reply to one call, and whether it was refused (as a real tool would say)."""
    if call.get("name") != tool.name:
        return f"error: no tool named {call.get('name')!r}", True
    args = call.get("args") or {}
    if set(args) != {"expression"}:
        return 'error: the calculator takes one argument, "expression"', True
    try:
        return str(tool.invoke(args)), False
    except Exception as exc:  # a bad expression, missing or extra arguments
        # its first line only: a validation error runs to a dozen lines, which would fill the
        # next prompt with the tool's prose rather than the model's work
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"error: {first[:160]}", True


def reward_of(reply: str, answer: str) -> float:
    return 1.0 if reply.strip().rstrip(".").strip() == answer else 0.0


async def rollout(task: dict, endpoint: str, model: str) -> dict:
    """One rollout, the LangChain tool-calling loop on ``endpoint``: the agent for
    ``agentarium consumer`` (the module's docstring)."""
    import openai

    # The rollout's own HTTP client, closed with it: LangChain's default is cached per base
    # URL, and every rollout's URL is its own (128 clients kept; on a closed loop after an eval)
    async with openai.DefaultAsyncHttpxClient() as client:
        return await _loop(task, endpoint, model, client)


async def _loop(task: dict, endpoint: str, model: str, client) -> dict:
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    llm = ChatOpenAI(
        model=model,
        base_url=endpoint,
        api_key=SecretStr("unused"),  # the endpoint names the rollout; the key is ignored
        temperature=1.0,
        max_completion_tokens=task.get("max_new_tokens", MAX_NEW_TOKENS),
        max_retries=0,  # the consumer retries failed rollouts itself
        http_async_client=client,
    )
    tool = calculator_tool()
    agent = llm.bind_tools([tool])
    messages = history(QUESTION.format(a=task["a"], op=task["op"], b=task["b"]))
    calls = errors = turns = 0
    reply = ""
    while turns < MAX_TURNS:
        message = await agent.ainvoke(messages)
        turns += 1
        messages.append(message)
        reply = message.content if isinstance(message.content, str) else ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            calls += 1
            content, refused = _run_tool(tool, call)
            errors += refused
            messages.append(ToolMessage(content, tool_call_id=call["id"]))
        reply = ""  # a turn that called a tool gave no answer
    answer = reply.strip().rstrip(".").strip()
    return {
        "reward": reward_of(reply, task["answer"]),
        "metrics": {
            "called_tool": float(calls > 0),
            "tool_calls": float(calls),
            "tool_errors": float(errors),
            "turns": float(turns),
            "bare_number": float(answer.lstrip("-").isdigit()),
        },
        "answer": answer,
    }


@ray.remote(num_cpus=0.1)
def ray_rollout(task: dict, endpoint: str, model: str) -> dict:
    """The same agent as a Ray remote function (the orchestrator's, as the seed writes it)."""
    return asyncio.run(rollout(task, endpoint, model))
