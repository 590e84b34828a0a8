"""Tool calls parsed from generated text, in each model family's format.

The policy writes its tool calls as text; agents expect OpenAI-style ``tool_calls``. A call
that does not parse is a fact about the policy (worth a reward penalty, never a crash): it is
reported in ``errors`` and its raw text stays in ``content``, so the agent and the trajectory
see exactly what the model wrote. The formats (``TOOL_FORMATS``), as each family's chat
template teaches them:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes,
  Qwen2.5, Qwen3);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>`` (Qwen3-Coder): values are text, typed by the tool's JSON schema when it is
  given (integer, number, boolean, object, array: JSON), else JSON when they parse as JSON;
- ``llama3_json``: the whole reply one JSON object ``{"name": ..., "parameters": {...}}``, or
  several separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1-3.3);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects (Mistral
  v3 tokenizers), or ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (v11+: Devstral, Magistral);
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜>`` … ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
  then a fenced ``json`` block, ``<｜tool▁call▁end｜>`` … ``<｜tool▁calls▁end｜>`` (V3, R1), or
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` (V3.1);
- ``harmony``: gpt-oss's channels, ``<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{...}<|call|>``; the ``final`` channel's message is the content (its ``analysis``
  channel is reasoning: formats/harmony.py splits all three).

Markers are matched in the decoded text, so special-token markers (Mistral's, DeepSeek's,
harmony's) must be decoded with special tokens kept.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# A closed block, or an unclosed one running to the end of the text: generation may stop on
# "</tool_call>" as a stop string (SGLang trims it from the text) or on EOS right after the JSON.
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@dataclass(frozen=True)
class ToolCallError:
    """One ``<tool_call>`` block that could not be turned into a call."""

    raw: str
    message: str


@dataclass(frozen=True)
class ParsedToolCalls:
    """The text split into plain content and OpenAI-style tool calls."""

    content: str
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


TOOL_FORMATS = ("hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3", "harmony")


def _to_call(payload: Any) -> dict:
    if not isinstance(payload, dict):
        raise ValueError(
            f"expected a JSON object with name and arguments, got {type(payload).__name__}"
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("the tool call has no 'name' string")
    # Some fine-tunes write "parameters" for "arguments".
    arguments = payload.get("arguments", payload.get("parameters"))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"'arguments' is a string that is not JSON: {exc}") from None
    else:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call(name: str, arguments: Any) -> dict:
    """An OpenAI-style call of ``name`` with ``arguments`` (an object, or JSON text)."""
    return _to_call({"name": name, "arguments": arguments})


def parse_tool_calls(
    text: str, fmt: str = "hermes", *, tools: list[dict] | None = None
) -> ParsedToolCalls:
    """Split ``text`` into content and tool calls written in format ``fmt`` (``TOOL_FORMATS``);
    malformed calls become ``errors``. ``tools``: the OpenAI tool definitions offered, which
    type qwen3_coder's text parameters."""
    parser = _PARSERS.get(fmt)
    if parser is None:
        raise ValueError(f"unknown tool-call format {fmt!r}: one of {', '.join(TOOL_FORMATS)}")
    return parser(text, tools or [])


def _hermes(text: str, _tools: list[dict]) -> ParsedToolCalls:
    if TOOL_CALL_OPEN not in text:
        return ParsedToolCalls(content=text)

    def parse(block: re.Match) -> list[dict]:
        body = (block.group(1) if block.group(1) is not None else block.group(2)).strip()
        payload = json.loads(body)
        # A list of calls inside one block is rare but unambiguous.
        return [_to_call(p) for p in (payload if isinstance(payload, list) else [payload])]

    return _blocks(text, _BLOCK, parse)


