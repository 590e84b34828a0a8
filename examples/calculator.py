"""A multi-turn tool agent: the model may call a calculator; tool results go back as
``tool`` messages, so they appear in later prompts but never in any call's response ids."""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

_OPS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def evaluate(expression: str) -> float:
    """Arithmetic only: no names, no calls (never eval() model output)."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")

    return walk(ast.parse(expression, mode="eval"))


def _run_tool(call: dict) -> str:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
        value = evaluate(str(args["expression"]))
        return str(int(value) if float(value).is_integer() else value)
    except Exception as exc:  # the model wrote a bad call: tell it, like a real tool would
        return f"error: {exc}"


async def rollout(task: dict, llm, max_turns: int = 4) -> dict:
    messages = [
        {"role": "system", "content": "Answer with a number. You may use the calculator tool."},
        {"role": "user", "content": task["prompt"]},
    ]
    result = None
    tool_uses = 0
    for _ in range(max_turns):
        result = await llm.chat(
            messages, tools=[CALCULATOR], max_new_tokens=task.get("max_new_tokens", 48)
        )
        messages.append(result.message)
        if not result.tool_calls:
            break
        for call in result.tool_calls:
            tool_uses += 1
            messages.append(
                {"role": "tool", "tool_call_id": call.get("id", ""), "content": _run_tool(call)}
            )
    reply = (result.text if result else "").strip()
    return {
        "reward": 1.0 if reply.startswith(str(task["answer"])) else 0.0,
        "metrics": {"tool_uses": float(tool_uses)},
    }
