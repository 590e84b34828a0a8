"""PromptChain: a multi-turn rollout's next prompt built from token ids, not from re-rendered text.

Rendering the whole conversation again re-encodes the model's earlier replies from their text,
and text does not always come back as the ids that were sampled: a BPE tokenizer merges it
otherwise (SmolLM2's sampled ``'ĊĠ', 'ensitivity'`` re-encodes as ``'Ċ', 'Ġs', 'ensitivity'``)
and a reply cut inside a UTF-8 character decodes to U+FFFD. The next prompt then no longer
starts with the previous prompt and reply, and the trainer cannot make the rollout one row.

So, as TRL's and prime-rl's multi-turn renderers do, a call whose messages continue an earlier
call of the rollout (that call's messages, its reply, then new messages) gets as prompt: the
earlier prompt's ids, the ids it sampled, then the tokens of what the template writes after
them: the end of the assistant turn the sample did not produce itself (its end-of-turn token
when it stopped on one, the whole turn end when it was cut), and the new messages, taken as the
text the conversation's rendering has beyond the rendering without them. Every prompt of such
a rollout starts with the previous prompt and reply: one exact row by construction.

That is the template's own rendering only while the template renders the history the same way
once messages follow. One departure is deliberate: a template that drops the reasoning of turns
before the latest user message (Qwen3's own, DeepSeek-R1's) would show the model a history
without the reasoning it sampled; the prompt keeps it instead (``reasoning_kept``: the earlier
ids whole, then the new messages as the template writes them after the reasoning-free history),
so the rollout stays one row and the trainer trains exactly the context the model saw. When the
template rewrites the history otherwise (renders the generation prompt unlike a finished turn,
changes the system prompt with the tools, rewrites earlier content), or its turn end cannot be
found, the prompt is the whole conversation rendered, as before, and ``Prompt.build`` says why
(``BUILDS``).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from agentarium.formats import ChatTemplate, arguments_as_objects, normalize_messages

log = structlog.get_logger("agentarium.consumers")

# How a prompt was built. render: the conversation rendered (no earlier call it continues);
# extend: an earlier call's prompt + sampled ids + the new messages' tokens; reasoning_kept: the
# same, where the template would have dropped the earlier turns' reasoning; after_budget: the
# rest of a reply cut at its thinking budget (the first part's prompt and sampled ids, and the
# reasoning's close when the cut fell inside it: consumers/tracing/llm.py). The others are
# rendered because extending was refused: tools_changed (other tools, or other template
# variables such as thinking on or off, than the call it continues), reply_rerendered (the template renders the finished reply's turn unlike the
# prompt it was sampled after), history_rewritten (the earlier conversation renders otherwise
# once the new messages follow), no_turn_end (the template's end of an assistant turn was not
# found: neither its plain replies' end nor the sampled text itself in the rendering).
BUILDS = (
    "render",
    "extend",
    "reasoning_kept",
    "after_budget",
    "tools_changed",
    "reply_rerendered",
    "history_rewritten",
    "no_turn_end",
)
# Refusals that come from the template itself: logged once per template, as each one costs
# every multi-turn rollout of the model its single row.
TEMPLATE_REFUSALS = ("reply_rerendered", "history_rewritten", "no_turn_end")
# Earlier calls a new one may continue (an agent continues its latest one; a few more let it
# branch or retry a turn).
KEEP_TURNS = 4

_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Prompt:
    """A call's prompt: its ids, the conversation's rendered text (the next call compares its
    own rendering with it) and how it was built (one of ``BUILDS``)."""

    ids: list[int]
    text: str
    build: str


@dataclass(frozen=True)
class _Turn:
    """A finished call, as a later call may continue it."""

    chat: list[dict]
    tools: list | None
    reply: tuple
    text: str
    ids: list[int]  # prompt + sampled
    last: int  # the last sampled id
    sampled: tuple[int, ...] = ()  # the sampled ids without a final end token
    variables: dict = field(default_factory=dict)  # the template variables it was rendered with
    bare: tuple = ()  # ``reply`` without its reasoning: a client may send the turn back so


class PromptChain:
    """The prompts of one rollout's calls, each continuing an earlier one where it can.

    ``extend=False`` renders every prompt whole (what the tracing client did before).
    """

    def __init__(self, template: ChatTemplate, *, extend: bool = True) -> None:
        self.template = template
        self.extend = extend
        self._turns: deque[_Turn] = deque(maxlen=KEEP_TURNS)

    def prompt(self, chat: list[dict], tools: list | None, variables: dict | None = None) -> Prompt:
        """The prompt for ``chat`` (normalized messages), ``tools`` (plain data) and template
        ``variables`` (``enable_thinking``).

        Raises jinja2.TemplateError when the template refuses the messages."""
        rendered = arguments_as_objects(chat)
        text = self.template.render_normalized(rendered, tools, variables=variables)
        turn = self._continued(chat) if self.extend else None
        if turn is None:
            return Prompt(self.template.encode(text), text, "render")
        if (variables or {}) != turn.variables:
            return Prompt(self.template.encode(text), text, "tools_changed")
        build, ids = self._extension(turn, rendered, tools, text)
        if ids is None:
            _note_refusal(self.template, build)
            return Prompt(self.template.encode(text), text, build)
        return Prompt(ids, text, build)

    def record(
        self,
        chat: list[dict],
        tools: list | None,
        prompt: Prompt,
        reply: dict,
        response_ids: Sequence[int],
        variables: dict | None = None,
    ) -> None:
        """Remember a finished call, so that a later call continuing it extends its ids (not
        one without token ids: its reply exists only as text)."""
        if self.extend and prompt.ids and len(response_ids):
            ids = [*prompt.ids, *response_ids]
            # keyed as the next call's messages will hold it: normalized (a reasoning field
            # gains its aliases there, as transformers adds them)
            normalized = normalize_messages([reply])[0]
            sampled = list(response_ids)
            if sampled[-1] in self.template.eos_token_ids:
                sampled = sampled[:-1]
            turn = _Turn(
                chat,
                tools,
                _reply_key(normalized),
                prompt.text,
                ids,
                response_ids[-1],
                tuple(sampled),
                dict(variables or {}),
                _reply_key({k: v for k, v in normalized.items() if k not in REASONING_KEYS}),
            )
            self._turns.append(turn)

    def _continued(self, chat: list[dict]) -> _Turn | None:
        """The latest earlier call whose messages and reply begin ``chat``."""
        for turn in reversed(self._turns):
            n = len(turn.chat)
            if (
                len(chat) > n
                and chat[n].get("role") == "assistant"
                and _reply_key(chat[n]) in _keys_of(turn, chat[n])
                and chat[:n] == turn.chat
            ):
                return turn
        return None

    def _extension(
        self, turn: _Turn, rendered: list[dict], tools: list | None, text: str
    ) -> tuple[str, list[int] | None]:
        """(build, ids): the extended prompt's ids, or None and the reason there are none."""
        if tools != turn.tools:
            return "tools_changed", None
        # The conversation up to and with the earlier reply, as a finished turn.
        base = self.template.render_normalized(
            rendered[: len(turn.chat) + 1],
            tools,
            add_generation_prompt=False,
            variables=turn.variables,
        )
        if not base.startswith(turn.text):
            return "reply_rerendered", None
        build, new = "extend", text[len(base) :]
        if not text.startswith(base):
            # The template may only have dropped the reasoning of the turns before the new
            # user message: then the new messages are what follows the history without it.
            bare = self.template.render_normalized(
                _without_reasoning(rendered[: len(turn.chat) + 1]),
                tools,
                add_generation_prompt=False,
                variables=turn.variables,
            )
            if bare == base or not text.startswith(bare):
                return "history_rewritten", None
            build, new = "reasoning_kept", text[len(bare) :]
        close = self.template.turn_close(tools)
        if close is None or not base.endswith(close):
            # This turn ends otherwise than a plain reply's (Llama 3 ends a tool call's turn
            # with <|eom_id|>): what the rendering has after the reply's own text.
            rest = base[len(turn.text) :]
            # decoded only here, on this rare path: as a rendering holds it, special tokens
            # as text (<|python_tag|>, [TOOL_CALLS])
            written = self.template.decode(list(turn.sampled))
            if not written or not rest.startswith(written):
                return "no_turn_end", None
            close = rest[len(written) :]
        if turn.last in self.template.eos_token_ids:
            # it ended its turn itself; the template may write more after that token ("\n")
            ended = self.template.decode([turn.last])
            if ended and close.startswith(ended):
                close = close[len(ended) :]
        return build, turn.ids + self.template.encode_piece(close + new)


