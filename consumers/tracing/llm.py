"""TracingLLM: the ``llm`` object handed to agents, one per rollout.

``await llm.chat(messages, tools=None, **sampling)`` renders the model's chat template into
token ids, has the backend generate from those ids, and records the exact prompt and response
tokens with their logprobs as an ``LLMCall``: what the policy saw and produced, with no
re-tokenization of text. A call continuing an earlier one's conversation extends that call's
prompt and sampled ids with the new messages' tokens (``PromptChain``), so earlier replies are
never re-encoded either. Tool calls are parsed from the generated text into OpenAI
``tool_calls``. Every call is a ``chat <model>`` CLIENT span under the rollout's span.
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import jinja2
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from agentarium.broker import OPENINFERENCE_SPAN_KIND
from agentarium.formats import (
    THINK_CLOSE,
    THINK_OPEN,
    ChatTemplate,
    ReplyStream,
    TextDelta,
    ToolCallError,
    normalize_messages,
    parse_reply,
    plain_data,
)
from agentarium.schemas import LLMCall, Sampling

from ..backends.base import Backend, GenerateChunk, GenerateRequest, GenerateResult, streams
from ..backends.cross_sampling import model_of_call
from ..errors import BadRequest, LLMError
from ..metrics import observe_llm_call, observe_llm_failure, observe_prompt, observe_stream
from . import genai
from .prompt_chain import Prompt, PromptChain

tracer = trace.get_tracer("agentarium.consumers")
# Request-id nonces: a private generator (seeded from os.urandom), so an agent seeding the
# global one cannot make two attempts of a job, in two processes, send the same rid.
_NONCES = random.Random()

# Per-call keyword → SGLang sampling_params key. The aliases are the OpenAI names, so an agent
# written against the OpenAI SDK can pass what it already passes.
SAMPLING_ALIASES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "seed": "sampling_seed",
}
SAMPLING_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_new_tokens",
        "min_new_tokens",
        "stop",
        "stop_token_ids",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "json_schema",
        "regex",
        "logit_bias",
        "sampling_seed",
    }
)


@dataclass(frozen=True)
class ChatResult:
    """One chat turn. ``text`` is the generated text as decoded (tool-call blocks included);
    ``message`` is the OpenAI-style assistant message to append to the conversation."""

    text: str
    message: dict
    finish_reason: str
    call: LLMCall
    tool_call_errors: list[ToolCallError] = field(default_factory=list)
    # the turn's usage: its prompt (the first request's, when a thinking budget made it two),
    # the prompt tokens the engine had cached, and every token of the reply
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def tool_calls(self) -> list[dict]:
        return self.message.get("tool_calls") or []

    @property
    def content(self) -> str:
        return self.message.get("content") or ""

    @property
    def reasoning(self) -> str | None:
        """The reply's reasoning (None: the model's format has none, or it wrote none)."""
        return self.message.get("reasoning_content")


@functools.lru_cache(maxsize=1024)  # a fleet's few URLs
def _server_address(url: str) -> tuple[str, int | None]:
    address = urlsplit(url)
    return address.hostname or url, address.port


# How a reply cut at its thinking budget has its reasoning closed: as the templates write a
# finished block (``<think>\n{reasoning}\n</think>\n\n{answer}``).
BUDGET_CLOSE = f"\n{THINK_CLOSE}\n\n"


def _capped(params: dict, budget: int) -> dict:
    """``params`` generating at most ``budget`` tokens (the thinking budget's first request)."""
    return {**params, "max_new_tokens": min(budget, params["max_new_tokens"])}


def _sampling_params(job: Sampling, eos_ids: Sequence[int], overrides: dict[str, Any]) -> dict:
    params: dict[str, Any] = {
        "max_new_tokens": job.max_new_tokens,
        "temperature": job.temperature,
        "top_p": job.top_p,
        "top_k": job.top_k,
    }
    if job.stop:
        params["stop"] = list(job.stop)
    if eos_ids:
        params["stop_token_ids"] = list(eos_ids)
    for key, value in overrides.items():
        key = SAMPLING_ALIASES.get(key, key)
        if key not in SAMPLING_KEYS:
            allowed = sorted(SAMPLING_KEYS | set(SAMPLING_ALIASES))
            raise TypeError(f"llm.chat() got an unknown sampling option {key!r}; known: {allowed}")
        if value is None:  # clients pass None for "not set"
            continue
        if key == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
                raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
            value = list(value)
        params[key] = value
    for key in ("temperature", "top_p", "max_new_tokens", "top_k", "min_p", "sampling_seed"):
        if key in params:
            params[key] = _number(key, params[key], integer=key in _INTEGER_KEYS)
    if params["temperature"] < 0:
        raise ValueError(f"temperature must be >= 0, got {params['temperature']}")
    if not 0 < params["top_p"] <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params['top_p']}")
    if params["max_new_tokens"] < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params['max_new_tokens']}")
    return params


