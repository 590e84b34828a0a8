"""Model formats: what a model's text looks like, for everything that renders a prompt or parses
a reply (the tracing client and gateway, the local engine, the trainer's tokenizer checks).

- ``chat_template.py``: a model's chat template and tokenizer, without transformers (tokenizer
  loading, fingerprints, prompt rendering and token segments);
- ``toolcalls.py``: tool calls parsed from generated text, per family (``TOOL_FORMATS``: Hermes,
  Qwen3-Coder, Llama 3 JSON, Mistral, DeepSeek-V3, gpt-oss harmony);
- ``reasoning.py``: reasoning split off (``<think>`` blocks; ``harmony.py``: gpt-oss's channels);
- ``reply.py``: a reply split into reasoning, content and tool calls by the model's formats;
  ``reply_stream.py``: the same while it is generated (the deltas that are already sure);
- ``incremental.py``: a reply's text while it is generated (decoded a window at a time, the
  tail a stop string may still cut held back);
- ``families.py``: chat templates of the families (Qwen3, Qwen3-Coder, Llama 3, Mistral,
  DeepSeek-V3, gpt-oss), written here in each family's format.

Pure knowledge: nothing here imports a service, NATS or another component.
"""

from .chat_template import (
    ChatTemplate,
    SegmentEncoder,
    compile_template,
    load_tokenizer,
    normalize_messages,
    plain_data,
    tokenizer_fingerprint,
)
from .errors import ToolsNotRendered
from .families import FAMILIES, Family
from .harmony import HarmonyReply, split_harmony
from .incremental import HeldText, IncrementalDecode, partial_suffix
from .reasoning import (
    REASONING_FORMATS,
    THINK_CLOSE,
    THINK_OPEN,
    Reasoned,
    detect_reasoning_format,
    split_reasoning,
)
from .reply import ParsedReply, parse_reply
from .reply_stream import ReplyStream, TextDelta
from .toolcalls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_FORMATS,
    ParsedToolCalls,
    ToolCallError,
    arguments_as_objects,
    detect_tool_format,
    new_call_id,
    parse_tool_calls,
)

__all__ = [
    "FAMILIES",
    "REASONING_FORMATS",
    "THINK_CLOSE",
    "THINK_OPEN",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_FORMATS",
    "ChatTemplate",
    "Family",
    "HarmonyReply",
    "HeldText",
    "IncrementalDecode",
    "ParsedReply",
    "ParsedToolCalls",
    "Reasoned",
    "ReplyStream",
    "SegmentEncoder",
    "TextDelta",
    "ToolCallError",
    "ToolsNotRendered",
    "arguments_as_objects",
    "compile_template",
    "detect_reasoning_format",
    "detect_tool_format",
    "load_tokenizer",
    "new_call_id",
    "normalize_messages",
    "parse_reply",
    "partial_suffix",
    "parse_tool_calls",
    "plain_data",
    "split_harmony",
    "split_reasoning",
    "tokenizer_fingerprint",
]
