"""Each family's model in a multi-turn tool-using rollout through the gateway (formats/families.py):
an endpoint agent on the official SDKs, through each API (Chat Completions, Responses and
Messages), streamed and not, against an
engine scripted to write what the family's model writes (its reasoning, a call, then the
answer, in the family's own text, the tiny tokenizer's ids). The client gets the reasoning
where its API puts it (``reasoning_content``, a reasoning item, a thinking block) and the call
parsed from the content alone; the trajectory stores the
engine's ids, and the second prompt extends the first (one row for the trainer)."""

from __future__ import annotations

import json

import openai
import pytest
from fake_sglang import scripted, serving
from familytools import TOOLS
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


RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
ANTHROPIC_TOOLS = [
    {
        "name": TOOLS[0]["function"]["name"],
        "description": TOOLS[0]["function"]["description"],
        "input_schema": TOOLS[0]["function"]["parameters"],
    }
]


def responses_agent(stream: bool):
    """The Responses API, stateless (store=false): the first response's items sent back with
    the call's output, as Codex does."""

    async def agent(task: dict, endpoint: str, model: str) -> float:
        sdk = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)
        items: list[dict] = list(QUESTION)
        replies = []
        for _ in range(2):
            options = dict(model=model, input=items, tools=RESPONSES_TOOLS, store=False)
            streamed = None
            if stream:
                events = [e async for e in await sdk.responses.create(**options, stream=True)]
                response = events[-1].response
                deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
                streamed = "".join(deltas)
            else:
                response = await sdk.responses.create(**options)
            message: dict = {"role": "assistant", "content": ""}
            for item in response.output:
                if item.type == "reasoning":
                    message["reasoning_content"] = item.content[0].text
                    assert streamed in (None, item.content[0].text)
                elif item.type == "message":
                    message["content"] = item.content[0].text
                elif item.type == "function_call":
                    function = {"name": item.name, "arguments": item.arguments}
                    call = {"id": item.call_id, "function": function}
                    message.setdefault("tool_calls", []).append(call)
            replies.append(message)
            items += [item.model_dump(exclude_none=True) for item in response.output]
            if "tool_calls" not in message:
                break
            for call in message["tool_calls"]:
                output = {"type": "function_call_output", "call_id": call["id"], "output": "sunny"}
                items.append(output)
        SEEN[task["task_id"]] = replies
        return 1.0

    return agent


def messages_agent(stream: bool):
    """Anthropic's Messages API: thinking, text and tool_use blocks sent back, then the
    tool_result, as Claude Code does."""

    async def agent(task: dict, endpoint: str, model: str) -> float:
        import anthropic

        sdk = anthropic.AsyncAnthropic(
            base_url=endpoint.removesuffix("/v1"), api_key="unused", max_retries=0
        )
        messages: list[dict] = list(QUESTION)
        replies = []
        for _ in range(2):
            options = dict(model=model, max_tokens=256, messages=messages, tools=ANTHROPIC_TOOLS)
            if stream:
                async with sdk.messages.stream(**options) as events:
                    reply = await events.get_final_message()
            else:
                reply = await sdk.messages.create(**options)
            message: dict = {"role": "assistant", "content": ""}
            for block in reply.content:
                if block.type == "thinking":
                    message["reasoning_content"] = block.thinking
                elif block.type == "text":
                    message["content"] = block.text
                elif block.type == "tool_use":
                    function = {"name": block.name, "arguments": json.dumps(block.input)}
                    message.setdefault("tool_calls", []).append(
                        {"id": block.id, "function": function}
                    )
            replies.append(message)
            blocks = [b.model_dump(exclude_none=True) for b in reply.content]
            messages.append({"role": "assistant", "content": blocks})
            if "tool_calls" not in message:
                break
            results = [
                {"type": "tool_result", "tool_use_id": c["id"], "content": "sunny"}
                for c in message["tool_calls"]
            ]
            messages.append({"role": "user", "content": results})
        SEEN[task["task_id"]] = replies
        return 1.0

    return agent