def _blocks(text: str, pattern: re.Pattern, parse: Any) -> ParsedToolCalls:
    """Every match of ``pattern`` turned into calls by ``parse(match)``; the text between
    matches, and the raw text of a match that fails, is the content."""
    calls: list[dict] = []
    errors: list[ToolCallError] = []
    kept: list[str] = []
    position = 0
    for match in pattern.finditer(text):
        try:
            found = parse(match)
        except ValueError as exc:
            errors.append(ToolCallError(raw=match.group(0), message=str(exc)))
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.extend(found)
    kept.append(text[position:])
    return ParsedToolCalls(content="".join(kept).strip(), tool_calls=calls, errors=errors)


_CODER_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_CODER_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_CODER_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL
)
_JSON_TYPES = ("integer", "number", "boolean", "object", "array", "null")


def _schema_types(tools: list[dict], name: str) -> dict[str, Any]:
    """``name``'s parameters' JSON-schema types, from the tools offered."""
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function, dict) and function.get("name") == name:
            props = (function.get("parameters") or {}).get("properties") or {}
            return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _coder_value(raw: str, kind: Any) -> Any:
    value = raw.strip("\n")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds:  # text as written ("123" stays a string), or a nullable's null
        return None if value == "null" and "null" in kinds else value
    if kind is None or any(k in _JSON_TYPES for k in kinds):
        try:
            return json.loads(value)
        except ValueError:
            if kind is not None and "string" not in kinds:
                raise ValueError(
                    f"parameter value {value!r} is not the {kind} its schema says"
                ) from None
    return value


def _qwen3_coder(text: str, tools: list[dict]) -> ParsedToolCalls:
    if TOOL_CALL_OPEN not in text:
        return ParsedToolCalls(content=text)

    def parse(block: re.Match) -> list[dict]:
        functions = list(_CODER_FUNCTION.finditer(block.group(1)))
        if not functions:
            raise ValueError("a <tool_call> block with no <function=NAME>")
        calls = []
        for function in functions:
            name = function.group(1).strip()
            types = _schema_types(tools, name)
            arguments = {
                p.group(1).strip(): _coder_value(p.group(2), types.get(p.group(1).strip()))
                for p in _CODER_PARAMETER.finditer(function.group(2))
            }
            calls.append(_call(name, arguments))
        return calls

    return _blocks(text, _CODER_BLOCK, parse)


PYTHON_TAG = "<|python_tag|>"