# Where a reply's reasoning travels (normalize_messages fills every alias from any of them).
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _without_reasoning(messages: list[dict]) -> list[dict]:
    """``messages`` with every assistant turn's reasoning removed."""
    return [
        {k: v for k, v in m.items() if k not in REASONING_KEYS}
        if m.get("role") == "assistant"
        else m
        for m in messages
    ]


def _keys_of(turn: _Turn, incoming: dict) -> tuple[tuple, ...]:
    """The keys an incoming copy of ``turn``'s reply may have: with its reasoning, or, when
    the client sent the turn back without it (most agent loops keep content and tool calls
    alone), without."""
    if any(incoming.get(k) for k in REASONING_KEYS):
        return (turn.reply,)
    return (turn.reply, turn.bare)


def _reply_key(message: dict) -> tuple:
    """What makes an assistant message the reply a call returned: its content and tool calls
    (names and arguments; ids and types are the client's business), and any other field set."""
    calls = tuple(
        (
            str((call.get("function") or {}).get("name")),
            _canonical((call.get("function") or {}).get("arguments")),
        )
        for call in message.get("tool_calls") or []
        if isinstance(call, dict)
    )
    rest = {
        k: v
        for k, v in message.items()
        if k not in ("role", "content", "tool_calls") and v not in ("", [], {})
    }
    return message.get("content") or "", calls, _canonical(rest)


def _canonical(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _note_refusal(template: ChatTemplate, build: str) -> None:
    if build not in TEMPLATE_REFUSALS or (template.name, build) in _warned:
        return
    _warned.add((template.name, build))
    log.warning(
        "chat template breaks multi-turn prompt extension: prompts are rendered whole, and "
        "trajectories whose replies re-encode differently become one row per call",
        template=template.name,
        reason=build,
    )