AGENTS = {"chat": chat_agent, "responses": responses_agent, "messages": messages_agent}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", sorted(AGENTS))
@pytest.mark.parametrize("name", sorted(FAMILIES))
async def test_a_familys_tool_using_rollout_through_the_gateway(
    js, topology, template, name, api, stream
):
    family = FAMILIES[name]
    chat = ChatTemplate(template.tokenizer, {"default": family.template}, name=name, eos_token_ids=template.eos_token_ids)  # fmt: skip
    policy, texts = family_policy(chat, family)
    agent = f"fam-{name.replace('_', '-')}-{api}-{int(stream)}"
    async with serving(scripted(chat, policy)) as fake:
        await TaskProducer(js, topology).submit(agent, [{"task_id": "t"}], run=agent)
        async with worker_for(js, agent, AGENTS[api](stream), [fake.url], attempts=1, template=chat) as worker:  # fmt: skip
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


async def test_reasoning_is_turned_on_and_off_where_the_template_can(replying, template):
    """Qwen3's template has an enable_thinking switch: off, its generation prompt closes an
    empty think block and the reply has no reasoning. A model without one takes only what it
    does anyway: the tiny model never reasons (off is a no-op, on is refused), DeepSeek's
    template always opens the block (on is a no-op, off is refused)."""
    from agentarium.consumers.backends import SGLangBackend
    from agentarium.consumers.errors import BadRequest
    from agentarium.consumers.tracing.llm import TracingLLM
    from agentarium.schemas import Sampling

    def llm_for(chat: ChatTemplate, url: str) -> TracingLLM:
        backend = SGLangBackend([url], backoff=0.0)
        return TracingLLM(backend, chat, Sampling(max_new_tokens=64), model_name="tiny")

    qwen3 = ChatTemplate(template.tokenizer, {"default": FAMILIES["qwen3"].template}, name="q3")
    deepseek = ChatTemplate(
        template.tokenizer, {"default": FAMILIES["deepseek_v3"].template}, name="ds"
    )
    assert qwen3.thinking_switch and not deepseek.thinking_switch
    assert not template.thinking_switch
    fake = await replying("Sunny.")
    off = llm_for(qwen3, fake.url)
    result = await off.chat(QUESTION, thinking=False)
    assert result.reasoning is None and result.content == "Sunny."
    prompt = qwen3.decode(fake.requests[-1]["input_ids"])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    await off.chat(QUESTION, thinking=True)
    assert qwen3.decode(fake.requests[-1]["input_ids"]).endswith("<|im_start|>assistant\n")
    tiny = llm_for(template, fake.url)
    await tiny.chat(QUESTION, thinking=False)  # what it does anyway
    with pytest.raises(BadRequest, match="cannot be turned on: this model does not reason"):
        await tiny.chat(QUESTION, thinking=True)
    always = llm_for(deepseek, fake.url)
    await always.chat(QUESTION, thinking=True)
    with pytest.raises(BadRequest, match="cannot be turned off: this model always reasons"):
        await always.chat(QUESTION, thinking=False)
    for llm in (off, tiny, always):
        await llm.backend.aclose()