_INTEGER_KEYS = frozenset({"max_new_tokens", "top_k", "sampling_seed"})


def _number(key: str, value: Any, *, integer: bool) -> float | int:
    """A sampling option as a finite number (an integer where SGLang wants one), or a
    ValueError naming the option: an agent or an OpenAI client may send anything."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{key} must be {kind}, got {value!r}")
    if integer:
        if value != int(value):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return int(value)
    return value


OnDelta = Callable[[TextDelta], None]


class _LiveCall:
    """A streamed call's tokens so far, and its reply's sure deltas handed to ``on_delta``."""

    def __init__(self, reply: ReplyStream, on_delta: OnDelta) -> None:
        self.reply = reply
        self.on_delta = on_delta
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[tuple[str, int]] = []  # (version, first output index)
        self.fed: list[str] = []  # the request's text fed so far, in pieces

    def chunk(self, chunk: GenerateChunk) -> None:
        if chunk.output_ids and (not self.versions or self.versions[-1][0] != chunk.weight_version):
            self.versions.append((chunk.weight_version, len(self.ids)))
        self.ids.extend(chunk.output_ids)
        self.logprobs.extend(chunk.output_logprobs)
        self.fed.append(chunk.text)
        self.text(chunk.text)

    def text(self, piece: str) -> None:
        for delta in self.reply.feed(piece):
            self.on_delta(delta)

    def ended(self, result: GenerateResult) -> None:
        """The request's text the chunks did not carry (its last chunk's), as the reply's."""
        fed = "".join(self.fed)
        if result.text.startswith(fed):
            self.text(result.text[len(fed) :])

    def restart(self) -> None:
        """A second request continues the reply (the thinking budget's): its tokens are new."""
        self.ids, self.logprobs, self.versions, self.fed = [], [], [], []


