"""What a gateway request reaches: one rollout's tracing client, and what it asks of it.

``Route`` is a rollout's endpoint while the rollout runs: its secret, its ``TracingLLM`` and the
Responses API conversations it stored (``previous_response_id`` works within one rollout only,
and is forgotten with it). ``ChatCall`` is any API's request translated to one ``llm.chat``:
every API goes through that one call, so every trajectory is recorded the same way.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from ...errors import LLMError
from ..llm import ChatResult, OnDelta, TracingLLM
from .errors import GatewayError, from_llm_error

STORED_RESPONSES = 512  # per rollout; the oldest is forgotten first


class ResponseStore:
    """Response id -> the conversation up to and including that response (chat messages,
    without its instructions: they are not carried over to the next response)."""

    def __init__(self, limit: int = STORED_RESPONSES) -> None:
        self.limit = limit
        self._conversations: collections.OrderedDict[str, tuple[dict, ...]] = (
            collections.OrderedDict()
        )

    def put(self, response_id: str, conversation: list[dict]) -> None:
        self._conversations[response_id] = tuple(conversation)
        while len(self._conversations) > self.limit:
            self._conversations.popitem(last=False)

    def get(self, response_id: str) -> list[dict]:
        try:
            return list(self._conversations[response_id])
        except KeyError:
            raise GatewayError(
                f"previous response {response_id!r} not found: responses are kept only within "
                f"the rollout that made them (its last {self.limit}), and only with store=true",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None

    def __len__(self) -> int:
        return len(self._conversations)


@dataclass(frozen=True)
class Route:
    """One rollout's endpoint, registered with the proxy while the rollout runs."""

    job_id: str
    secret: str = field(repr=False)
    llm: TracingLLM
    responses: ResponseStore = field(default_factory=ResponseStore, repr=False)


@dataclass(frozen=True)
class ChatCall:
    """An API request as the tracing client takes it: chat messages, OpenAI tools, sampling."""

    messages: list[dict]
    tools: list[dict] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    thinking: bool | None = None  # reasoning on or off, as the API asked; None: the default
    thinking_budget: int | None = None  # the reasoning's token budget (TracingLLM.chat)

    async def run(self, llm: TracingLLM, on_delta: OnDelta | None = None) -> ChatResult:
        """The call; ``on_delta`` streams its reply's text (``TracingLLM.chat``)."""
        try:
            return await llm.chat(
                self.messages,
                tools=self.tools,
                thinking=self.thinking,
                thinking_budget=self.thinking_budget,
                on_delta=on_delta,
                **self.sampling,
            )
        except (LLMError, TypeError, ValueError) as exc:
            raise from_llm_error(exc) from exc


# OpenAI's reasoning efforts: "none" turns reasoning off, the others on (their levels cannot
# be told apart by a model whose template has an on/off switch at most).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def thinking_of_effort(effort: Any, param: str) -> bool | None:
    """A reasoning effort as reasoning on (True) or off (False); None when not given."""
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise GatewayError(
            f"{param} {effort!r} is not one of {', '.join(EFFORTS)}", param=param.split(".")[0]
        )
    return effort != "none"


def text_of(content: Any, where: str, text_types: tuple[str, ...]) -> str:
    """A message's content as one string: a string as it is, a list of text parts joined with
    newlines (as vLLM and SGLang flatten them for a text model's template). Any other part (an
    image, a file, audio) is refused: the policy is a text model."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise GatewayError(f"{where} must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in text_types:
            raise GatewayError(
                f"{where} holds a {kind!r} part: the Agentarium gateway serves a text model, "
                f"so only {' and '.join(repr(t) for t in text_types)} parts are accepted"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise GatewayError(f"a {kind!r} part of {where} has no 'text' string")
        texts.append(text)
    return "\n".join(texts)


def list_field(body: dict, key: str) -> list:
    """``body[key]`` as a list ([] when unset), or a GatewayError naming it."""
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise GatewayError(f"{key} must be a list", param=key)
    return value


def stop_list(value: Any, field_name: str) -> list[str] | None:
    """A stop string or list of stop strings, checked."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise GatewayError(f"{field_name} must be a string or a list of strings", param=field_name)
    return stops or None
