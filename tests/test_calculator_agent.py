"""The calculator agent's pieces (examples/calculator_agent.py): its problems and their split,
its tool's replies to good and bad calls, and its reward."""

from __future__ import annotations

import random

from agentarium.examples.calculator_agent import (
    _run_tool,
    calc_tasks,
    calculator_tool,
    eval_tasks,
    held_out,
    history,
    reward_of,
)


def test_training_problems_never_include_a_held_out_one_and_the_evals_are_fixed():
    tasks = calc_tasks(random.Random(3), 500, "b")
    assert [t["task_id"] for t in tasks] == [f"b-{i}" for i in range(500)]
    assert not any(held_out(t["a"], t["op"], t["b"]) for t in tasks)
    for t in tasks:  # operands as the module says: 3 and 2 digits for + and -, 2 and 2 for *
        assert 10 <= t["b"] <= 99
        assert (10 <= t["a"] <= 99) if t["op"] == "*" else (100 <= t["a"] <= 999)
    assert {t["op"] for t in tasks} == {"+", "-", "*"}
    first, again = eval_tasks(), eval_tasks()
    assert first == again and len(first) == 40
    assert all(held_out(t["a"], t["op"], t["b"]) for t in first)
    trained = {(t["a"], t["op"], t["b"]) for t in tasks}
    assert not trained & {(t["a"], t["op"], t["b"]) for t in first}


def test_the_tool_answers_a_good_call_and_names_what_is_wrong_with_a_bad_one():
    tool = calculator_tool()
    assert _run_tool(tool, {"name": "calculator", "args": {"expression": "24 * 13"}}) == (
        "312",
        False,
    )
    assert _run_tool(tool, {"name": "calculator", "args": {"expression": "7 / 2"}}) == (
        "3.5",
        False,
    )
    for call, says in (
        ({"name": "calc", "args": {"expression": "1"}}, "no tool named 'calc'"),
        ({"name": "calculator", "args": {"operation": "add"}}, 'one argument, "expression"'),
        ({"name": "calculator", "args": {"expression": "__import__('os')"}}, "unsupported"),
        ({"name": "calculator", "args": {"expression": "1 / 0"}}, "division by zero"),
    ):
        reply, refused = _run_tool(tool, call)
        assert refused and reply.startswith("error: ") and says in reply, reply
        assert "\n" not in reply  # one line: the next prompt holds it


def test_the_reward_is_the_exact_answer_and_the_examples_show_the_tool_in_use():
    assert reward_of(" 623\n", "623") == reward_of("623.", "623") == 1.0
    assert reward_of("The answer is 623", "623") == reward_of("6230", "623") == 0.0
    messages = history("What is 537 + 86?")
    assert messages[-1].content == "What is 537 + 86?"
    calls = [m.tool_calls for m in messages if getattr(m, "tool_calls", None)]
    assert [c[0]["args"]["expression"] for c in calls] == ["24 * 13", "85 - 38", "316 + 97"]