def test_each_api_asks_for_reasoning_on_or_off_in_its_own_terms():
    from agentarium.consumers.tracing.gateway import anthropic, chat, responses
    from agentarium.consumers.tracing.gateway.errors import GatewayError
    from agentarium.consumers.tracing.gateway.route import Route

    user = [{"role": "user", "content": "hi"}]
    assert chat.parse({"messages": user}).call.thinking is None
    assert chat.parse({"messages": user, "reasoning_effort": "none"}).call.thinking is False
    assert chat.parse({"messages": user, "reasoning_effort": "low"}).call.thinking is True
    with pytest.raises(GatewayError, match="is not one of"):
        chat.parse({"messages": user, "reasoning_effort": "max"})
    route = Route("j", "s", None)  # the store of previous responses is all parse reads
    for effort, want in ((None, None), ("none", False), ("high", True)):
        body = {"input": "hi", "reasoning": {"effort": effort, "summary": None}}
        assert responses.parse(body, route).call.thinking is want
    for kind, want in ((None, None), ("disabled", False), ("adaptive", None)):
        body = {"messages": user, "max_tokens": 9, **({"thinking": {"type": kind}} if kind else {})}
        assert anthropic.parse(body).call.thinking is want
        assert anthropic.parse(body).call.thinking_budget is None
    enabled = {"messages": user, "max_tokens": 2048,
               "thinking": {"type": "enabled", "budget_tokens": 1024}}  # fmt: skip
    call = anthropic.parse(enabled).call
    assert (call.thinking, call.thinking_budget) == (True, 1024)
    for thinking, match in (
        ({"type": "enabled"}, "budget_tokens: a positive integer is required, got None"),
        ({"type": "enabled", "budget_tokens": 0}, "a positive integer is required, got 0"),
        ({"type": "enabled", "budget_tokens": 4096}, "must be greater than thinking.budget"),
        ({"type": "sometimes"}, "thinking.type must be"),
    ):
        with pytest.raises(GatewayError, match=match):
            anthropic.parse({**enabled, "thinking": thinking})


def qwen3_of(template: ChatTemplate, source: str | None = None) -> ChatTemplate:
    """The tiny tokenizer with Qwen3's template (``source``: another Qwen3 template)."""
    return ChatTemplate(
        template.tokenizer,
        {"default": source or FAMILIES["qwen3"].template},
        name="q3",
        eos_token_ids=template.eos_token_ids,
    )


async def asked_again(replying, chat: ChatTemplate, *, whole: bool):
    """A reply that reasons ("Hmm.") and answers ("Sunny."), sent back whole or without its
    reasoning, then a new user message: the tracing client and the second call's messages."""
    from agentarium.consumers.backends import SGLangBackend
    from agentarium.consumers.tracing.llm import TracingLLM
    from agentarium.schemas import Sampling

    fake = await replying("<think>\nHmm.\n</think>\n\nSunny.")
    backend = SGLangBackend([fake.url], backoff=0.0)
    try:
        llm = TracingLLM(backend, chat, Sampling(max_new_tokens=64), model_name="tiny")
        first = await llm.chat(QUESTION)
        assert first.reasoning == "Hmm." and first.content == "Sunny."
        reply = dict(first.message) if whole else {"role": "assistant", "content": first.content}
        messages = [*QUESTION, reply, {"role": "user", "content": "And Rome?"}]
        await llm.chat(messages)
    finally:
        await backend.aclose()
    return llm, messages


async def test_a_reply_sent_back_without_its_reasoning_still_extends(replying, template):
    """Most agent loops keep a reply's content and tool calls and drop the reasoning field:
    the next call still continues the recorded ids (one row)."""
    llm, _ = await asked_again(replying, qwen3_of(template), whole=False)
    assert llm.calls[1].prompt_build == "extend"
    assert llm.calls[1].prompt_ids[: len(llm.calls[0].prompt_ids)] == llm.calls[0].prompt_ids


