"""Model formats: what a model's text looks like, for everything that renders a prompt or parses
a reply (the tracing client and gateway, the local engine, the trainer's tokenizer checks).

- ``chat_template.py``: a model's chat template and tokenizer, without transformers (tokenizer
  loading, fingerprints, prompt rendering and token segments);
- ``toolcalls.py``: tool calls parsed from generated text (Hermes/Qwen ``<tool_call>`` blocks).

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
from .toolcalls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedToolCalls,
    ToolCallError,
    arguments_as_objects,
    new_call_id,
    parse_tool_calls,
)

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ChatTemplate",
    "ParsedToolCalls",
    "SegmentEncoder",
    "ToolCallError",
    "ToolsNotRendered",
    "arguments_as_objects",
    "compile_template",
    "load_tokenizer",
    "new_call_id",
    "normalize_messages",
    "parse_tool_calls",
    "plain_data",
    "tokenizer_fingerprint",
]