def _llama3_json(text: str, _tools: list[dict]) -> ParsedToolCalls:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return ParsedToolCalls(content=text)
    decoder = json.JSONDecoder()
    calls, position = [], 0
    try:
        while position < len(body):
            payload, end = decoder.raw_decode(body, position)
            if not isinstance(payload, dict) or not (
                "name" in payload and ("parameters" in payload or "arguments" in payload)
            ):
                raise ValueError("a JSON object without a 'name' is not a tool call")
            calls.append(_to_call(payload))
            rest = body[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                raise ValueError(f"text after the tool call: {rest[:40]!r}")
            position = len(body) - len(rest)
    except ValueError as exc:
        if not calls and "'name'" in str(exc):
            return ParsedToolCalls(content=text)  # a JSON answer, not a call
        return ParsedToolCalls(content=text, errors=[ToolCallError(raw=text, message=str(exc))])
    return ParsedToolCalls(content="", tool_calls=calls)


MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"


def _mistral(text: str, _tools: list[dict]) -> ParsedToolCalls:
    start = text.find(MISTRAL_CALLS)
    if start == -1:
        return ParsedToolCalls(content=text)
    content, rest = text[:start].strip(), text[start:]
    calls: list[dict] = []
    try:
        for piece in rest.split(MISTRAL_CALLS)[1:]:
            piece = piece.strip()
            if MISTRAL_ARGS in piece:  # v11+: NAME[ARGS]{...}
                name, arguments = piece.split(MISTRAL_ARGS, 1)
                calls.append(_call(name.strip(), json.loads(arguments)))
            else:  # v3: a JSON list of calls
                payload = json.loads(piece)
                calls.extend(
                    _to_call(p) for p in (payload if isinstance(payload, list) else [payload])
                )
    except ValueError as exc:
        return ParsedToolCalls(
            content=text.strip(), errors=[ToolCallError(raw=rest, message=str(exc))]
        )
    return ParsedToolCalls(content=content, tool_calls=calls)


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
_DS_CALL = re.compile(
    re.escape(DS_CALL_BEGIN)
    + r"(.*?)"
    + re.escape(DS_SEP)
    + r"(.*?)(?:"
    + re.escape(DS_CALL_END)
    + r"|\Z)",
    re.DOTALL,
)
_FENCE = re.compile(r"\A\s*([^\n`]*)\n```(?:json)?\s*\n(.*?)\n?```\s*\Z", re.DOTALL)


def _deepseek_v3(text: str, _tools: list[dict]) -> ParsedToolCalls:
    start = text.find(DS_CALLS_BEGIN)
    if start == -1:
        return ParsedToolCalls(content=text)
    end = text.find(DS_CALLS_END, start)
    section = text[start + len(DS_CALLS_BEGIN) : end if end != -1 else len(text)]
    tail = text[end + len(DS_CALLS_END) :] if end != -1 else ""

    def parse(match: re.Match) -> list[dict]:
        kind, body = match.group(1).strip(), match.group(2)
        fenced = _FENCE.match(body)
        if kind == "function" and fenced:  # V3 / R1: function<sep>NAME\n```json ... ```
            return [_call(fenced.group(1).strip(), json.loads(fenced.group(2)))]
        if kind and kind != "function":  # V3.1: NAME<sep>{...}
            return [_call(kind, json.loads(body))]
        raise ValueError(
            "a DeepSeek tool call that is neither function<sep>NAME + a json fence nor NAME<sep>{...}"
        )

    parsed = _blocks(section, _DS_CALL, parse)
    errors = list(parsed.errors)
    if parsed.content and not errors:  # text in the section outside any call
        message = "text inside the tool-calls section that is not a call"
        errors.append(ToolCallError(raw=parsed.content, message=message))
    # nothing the model wrote is lost: what did not parse stays in the content
    kept = f"{text[:start]} {parsed.content} {tail}" if errors else f"{text[:start]}{tail}"
    return ParsedToolCalls(content=kept.strip(), tool_calls=parsed.tool_calls, errors=errors)


def _harmony(text: str, _tools: list[dict]) -> ParsedToolCalls:
    from .harmony import split_harmony

    split = split_harmony(text)
    return ParsedToolCalls(content=split.content, tool_calls=split.tool_calls, errors=split.errors)


_PARSERS = {
    "hermes": _hermes,
    "qwen3_coder": _qwen3_coder,
    "llama3_json": _llama3_json,
    "mistral": _mistral,
    "deepseek_v3": _deepseek_v3,
    "harmony": _harmony,
}

# What a chat template's text says about its tool-call format, most specific first.
_TEMPLATE_MARKERS = (
    ("<|channel|>", "harmony"),
    (DS_CALL_BEGIN, "deepseek_v3"),
    (MISTRAL_CALLS, "mistral"),
    ("<function=", "qwen3_coder"),
    (TOOL_CALL_OPEN, "hermes"),
    (PYTHON_TAG, "llama3_json"),
    ('"parameters": ', "llama3_json"),
)


def detect_tool_format(template_source: str) -> str | None:
    """The tool-call format a chat template's text teaches (``TOOL_FORMATS``), or None when
    it names none (a template without tool support)."""
    for marker, fmt in _TEMPLATE_MARKERS:
        if marker in template_source:
            return fmt
    return None


def arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Messages whose assistant tool-call ``arguments`` JSON strings are decoded to objects.

    OpenAI clients send arguments as a JSON string, while chat templates (Qwen2.5's among
    them) write ``arguments | tojson``, which would encode the string a second time; SGLang and
    vLLM decode them before rendering, and so do we, so the prompt shows the model the call as
    it generated it. Arguments that are not valid JSON are left as they are.
    """
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message = {**message, "tool_calls": [_decode_arguments(c) for c in calls]}
        out.append(message)
    return out


def _decode_arguments(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**call["function"], "arguments": decoded}}