@pytest.mark.parametrize("echo", ["whole", "without_reasoning"])
async def test_a_template_that_drops_earlier_reasoning_keeps_the_rollout_one_row(
    replying, template, echo
):
    """Qwen3's own template drops the reasoning of turns before the latest user message. The
    second call's prompt keeps the first reply's sampled ids, reasoning included, and adds the
    new message as the template writes it after the reasoning-free history: one row, its
    tokens what the model saw, the reply's tokens trained, the new message's masked."""
    from agentarium.formats.families import QWEN3_LATEST_REASONING
    from agentarium.schemas import Trajectory
    from agentarium.trainer.batch import Sample, build_rows

    qwen3 = qwen3_of(template, QWEN3_LATEST_REASONING)
    llm, chat = await asked_again(replying, qwen3, whole=echo == "whole")
    one, two = llm.calls
    rendered = qwen3.render(chat)
    assert "Hmm." not in rendered  # the template would drop it
    # sent back whole, the history the template renders drops it: reasoning_kept; sent back
    # without it, the history renders as the template would anyway: a plain extension
    assert two.prompt_build == ("reasoning_kept" if echo == "whole" else "extend")
    kept = one.prompt_ids + one.response_ids
    assert two.prompt_ids[: len(kept)] == kept  # the sampled reasoning, as sampled
    tail = rendered[rendered.index("Sunny.<|im_end|>") + len("Sunny.") :]
    assert qwen3.decode(two.prompt_ids[len(kept) - 1 :]) == tail  # <|im_end|>, then the new turn
    trajectory = Trajectory(
        job_id="j", agent="a", task_id="t", group_id="g", status="ok", reward=1.0,
        calls=[one, two],
    )  # fmt: skip
    rows, stats = build_rows([Sample(trajectory, advantage=1.0)])
    assert (stats.rows, stats.concatenated, stats.prefix_mismatches) == (1, 1, 0)
    (row,) = rows
    assert row.input_ids == two.prompt_ids + two.response_ids
    trained = [t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    assert trained == one.response_ids + two.response_ids


REASONING = "Paris is far; the forecast takes a while to read."
THINKING_REPLY = f"<think>\n{REASONING}\n</think>\n\nSunny."


def budgeted(chat: ChatTemplate):
    """An engine reply for a thinking model: it reasons (REASONING, longer than the budgets
    below), then answers; told to stop at max_new_tokens it does, its text what its ids say
    (a real engine's). Given its own reply's start it goes on with it; after a reasoning
    block closed for it, it answers."""

    def reply(body: dict) -> tuple[list[int], str]:
        written = chat.decode(body["input_ids"]).rsplit("<|im_start|>assistant\n", 1)[-1]
        cont = THINKING_REPLY.startswith(written)  # it goes on with what it had written
        text = THINKING_REPLY[len(written) :] if cont else "Sunny."
        ids = chat.encode(text) + chat.eos_token_ids[:1]  # the fake cuts them at the limit
        kept = ids[: body["sampling_params"]["max_new_tokens"]]
        return ids, chat.decode([i for i in kept if i not in chat.eos_token_ids])

    return reply


async def test_a_thinking_budget_closes_the_reasoning_and_the_answer_follows(template):
    """``thinking_budget`` = 20 (the tiny tokenizer: one token a byte): the engine is asked
    for 20 tokens, all reasoning; the client closes the block itself and asks for the rest
    (64 - 20 - 11 tokens). The reply holds the cut reasoning and the answer; the trajectory
    two calls that make one row, the close's tokens untrained. A budget the reasoning fits in
    is one request; a model without ``<think>`` reasoning or thinking off is refused."""
    from agentarium.consumers.backends import SGLangBackend
    from agentarium.consumers.errors import BadRequest
    from agentarium.consumers.tracing.llm import BUDGET_CLOSE, TracingLLM
    from agentarium.schemas import Sampling, Trajectory
    from agentarium.trainer.batch import Sample, build_rows

    qwen3 = qwen3_of(template)
    async with serving(budgeted(qwen3)) as fake:
        backend = SGLangBackend([fake.url], backoff=0.0)
        try:
            llm = TracingLLM(backend, qwen3, Sampling(max_new_tokens=64), model_name="tiny")
            result = await llm.chat(QUESTION, thinking_budget=20)
            asked = [r["sampling_params"]["max_new_tokens"] for r in fake.requests]
            close = qwen3.encode_piece(BUDGET_CLOSE)
            assert asked == [20, 64 - 20 - len(close)]
            cut = qwen3.decode(qwen3.encode(THINKING_REPLY)[:20])
            assert result.reasoning == cut.removeprefix("<think>").strip()
            assert result.content == "Sunny." and result.finish_reason == "stop"
            one, two = llm.calls
            assert (one.finish_reason, one.prompt_build, two.prompt_build) == ("length", "render", "after_budget")  # fmt: skip
            assert two.prompt_ids == one.prompt_ids + one.response_ids + close
            assert result.call is two

            roomy = TracingLLM(backend, qwen3, Sampling(max_new_tokens=128), model_name="tiny")
            whole = await roomy.chat(QUESTION, thinking_budget=100)
            assert (whole.reasoning, whole.content, len(roomy.calls)) == (REASONING, "Sunny.", 1)
            # closed within the budget, cut in the answer: the rest follows, nothing added
            fake.requests.clear()
            after = await roomy.chat(QUESTION, thinking_budget=70)
            assert [r["sampling_params"]["max_new_tokens"] for r in fake.requests] == [70, 58]
            assert (after.reasoning, after.content) == (REASONING, "Sunny.")
            three = roomy.calls[-1]
            assert three.prompt_ids == roomy.calls[-2].prompt_ids + roomy.calls[-2].response_ids
            with pytest.raises(BadRequest, match="needs thinking on"):
                await roomy.chat(QUESTION, thinking=False, thinking_budget=20)
            for budget in (0, 1.5, True):
                with pytest.raises(BadRequest, match="must be a positive integer"):
                    await roomy.chat(QUESTION, thinking_budget=budget)
            plain = TracingLLM(backend, template, Sampling(max_new_tokens=64), model_name="tiny")
            with pytest.raises(BadRequest, match="reasons in <think> blocks"):
                await plain.chat(QUESTION, thinking_budget=20)
        finally:
            await backend.aclose()
    trajectory = Trajectory(
        job_id="j", agent="a", task_id="t", group_id="g", status="ok", reward=1.0,
        calls=[one, two],
    )  # fmt: skip
    (row,), stats = build_rows([Sample(trajectory, advantage=1.0)])
    assert (stats.rows, stats.prefix_mismatches) == (1, 0)
    assert row.input_ids == two.prompt_ids + two.response_ids
    trained = [t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    assert trained == one.response_ids + two.response_ids  # not the close


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_anthropic_extended_thinking_with_a_budget_through_the_sdk(
    js, topology, template, stream
):
    """The official ``anthropic`` SDK asks for extended thinking with ``budget_tokens``: its
    thinking block holds the reasoning cut at the budget, its text block the answer."""
    import anthropic

    qwen3 = qwen3_of(template)
    seen: dict[str, list] = {}

    async def agent(task: dict, endpoint: str, model: str) -> float:
        sdk = anthropic.AsyncAnthropic(
            base_url=endpoint.removesuffix("/v1"), api_key="unused", max_retries=0
        )
        options = dict(
            model=model,
            max_tokens=64,
            messages=QUESTION,
            thinking={"type": "enabled", "budget_tokens": 20},
        )
        if stream:
            async with sdk.messages.stream(**options) as events:
                reply = await events.get_final_message()
        else:
            reply = await sdk.messages.create(**options)
        seen["blocks"] = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content]  # fmt: skip
        seen["usage"] = [reply.usage.input_tokens, reply.usage.output_tokens]
        return 1.0

    name = f"budget-{int(stream)}"
    async with serving(budgeted(qwen3)) as fake:
        await TaskProducer(js, topology).submit(name, [{"task_id": "t"}], run=name)
        async with worker_for(js, name, agent, [fake.url], attempts=1, template=qwen3) as worker:
            counters = await worker.run()
    assert counters.ok == 1, counters
    cut = qwen3.decode(qwen3.encode(THINKING_REPLY)[:20]).removeprefix("<think>").strip()
    assert seen["blocks"] == [("thinking", cut), ("text", "Sunny.")]
    [trajectory] = await TrajectoryReader(js, topology).read(name)
    one, two = trajectory.calls
    assert [one.prompt_build, two.prompt_build] == ["render", "after_budget"]
    # the turn's usage: the first prompt, and every reply token (the close included)
    reply_tokens = len(two.prompt_ids) - len(one.prompt_ids) + len(two.response_ids)
    assert seen["usage"] == [len(one.prompt_ids), reply_tokens]
