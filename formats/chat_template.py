"""ChatTemplate: a model's chat template and tokenizer, without importing transformers.

Training needs the exact prompt ids the policy saw, and they must equal what
``AutoTokenizer.apply_chat_template(..., tokenize=True)`` gives the trainer. Importing
transformers costs a consumer ~2.5 s and ~250 MB (it pulls torch), so this module rebuilds
the same pipeline from its parts: the ``tokenizers`` library for ``tokenizer.json`` and a
jinja2 environment configured exactly as transformers 5 configures it
(``transformers/utils/chat_template_utils.py``): sandboxed and immutable, ``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``, ``strftime_now``, a
``tojson`` that does not escape HTML, and the special tokens (``bos_token``, ``eos_token``…)
as template variables. Messages are normalized the same way too (objects to dicts, keys whose
value is None dropped). Tests pin the ids against transformers itself.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import re
import threading
from array import array
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from .errors import ToolsNotRendered
from .reasoning import detect_reasoning_format
from .tool_fallback import with_tools_in_text
from .toolcalls import detect_tool_format

# The prompt-ids cache (ChatTemplate.encode): at most this many prompts of at most this size.
CACHE_ENTRIES = 1024
CACHE_MAX_CHARS = 16 * 1024
# The segment cache (SegmentEncoder): the text between two added tokens (a template's fixed
# parts: "system\nYou are...", "assistant\n"; a multi-turn rollout's earlier messages) -> ids,
# packed; at most this many pieces of at most SEGMENT_MAX_CHARS, SEGMENT_BUDGET_CHARS in all.
SEGMENT_ENTRIES = 4096
SEGMENT_MAX_CHARS = 16 * 1024
SEGMENT_BUDGET_CHARS = 2 * 1024 * 1024

# An assistant reply no template alters (no spaces to trim), to find what follows a reply.
_PROBE = "agentarium-reply-probe"

# The named special tokens transformers puts in ``special_tokens_map`` (and so in the template).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# What a template is rendered with to learn whether it reads ``tools`` at all.
_PROBE_CHAT = [{"role": "user", "content": "probe"}]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "agentarium_probe_tool",
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]

# Older names for a message's reasoning; transformers fills ``reasoning_content`` (and
# ``thinking``, read by gpt-oss templates) from whichever is present.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes <, > and & for HTML, which would change the prompt text.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    # As transformers: refuse dunder-ish attribute names, a sandbox escape route.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


class _TemplateDict:
    # Exposes dict() without giving templates the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    # transformers parses ``{% generation %}…{% endgeneration %}`` (assistant masks); we only
    # need the text, so the block renders its body unchanged.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in an environment configured as transformers configures it."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    template = env.from_string(source)
    # jinja keeps a template's globals as a ChainMap over the environment's and merges it into
    # every render's context; flattened once, a render of a short chat costs ~40% less.
    template.globals = dict(template.globals)
    return template


def plain_data(value: Any) -> Any:
    """A deep copy made of plain JSON types: dataclasses and pydantic models (the OpenAI SDK's
    message objects) become dicts, so templates never see rich objects."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return value
    if kind is dict:  # the usual message: no ABC checks
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if kind is list:
        return [plain_data(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return plain_data(value.item())  # numpy scalars, e.g. np.bool_(False) must stay falsy
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict]:
    """Messages as transformers feeds them to a template: plain dicts, keys set to None dropped
    (the OpenAI SDK sends ``content=None`` beside tool calls, which templates would print)."""
    out = []
    for message in plain_data(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts (or message objects), got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as serialized AddedTokens.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _load_templates(model_dir: Path, config: dict) -> dict[str, str]:
    # Same precedence as transformers: chat_template.jinja (+ additional_chat_templates/*.jinja)
    # win over tokenizer_config.json's chat_template (a string or a list of {name, template}).
    templates: dict[str, str] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {item["name"]: item["template"] for item in raw}
    return {}


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """A model directory's ``tokenizer.json``, with the tokens ``tokenizer_config.json`` adds,
    as transformers loads it."""
    model_dir = Path(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"{tokenizer_file} not found: the model directory needs a fast-tokenizer "
            "tokenizer.json (save the tokenizer with transformers to create one)"
        )
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    config = _read_json(model_dir / "tokenizer_config.json")
    # Tokens declared only in tokenizer_config.json are added by transformers at load time.
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if tokenizer.token_to_id(entry["content"]) is None:
            token = AddedToken(
                entry["content"],
                single_word=entry.get("single_word", False),
                lstrip=entry.get("lstrip", False),
                rstrip=entry.get("rstrip", False),
                normalized=entry.get("normalized", not entry.get("special", False)),
                special=entry.get("special", False),
            )
            tokenizer.add_tokens([token])
    return tokenizer


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """sha256 of the vocabulary, every (token, id) pair, added and special tokens included.

    Two models may exchange token ids (cross-sampling sends the policy's prompt ids to another
    model) exactly when each id stands for the same token in both: equal fingerprints. Two
    sizes of one model family share it; two families do not.
    """
    vocab = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    blob = json.dumps(vocab, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


class SegmentEncoder:
    """``tokenizer.encode(text, add_special_tokens=False).ids``, cut at the added tokens.

    The ``tokenizers`` library splits a text at its added tokens first (leftmost-longest) and
    then normalizes, pre-tokenizes and encodes each piece between them on its own; so the ids of
    a rendered prompt are the concatenation of its pieces' ids, and a chat template's fixed
    pieces (the system prompt, ``assistant\n``...) need encoding once: only the new message
    is encoded per prompt (half the tokenizer's time for a short one, a one-line rollout's).

    Only where that holds exactly: every added token matched as written (not normalized, no
    ``lstrip``/``rstrip``/``single_word``), special tokens split (``encode_special_tokens``
    off), no truncation or padding, and no normalizer or pre-tokenizer that treats the first
    piece of a text apart (``Prepend``, ``Metaspace``). Otherwise, or if a probe text made of
    every added token disagrees with the tokenizer, or the tokenizer gained tokens since,
    ``encode`` is the tokenizer's own.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._segments: dict[str, array] = {}
        self._chars = 0  # in the cached pieces
        self._remembering = threading.Lock()
        self._ids: dict[str, int] = {}
        self._split: re.Pattern[str] | None = None
        added = tokenizer.get_added_tokens_decoder()
        if not self._eligible(tokenizer, added.values()):
            return
        self._ids = {token.content: index for index, token in added.items()}
        if not self._ids:
            self._split = re.compile("(?!)")  # nothing to cut at: one piece
        else:  # longest first: at one position, the longest token that matches wins
            alternatives = sorted(self._ids, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        probe = " a\n\n b  ".join([*self._ids, "x é\t", *reversed(list(self._ids))])
        if self.encode(probe) != tokenizer.encode(probe, add_special_tokens=False).ids:
            self._split = None

    @staticmethod
    def _eligible(tokenizer: Tokenizer, added: Any) -> bool:
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            return False
        if getattr(tokenizer, "encode_special_tokens", True):
            return False
        for token in added:
            if (
                not token.content
                or token.normalized
                or token.lstrip
                or token.rstrip
                or token.single_word
            ):
                return False
        pipeline = json.loads(tokenizer.to_str())
        pieces = json.dumps([pipeline.get("normalizer"), pipeline.get("pre_tokenizer")])
        return "Prepend" not in pieces and "Metaspace" not in pieces

    @property
    def active(self) -> bool:
        return self._split is not None

    def encode(self, text: str) -> list[int]:
        split = self._split
        if split is None or self.tokenizer.get_vocab_size(with_added_tokens=True) != self._size:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        segments = self._segments
        for index, piece in enumerate(split.split(text)):
            if index & 1:  # an added token (re.split puts the separators at odd places)
                ids.append(self._ids[piece])
            elif piece:
                cached = segments.get(piece)
                if cached is not None:
                    ids.extend(cached)
                    continue
                piece_ids = self.tokenizer.encode(piece, add_special_tokens=False).ids
                ids.extend(piece_ids)
                if len(piece) <= SEGMENT_MAX_CHARS:
                    self._remember(piece, piece_ids)
        return ids

    def _remember(self, piece: str, piece_ids: list[int]) -> None:
        # Only on a miss; sync agents' threads share a template, so the count of cached
        # characters is kept under a lock (a piece two threads missed at once counts once).
        with self._remembering:
            segments = self._segments
            if piece in segments:
                return
            segments[piece] = array("i", piece_ids)
            self._chars += len(piece)
            while len(segments) > SEGMENT_ENTRIES or self._chars > SEGMENT_BUDGET_CHARS:
                oldest = next(iter(segments))  # the oldest out
                del segments[oldest]
                self._chars -= len(oldest)


class ChatTemplate:
    """A model's chat template plus its tokenizer: messages in, prompt token ids out."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: Mapping[str, str],
        *,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        name: str = "",
        tool_fallback: bool = False,
    ) -> None:
        if not templates:
            raise ValueError(
                f"{name or 'model'} has no chat template: add chat_template.jinja or a "
                "chat_template entry to tokenizer_config.json"
            )
        self.tokenizer = tokenizer
        self.name = name
        # tools written into the conversation when the template renders none
        # (formats/tool_fallback.py); off: such a call is refused (ToolsNotRendered)
        self.tool_fallback = tool_fallback
        self.special_tokens = dict(special_tokens or {})
        self._sources = dict(templates)
        self._compiled = {key: compile_template(src) for key, src in templates.items()}
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        # Prompt text -> ids: the G samples of a GRPO group render the same first prompt.
        # Keyed by the exact text, so a hit is exactly what the tokenizer would return; ids
        # are kept packed, and only for prompts up to CACHE_MAX_CHARS.
        self._ids: collections.OrderedDict[str, array] = collections.OrderedDict()
        # A miss encodes only the pieces between added tokens not seen before.
        self._segments = SegmentEncoder(tokenizer)
        self._renders_tools: dict[str, bool] = {}  # template key -> reads `tools`
        self._closes: dict[str, str | None] = {}  # template name -> turn_close

    @classmethod
    def from_model_dir(cls, path: str | Path, *, tool_fallback: bool = False) -> ChatTemplate:
        """Load ``tokenizer.json``, the chat template and special tokens from a model directory
        (``tool_fallback``: see ``formats/tool_fallback.py``)."""
        model_dir = Path(path)
        tokenizer = load_tokenizer(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        legacy = _read_json(model_dir / "special_tokens_map.json")
        special: dict[str, str] = {}
        for key in SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(key, legacy.get(key)))
            if content is not None:
                special[key] = content
        eos_ids: list[int] = []
        eos_id = tokenizer.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        # Qwen-style models end turns on <|im_end|> but list <|endoftext|> as well in
        # generation_config.json: generation must stop on either.
        for source in ("generation_config.json", "config.json"):
            value = _read_json(model_dir / source).get("eos_token_id")
            eos_ids.extend([value] if isinstance(value, int) else list(value or []))
        return cls(
            tokenizer,
            _load_templates(model_dir, config),
            special_tokens=special,
            eos_token_ids=eos_ids,
            name=str(model_dir),
            tool_fallback=tool_fallback,
        )

    @functools.cached_property
    def fingerprint(self) -> str:
        """The tokenizer's fingerprint (``tokenizer_fingerprint``)."""
        return tokenizer_fingerprint(self.tokenizer)

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a generation: the tokenizer's eos plus generation_config's."""
        return list(self._eos_token_ids)

    @functools.cached_property
    def reply_formats(self) -> tuple[str, str]:
        """(tool-call format, reasoning format) its model writes, read from the template's
        text (its tool-use variant where it has one: formats/toolcalls.py, reasoning.py);
        a template that names no tool format gets ``hermes``, the one parsed before."""
        source = self.template_source(tools=())
        return detect_tool_format(source) or "hermes", detect_reasoning_format(source)

    def template_source(self, tools: Sequence[Any] | None = None) -> str:
        """The template text ``render`` uses (``tool_use`` when tools are given and one exists)."""
        return self._sources[self._pick(tools)]

    def _pick(self, tools: Sequence[Any] | None) -> str:
        if tools is not None and "tool_use" in self._compiled:
            return "tool_use"
        if "default" in self._compiled:
            return "default"
        if len(self._compiled) == 1:
            return next(iter(self._compiled))
        raise ValueError(
            f"{self.name or 'model'} has several chat templates ({sorted(self._compiled)}) "
            "and none named 'default'"
        )

    def render(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text, as ``apply_chat_template(..., tokenize=False)`` renders it."""
        if not messages:
            raise ValueError("cannot render an empty conversation: give at least one message")
        tool_schemas = None if tools is None else plain_data(list(tools))
        variables = plain_data(template_kwargs)
        return self._render(
            normalize_messages(messages), tool_schemas, add_generation_prompt, variables
        )

    def _render(
        self,
        chat: list[dict],
        tools: list | None,
        add_generation_prompt: bool,
        variables: dict[str, Any],
    ) -> str:
        if not chat:
            raise ValueError("cannot render an empty conversation: give at least one message")
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, dict):
                    raise TypeError(
                        "tools must be JSON schemas (dicts like {'type': 'function', "
                        f"'function': {{...}}}}), got {tool!r}"
                    )
        key = self._pick(tools)
        if tools and self.tool_fallback and not self.renders_tools(key):
            chat, tools = with_tools_in_text(chat, tools), None
        if tools and not self.renders_tools(key):
            raise ToolsNotRendered(
                f"the chat template of {self.name or 'this model'} does not render tools (its "
                f"prompt is the same with and without them), so the model would never see the "
                f"{len(tools)} tool(s) offered: use a model whose template reads `tools` (the "
                "built-in tiny, Qwen2.5, Llama 3.1...), turn on the tool fallback (the "
                "consumer's --tool-fallback: the tools written into the system message), or "
                "describe the tools in a message yourself and call without tools"
            )
        return self._compiled[key].render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **variables},
        )

    def renders_tools(self, key: str | None = None) -> bool:
        """Whether the template (``key``: the one picked for tools by default) reads ``tools``:
        a probe conversation renders differently with a tool than without. A probe the
        template refuses counts as reading them (the real call's render then speaks)."""
        key = key or self._pick(_PROBE_TOOLS)
        known = self._renders_tools.get(key)
        if known is None:
            template = self._compiled[key]
            try:
                renders = [
                    template.render(
                        messages=_PROBE_CHAT,
                        tools=tools,
                        documents=None,
                        add_generation_prompt=True,
                        **self.special_tokens,
                    )
                    for tools in (_PROBE_TOOLS, None)
                ]
                known = renders[0] != renders[1]
            except Exception:  # any refusal: undecided, so not refused here
                known = True
            self._renders_tools[key] = known
        return known

    def render_normalized(
        self,
        chat: list[dict],
        tools: list | None = None,
        *,
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """``render`` for messages already through ``normalize_messages`` and tools already
        plain data (what the tracing client holds): the same text, without copying them again.
        ``variables``: template variables beyond the messages (``enable_thinking``)."""
        return self._render(chat, tools, add_generation_prompt, dict(variables or {}))

    @functools.cached_property
    def thinking_switch(self) -> bool:
        """Whether the template turns its model's reasoning on and off (Qwen3's
        ``enable_thinking``): the generation prompt differs between the two."""
        probe = [{"role": "user", "content": "x"}]
        try:
            on = self._render(probe, None, True, {"enable_thinking": True})
            off = self._render(probe, None, True, {"enable_thinking": False})
        except Exception:  # noqa: BLE001 - a template that refuses the probe has no switch here
            return False
        return on != off

    def encode_normalized(self, chat: list[dict], tools: list | None = None) -> list[int]:
        """``encode_chat`` for normalized messages and plain tools (``render_normalized``)."""
        return self.encode(self.render_normalized(chat, tools))

    def turn_close(self, tools: list | None = None) -> str | None:
        """What the template writes after an assistant message's content (ChatML's
        ``<|im_end|>\n``), read off a probe conversation once per template; None when the
        probe does not render or its reply cannot be found in the text."""
        name = self._pick(tools)
        if name not in self._closes:
            probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
            try:
                text = self._render(probe, tools, False, {})
            except Exception:  # the template refuses the probe (e.g. wants a system turn)
                text = ""
            at = text.rfind(_PROBE)
            self._closes[name] = None if at < 0 else text[at + len(_PROBE) :]
        return self._closes[name]

    def encode_chat(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt token ids, identical to ``apply_chat_template(..., tokenize=True)``."""
        return self.encode(self.render(messages, tools, add_generation_prompt, **template_kwargs))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added (the template writes its own)."""
        cached = self._ids.get(text)
        if cached is not None:
            with contextlib.suppress(KeyError):  # another thread evicted it meanwhile
                self._ids.move_to_end(text)
            return cached.tolist()
        ids = self._segments.encode(text)
        if len(text) <= CACHE_MAX_CHARS:
            self._ids[text] = array("i", ids)
            while len(self._ids) > CACHE_ENTRIES:
                with contextlib.suppress(KeyError):
                    self._ids.popitem(last=False)
        return ids

    def encode_piece(self, text: str) -> list[int]:
        """Token ids of a piece of a prompt (a turn's end and the next messages), outside the
        prompt cache, which keeps whole prompts."""
        return self._segments.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r}, templates={sorted(self._compiled)}, eos={self.eos_token_ids})"
