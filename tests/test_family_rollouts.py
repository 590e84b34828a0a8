"""Each family's model in a multi-turn tool-using rollout through the gateway (formats/families.py):
an endpoint agent on the official ``openai`` SDK, Chat Completions streamed and not, against an
engine scripted to write what the family's model writes (its reasoning, a call, then the
answer, in the family's own text, the tiny tokenizer's ids). The client gets the reasoning as
``reasoning_content`` and the call parsed from the content alone; the trajectory stores the
engine's ids, and the second prompt extends the first (one row for the trainer)."""

from __future__ import annotations

import json

import openai
import pytest
from fake_sglang import scripted, serving
from test_families import TOOLS
from worker_env import worker_for

from agentarium.formats import ChatTemplate
from agentarium.formats.families import FAMILIES, Family
from agentarium.producers import TaskProducer, TrajectoryReader

QUESTION = [{"role": "user", "content": "The weather in Paris for 3 days?"}]
SEEN: dict[str, list[dict]] = {}


def assistant(family: Family, content: str, reasoning: str, calls: list[dict]) -> dict:
    message: dict = {"role": "assistant", "content": "" if calls and family.tool_format == "llama3_json" else content}  # fmt: skip
    if family.reasoning_format != "none":
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


FIRST_CALL = {"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}  # fmt: skip


def reply_text(chat: ChatTemplate, family: Family, history: list[dict], message: dict) -> str:
    """What the family's model writes for ``message`` after ``history``: the template's own
    rendering of it, from where the generation prompt ends to the turn's end."""
    prompt = chat.render(history, tools=TOOLS)
    full = chat.render([*history, message], tools=TOOLS, add_generation_prompt=False)
    assert full.startswith(prompt), (prompt[-80:], full[len(prompt) - 80 :])
    rest = full[len(prompt) :]
    ends = [rest.find(close) for close in family.turn_close if close in rest]
    if ends:
        return rest[: min(ends)]
    return rest.removesuffix("<|end|>")  # gpt-oss's final message, as the history renders it


def family_policy(chat: ChatTemplate, family: Family):
    first = assistant(family, "Checking Paris.", "Paris needs one call.", [FIRST_CALL])
    result = {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}
    final = assistant(family, "Sunny in Paris.", "The call answered.", [])
    texts = (
        reply_text(chat, family, QUESTION, first),
        reply_text(chat, family, [*QUESTION, first, result], final),
    )
    return (lambda prompt: texts[1] if "sunny" in prompt else texts[0]), texts


def chat_agent(stream: bool):
    async def agent(task: dict, endpoint: str, model: str) -> float:
        sdk = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)
        messages: list[dict] = list(QUESTION)
        replies = []
        for _ in range(2):
            if stream:
                chunks = [
                    c
                    async for c in await sdk.chat.completions.create(
                        model=model, messages=messages, tools=TOOLS, stream=True
                    )
                ]
                reasoning = "".join(
                    (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                    for c in chunks
                )
                content = "".join(c.choices[0].delta.content or "" for c in chunks)
                calls: dict[int, dict] = {}
                for c in chunks:
                    for d in c.choices[0].delta.tool_calls or []:
                        call = calls.setdefault(d.index, {"type": "function", "function": {"arguments": ""}})  # fmt: skip
                        call["id"] = d.id or call.get("id")
                        call["function"]["name"] = d.function.name or call["function"].get("name")
                        call["function"]["arguments"] += d.function.arguments or ""
                message = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}  # fmt: skip
                if calls:
                    message["tool_calls"] = [calls[i] for i in sorted(calls)]
            else:
                reply = await sdk.chat.completions.create(
                    model=model, messages=messages, tools=TOOLS
                )
                got = reply.choices[0].message
                message = {"role": "assistant", "content": got.content or "",
                           "reasoning_content": (got.model_extra or {}).get("reasoning_content")}  # fmt: skip
                if got.tool_calls:
                    message["tool_calls"] = [c.model_dump() for c in got.tool_calls]
            message = {k: v for k, v in message.items() if v is not None}
            replies.append(message)
            messages.append(message)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": "sunny"})  # fmt: skip
        SEEN[task["task_id"]] = replies
        return 1.0

    return agent


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
async def test_a_familys_tool_using_rollout_through_the_gateway(
    js, topology, template, name, stream
):
    family = FAMILIES[name]
    chat = ChatTemplate(template.tokenizer, {"default": family.template}, name=name, eos_token_ids=template.eos_token_ids)  # fmt: skip
    policy, texts = family_policy(chat, family)
    agent = f"fam-{name.replace('_', '-')}-{int(stream)}"
    async with serving(scripted(chat, policy)) as fake:
        await TaskProducer(js, topology).submit(agent, [{"task_id": "t"}], run=agent)
        async with worker_for(js, agent, chat_agent(stream), [fake.url], attempts=1, template=chat) as worker:  # fmt: skip
            counters = await worker.run()
    assert counters.ok == 1, counters
    [trajectory] = await TrajectoryReader(js, topology).read(agent)
    first, final = SEEN["t"]
    thinks = family.reasoning_format != "none"
    assert first.get("reasoning_content") == ("Paris needs one call." if thinks else None)
    assert final.get("reasoning_content") == ("The call answered." if thinks else None)
    [call] = first["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert final["content"] == "Sunny in Paris." and "tool_calls" not in final
    one, two = trajectory.calls
    for recorded, text in zip((one, two), texts, strict=True):  # the engine's ids, whole
        assert recorded.response_ids == chat.encode(text) + chat.eos_token_ids[:1]
    assert two.prompt_build == "extend", two.prompt_build  # one row: the prompt grew
    assert (
        two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)]
        == one.prompt_ids + one.response_ids
    )
