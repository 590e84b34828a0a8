"""The tool fallback (``--tool-fallback``, formats/tool_fallback.py): SmolLM2, whose chat template
renders no tools, runs a tool-calling agent end to end: the tools reach the model in the
system message, its ``<tool_call>`` block comes back as an OpenAI tool call, the result is
shown in the next prompt, and the trajectory records both calls' exact tokens. Without the
fallback the same call is refused, as before."""

from __future__ import annotations

import json

import pytest
from agentlib import add_tool
from fake_sglang import scripted, serving
from worker_env import worker_for

from agentarium.formats import ChatTemplate, ToolsNotRendered
from agentarium.formats.tool_fallback import with_tools_in_text
from agentarium.producers import TaskProducer, TrajectoryReader

pytestmark = pytest.mark.real_model  # smol's tokenizer and template

TOOLS = [add_tool()]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "2 + 3 = 5."


@pytest.fixture(scope="module")
def smol_templates(smol_dir):
    return (
        ChatTemplate.from_model_dir(smol_dir),
        ChatTemplate.from_model_dir(smol_dir, tool_fallback=True),
    )


def test_the_conversation_is_rewritten_into_what_the_template_renders(smol_templates):
    plain, fallback = smol_templates
    assert not plain.renders_tools()
    chat = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "Adding.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    with pytest.raises(ToolsNotRendered, match="--tool-fallback"):
        plain.render(chat, tools=TOOLS)
    text = fallback.render(chat, tools=TOOLS)
    assert text == plain.render(with_tools_in_text(chat, TOOLS))
    system = text.split("<|im_end|>")[0]
    assert json.dumps(TOOLS[0]) in system and "<tool_call>" in system
    assert f"Adding.\n{CALL}" in text  # the call as the model is asked to write it
    assert "<tool_response>\n5\n</tool_response>" in text
    assert fallback.reply_formats == ("hermes", "none")


async def fallback_agent(task: dict, llm) -> float:
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await llm.chat(messages, tools=TOOLS)
    (call,) = first.tool_calls
    args = json.loads(call["function"]["arguments"])
    messages += [
        first.message,
        {"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])},
    ]
    final = await llm.chat(messages, tools=TOOLS)
    return float("5" in final.content)


async def test_smol_runs_a_tool_calling_agent_with_the_fallback(js, topology, smol_templates):
    _, fallback = smol_templates

    def policy(prompt: str) -> str:  # calls the tool, answers once the result is shown
        return ANSWER if "<tool_response>" in prompt else CALL

    async with serving(scripted(fallback, policy)) as fake:
        await TaskProducer(js, topology).submit("fb", [{"prompt": "What is 2+3?"}], run="fb")
        async with worker_for(
            js, "fb", fallback_agent, [fake.url], attempts=1, template=fallback, model_name="smol"
        ) as worker:
            counters = await worker.run()
        prompts = [fallback.decode(r["input_ids"]) for r in fake.requests]
    assert counters.ok == 1, counters
    [trajectory] = await TrajectoryReader(js, topology).read("fb")
    assert trajectory.reward == 1.0
    first, second = trajectory.calls
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    assert first.response_ids == fallback.encode(CALL) + fallback.eos_token_ids[:1]
    assert '"name": "add"' in prompts[0] and "<tool_response>\n5\n</tool_response>" in prompts[1]
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids  # one growing prompt