class TracingLLM:
    """Renders, generates, records and traces every LLM call of one rollout.

    ``template`` may be None only with a chat-native backend (``OpenAICompatBackend``); the
    calls then carry no token ids. ``route_key`` is the job's group_id (one server per group),
    ``rid_prefix`` the job id (request ids ``<job>-<nonce>-call-<n>``, unique even when a
    redelivered job runs again while the first attempt is still on the server).
    ``capture_content`` puts prompts and replies on the chat spans; None reads the GenAI
    conventions' switch, ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``.
    ``extend_prompts`` False renders every prompt whole instead of extending the call it
    continues (``PromptChain``; comparisons and benchmarks).
    """

    def __init__(
        self,
        backend: Backend,
        template: ChatTemplate | None,
        job_sampling: Sampling | None = None,
        route_key: str = "",
        rid_prefix: str = "",
        model_name: str = "",
        parent_context: otel_context.Context | None = None,
        *,
        record_messages: bool = True,
        capture_content: bool | None = None,
        extend_prompts: bool = True,
    ) -> None:
        self.backend = backend
        self.template = template
        self.sampling = job_sampling if job_sampling is not None else Sampling()
        self.route_key = route_key
        self.rid_prefix = rid_prefix or "llm"
        self.model_name = model_name
        self.parent_context = parent_context
        self.record_messages = record_messages
        self.chain = PromptChain(template, extend=extend_prompts) if template is not None else None
        # how the model writes tool calls and reasoning (formats/): from its chat template
        self.tool_format, self.reasoning_format = (
            template.reply_formats if template is not None else ("hermes", "none")
        )
        self.capture_content = (
            genai.capture_message_content() if capture_content is None else capture_content
        )
        # gen_ai.provider.name: the API the backend speaks. Custom backends may not say.
        self.provider_name = str(getattr(backend, "provider_name", "") or "unknown")
        self.calls: list[LLMCall] = []
        # Backend errors seen by this rollout, kept even when the agent swallows them (the
        # OpenAI SDK turns the proxy's 503 into its own exception), so the worker can class
        # the rollout as an infrastructure failure.
        self.errors: list[LLMError] = []
        self._nonce = f"{_NONCES.getrandbits(24):06x}"
        self._started = 0
        self._span_name = f"chat {model_name}".rstrip()

    async def chat(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        *,
        thinking: bool | None = None,
        thinking_budget: int | None = None,
        on_delta: OnDelta | None = None,
        **sampling: Any,
    ) -> ChatResult:
        """Generate the assistant's next message; per-call sampling overrides the job's.
        ``thinking`` turns a thinking model's reasoning on or off (its template's
        ``enable_thinking``; None: the template's default); asking what the model cannot do
        (off for a model that always reasons, on for one that never does) is a BadRequest.

        ``thinking_budget`` bounds the reasoning to that many generated tokens (a ``<think>``
        model's; it turns reasoning on): a reply still reasoning at the budget has its block
        closed for it (``</think>``, tokens the policy did not sample: recorded as context,
        never trained) and the answer generated after it, within the call's max tokens. The
        reply is then two engine requests, recorded as two calls that make one row.

        ``on_delta`` streams the reply: it is called with each piece of reasoning or content
        text (``TextDelta``) that is sure (``formats.ReplyStream``), as the backend generates
        it when the backend streams, and with the rest before ``chat`` returns; the pieces add
        up to the message's ``reasoning_content`` and ``content`` exactly. A streamed call that
        is cancelled (its client went away) is recorded with the tokens it had, finish_reason
        ``abort``, and the backend aborts the server's request."""
        if thinking_budget is not None:
            thinking = self._check_budget(thinking, thinking_budget)
        variables = self._thinking_variables(thinking)
        chat = normalize_messages(messages)
        tool_list = plain_data(list(tools)) if tools else None
        eos = self.template.eos_token_ids if self.template is not None else []
        params = _sampling_params(self.sampling, eos, sampling)
        index, self._started = self._started, self._started + 1
        # The chat span is current during the call: the backend's HTTP request carries its
        # traceparent, so the engine's spans (queue, prefill, decode) are its children.
        attributes = self._request_attributes(chat, tool_list, params)
        span = tracer.start_span(
            self._span_name,
            context=self._parent_for_call(),
            kind=trace.SpanKind.CLIENT,
            attributes=attributes,
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            result, response = await self._chat(
                index, chat, tool_list, params, variables, thinking_budget, on_delta
            )
        except BaseException as exc:  # CancelledError too: a deadline cut the call
            if span.is_recording():
                span.set_attribute("error.type", genai.error_type(exc))
                if isinstance(exc, Exception):  # as start_as_current_span records one
                    span.record_exception(exc)
                    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            if isinstance(exc, LLMError):
                self.errors.append(exc)
                observe_llm_failure(exc)
            raise
        else:
            if span.is_recording():
                span.set_attributes(response)
            return result
        finally:
            otel_context.detach(token)
            span.end()

    def _parent_for_call(self) -> otel_context.Context | None:
        """The chat span's parent context, or None for the current one.

        The worker attaches the rollout context for the whole agent run, so an agent's own
        spans nest under the rollout and chat spans under them: when the current span belongs
        to the rollout's trace, keep it. Otherwise (a proxy handler, a thread without the
        context, no span at all) parent it on the rollout context.
        """
        if self.parent_context is None:
            return None
        current = trace.get_current_span().get_span_context()
        rollout = trace.get_current_span(self.parent_context).get_span_context()
        if current.is_valid and current.trace_id == rollout.trace_id:
            return None
        return self.parent_context

    def _request_attributes(
        self, chat: list[dict], tools: list | None, params: dict
    ) -> dict[str, AttributeValue]:
        """What a chat span says before the call: set at its start, so a failed call shows
        what was asked."""
        attributes: dict[str, AttributeValue] = {
            OPENINFERENCE_SPAN_KIND: "LLM",
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": self.provider_name,
            "gen_ai.request.model": self.model_name,
            **genai.request_attributes(params),
        }
        if self.capture_content:
            attributes["gen_ai.input.messages"] = genai.input_messages(chat)
            if tools:
                attributes["gen_ai.tool.definitions"] = genai.tool_definitions(tools)
        return attributes

    def _check_budget(self, thinking: bool | None, budget: Any) -> bool:
        """``thinking`` as a budget needs it (on), or a BadRequest saying why it cannot be."""
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise BadRequest(f"thinking_budget must be a positive integer, got {budget!r}")
        if thinking is False:
            raise BadRequest("thinking_budget is a budget for reasoning: it needs thinking on")
        if self.template is None or self.reasoning_format != "think":
            raise BadRequest(
                "a thinking budget needs a model that reasons in <think> blocks and a token "
                f"backend (this model's reasoning format: {self.reasoning_format!r})"
            )
        return True

    def _thinking_variables(self, thinking: bool | None) -> dict | None:
        """The template variables that honour ``thinking`` (see ``chat``)."""
        if thinking is None:
            return None
        if self.template is not None and self.template.thinking_switch:
            return {"enable_thinking": bool(thinking)}
        thinks = self.reasoning_format != "none"
        if bool(thinking) != thinks:
            raise BadRequest(
                f"reasoning cannot be turned {'on' if thinking else 'off'}: this model "
                f"{'always reasons' if thinks else 'does not reason'} (its chat template has no "
                "enable_thinking switch)"
            )
        return None  # what the model does anyway

    async def _chat(
        self,
        index: int,
        chat: list[dict],
        tools: list | None,
        params: dict,
        variables: dict | None = None,
        budget: int | None = None,
        on_delta: OnDelta | None = None,
    ) -> tuple[ChatResult, dict[str, AttributeValue]]:
        """The call, and the attributes its span gets from the response."""
        prompt = Prompt([], "", "")
        if self.chain is not None:
            try:
                prompt = self.chain.prompt(chat, tools, variables)
            except jinja2.TemplateError as exc:
                raise BadRequest(f"the chat template refused these messages: {exc}") from exc
            observe_prompt(prompt.build)
        input_ids = prompt.ids
        opened = prompt.text.rstrip().endswith(THINK_OPEN)
        rid = f"{self.rid_prefix}-{self._nonce}-call-{index}"

        def request_of(ids: list[int], sampling: dict, suffix: str = "") -> GenerateRequest:
            return GenerateRequest(
                input_ids=ids,
                sampling=sampling,
                rid=rid + suffix,
                route_key=self.route_key,
                messages=chat,
                tools=tools,
            )

        live = None
        if on_delta is not None:
            sure = ReplyStream(
                tool_format=self.tool_format,
                reasoning_format=self.reasoning_format,
                tools=bool(tools),
                opened=opened,
            )
            live = _LiveCall(sure, on_delta)
        request = request_of(input_ids, params if budget is None else _capped(params, budget))
        start = time.perf_counter()
        result = await self._generate(request, live, params, prompt.build)
        latency = time.perf_counter() - start
        cut = None  # the first request, when the thinking budget cut the reply in two
        text, output_ids = result.text, list(result.output_ids)
        forced = self._budget_close(result, params, opened) if budget is not None else None
        if forced is not None:
            cut = (request, result, latency)
            left = params["max_new_tokens"] - len(output_ids) - len(forced)
            request = request_of(
                [*input_ids, *output_ids, *forced],
                {**params, "max_new_tokens": left},
                "-after-budget",
            )
            forced_text = self.template.decode(forced)  # type: ignore[union-attr]
            if live is not None:
                live.restart()
                live.text(forced_text)
            start = time.perf_counter()
            result = await self._generate(request, live, params, "after_budget")
            latency = time.perf_counter() - start
            text = text + forced_text + result.text
            output_ids = [*output_ids, *forced, *result.output_ids]

        errors: list[ToolCallError] = []
        reasoning: str | None = None
        if result.tool_calls is not None:  # a chat-native backend parsed them already
            content, tool_calls = result.text, result.tool_calls
        else:  # reasoning off first, then tool calls (when offered) in the rest alone
            reply = parse_reply(
                text,
                tool_format=self.tool_format,
                reasoning_format=self.reasoning_format,
                tools=tools,
                opened=opened,
            )
            content, tool_calls, errors = reply.content, reply.tool_calls, reply.errors
            reasoning = reply.reasoning
        if live is not None:
            for delta in live.reply.finish(reasoning, content):
                live.on_delta(delta)
            observe_stream(diverged=live.reply.diverged)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:  # where thinking models' APIs put it (vLLM, SGLang, DeepSeek)
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if tool_calls else result.finish_reason

        if cut is not None:  # the reply up to the budget: a call of its own, no messages
            first_request, first, first_latency = cut
            self.calls.append(
                self._call_of(first_request, first, params, first_latency, None, prompt.build)
            )
            observe_llm_call(self.calls[-1], len(input_ids), len(first.output_ids))
        call = self._call_of(
            request,
            result,
            params,
            latency,
            [*chat, message] if self.record_messages else None,
            prompt.build if cut is None else "after_budget",
            finish,
        )
        self.calls.append(call)
        if self.chain is not None:
            self.chain.record(chat, tools, prompt, message, output_ids, variables)

        prompt_tokens = len(request.input_ids) or result.prompt_tokens
        output_tokens = len(result.output_ids) or result.completion_tokens
        observe_llm_call(call, prompt_tokens, output_tokens)
        # The model that answered: a cross-sampled call names the second model.
        model = result.meta_info.get("model") or model_of_call(call, self.model_name)
        attributes: dict[str, AttributeValue] = {
            "gen_ai.response.model": str(model),
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.usage.cache_read.input_tokens": result.cached_tokens,
            "gen_ai.response.finish_reasons": [finish],
            "agentarium.weight_version": result.weight_version,
        }
        if result.weight_spans:  # the weights changed mid-call: each version and its first token
            attributes["agentarium.weight_spans.versions"] = [v for v, _ in result.weight_spans]
            attributes["agentarium.weight_spans.starts"] = [i for _, i in result.weight_spans]
        response_id = result.meta_info.get("id")
        if response_id:
            attributes["gen_ai.response.id"] = str(response_id)
        if self.capture_content:
            attributes["gen_ai.output.messages"] = genai.output_messages(message, finish)
        if result.backend:
            host, port = _server_address(result.backend)
            attributes["server.address"] = host
            if port:
                attributes["server.port"] = port
        if errors:
            attributes["agentarium.tool_call_errors"] = len(errors)
        chat_result = ChatResult(
            text=text,
            message=message,
            finish_reason=finish,
            call=call,
            tool_call_errors=errors,
            prompt_tokens=len(input_ids),
            cached_tokens=(cut[1] if cut is not None else result).cached_tokens,
            output_tokens=len(output_ids),
        )
        return chat_result, attributes

    async def _generate(
        self, request: GenerateRequest, live: _LiveCall | None, params: dict, build: str
    ) -> GenerateResult:
        """The backend's result for ``request``: streamed into ``live`` when there is one and
        the backend streams. Cancelled mid-stream, the call is recorded as aborted."""
        if live is None or not streams(self.backend):
            return await self.backend.generate(request)
        started = time.perf_counter()
        try:
            result = await self.backend.generate(request, on_chunk=live.chunk)  # type: ignore[call-arg]
            live.ended(result)
            return result
        except asyncio.CancelledError:
            versions = live.versions
            aborted = GenerateResult(
                output_ids=list(live.ids),
                output_logprobs=list(live.logprobs),
                text="",
                finish_reason="abort",
                weight_version=versions[-1][0] if versions else "default",
                weight_spans=list(versions) if len(versions) > 1 else [],
            )
            latency = time.perf_counter() - started
            self.calls.append(self._call_of(request, aborted, params, latency, None, build))
            raise

    def _call_of(
        self,
        request: GenerateRequest,
        result: GenerateResult,
        params: dict,
        latency: float,
        messages: list[dict] | None,
        build: str,
        finish: str | None = None,
    ) -> LLMCall:
        return LLMCall(
            prompt_ids=list(request.input_ids),
            response_ids=list(result.output_ids),
            response_logprobs=list(result.output_logprobs),
            finish_reason=finish or result.finish_reason,
            weight_version=result.weight_version,
            weight_spans=list(result.weight_spans),
            temperature=float(params["temperature"]),
            top_p=float(params["top_p"]),
            top_k=int(params.get("top_k", -1)),
            latency_s=latency,
            backend=result.backend,
            model=result.model or self.model_name,
            policy=result.policy,
            cached_tokens=result.cached_tokens,
            messages=messages,
            prompt_build=build,
        )

    def _budget_close(self, first: GenerateResult, params: dict, opened: bool) -> list[int] | None:
        """What follows a reply cut at the thinking budget (``_capped``): None when it was
        not cut there (it ended, or the call's own limit was reached), else the tokens to
        append before the rest is generated: the reasoning's close when the cut fell inside
        it (the template's way of closing the block), nothing when it had closed already."""
        used = len(first.output_ids)
        if first.finish_reason != "length" or used >= params["max_new_tokens"]:
            return None
        text = first.text
        start = text.find(THINK_OPEN)
        inside = (opened or start != -1) and THINK_CLOSE not in text[max(start, 0) :]
        assert self.template is not None  # _check_budget
        forced = self.template.encode_piece(BUDGET_CLOSE) if inside else []
        if used + len(forced) >= params["max_new_tokens"]:
            return None  # no room left for an answer
        return forced

    def __repr__(self) -> str:
        return (
            f"TracingLLM(model={self.model_name!r}, rid_prefix={self.rid_prefix!r}, "
            f"route_key={self.route_key!r}, calls={len(self.calls)})"
        )
