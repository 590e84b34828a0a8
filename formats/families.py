"""Chat templates of the model families agentic-RL users train, written here in each family's
format (from the formats' documented shapes, not copied from the models' files), with the
formats their models write (formats/toolcalls.py, reasoning.py, harmony.py).

Each is what a random-weight model of the family carries (its ``chat_template.jinja``) and
what the tracing client reads the formats from (``ChatTemplate.reply_formats``). Messages are
OpenAI-style: an assistant turn may hold ``reasoning_content``, ``content`` and ``tool_calls``
(arguments as objects: the tracing client decodes the JSON strings before rendering), a tool
result is a ``tool`` message. Every template renders every turn's reasoning (so a rendered
conversation parses back whole), where some families' own templates drop the reasoning of
turns before the last user message.

``FAMILIES``: name -> ``Family`` (its template, its formats, and the markers that open and
close an assistant turn in its rendering).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    tool_format: str
    reasoning_format: str
    assistant_open: tuple[str, ...]  # what starts an assistant turn's text in a rendering
    # what ends it: the tokens its model stops on (gpt-oss: <|call|>, <|return|>; a turn is
    # several messages, and a finished one renders with <|end|> in the history)
    turn_close: tuple[str, ...]


# Tools described to the model in the system prompt, as JSON lines (Qwen's and Hermes's way).
_TOOLS_JSON = """{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"""

# ChatML tool results (Qwen's): consecutive results in one user turn, each in <tool_response>
# tags; then the generation prompt's start
_CHATML_TOOL_RESULTS = """{% elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
{{ '\\n' }}<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
"""

QWEN3 = (
    """{%- set sys = messages[0].content if messages[0].role == 'system' else '' -%}
{%- if tools -%}
<|im_start|>system
{% if sys %}{{ sys }}

{% endif %}# Tools

You may call one or more functions. Their signatures, within <tools></tools> tags:
<tools>"""
    + _TOOLS_JSON
    + """{{ '\\n' }}</tools>

For each call, write a JSON object with the function's name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif sys -%}
<|im_start|>system
{{ sys }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.reasoning_content is defined and m.reasoning_content is not none %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- if m.content or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
"""
    + _CHATML_TOOL_RESULTS
    + """{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
)

# Qwen3's own habit: the reasoning of turns before the latest user message is not rendered (the
# tool-call loop of the current question keeps it). The tracing client keeps such a rollout one
# row all the same (consumers/tracing/prompt_chain.py, ``reasoning_kept``).
_KEEPS_REASONING = "{% if m.reasoning_content is defined and m.reasoning_content is not none %}"
QWEN3_LATEST_REASONING = (
    "{%- set ns = namespace(last_query=-1) -%}{%- for m in messages -%}"
    "{%- if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif -%}{%- endfor -%}"
    + QWEN3.replace(
        _KEEPS_REASONING,
        "{% if loop.index0 > ns.last_query and m.reasoning_content is defined "
        "and m.reasoning_content is not none %}",
    )
)

QWEN3_CODER = (
    """{%- set sys = messages[0].content if messages[0].role == 'system' else '' -%}
<|im_start|>system
{{ sys or 'You are a helpful coding assistant.' }}
{%- if tools %}{{ '\\n\\n' }}# Tools

You have access to these functions:

<tools>
{% for tool in tools %}<function>
<name>{{ tool.function.name }}</name>
<description>{{ tool.function.description or '' }}</description>
<parameters>{{ tool.function.parameters | tojson }}</parameters>
</function>{{ '\\n' }}{% endfor %}</tools>

To call a function, write:
<tool_call>
<function=example_function>
<parameter=example_parameter>
value
</parameter>
</function>
</tool_call>
{%- endif %}<|im_end|>
{% for m in messages -%}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- if m.content or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>
<function={{ call.function.name }}>
{% for key, value in call.function.arguments.items() %}<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>{{ '\\n' }}{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
"""
    + _CHATML_TOOL_RESULTS
    + """{% endif %}"""
)

LLAMA3 = (
    """<|begin_of_text|>
{%- set sys = messages[0].content if messages[0].role == 'system' else '' -%}
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}{{ sys }}<|eot_id|>
{%- set ns = namespace(shown=false) -%}
{%- for m in messages -%}
{%- if m.role == 'user' and tools and not ns.shown -%}
{%- set ns.shown = true -%}
<|start_header_id|>user<|end_header_id|>

Answer with a function call when one helps. To call one, reply with a JSON object {"name": function name, "parameters": an object of argument names and values}, and nothing else. The functions:
"""
    + _TOOLS_JSON
    + """{{ '\\n\\n' + m.content }}<|eot_id|>
{%- elif m.role == 'user' or (m.role == 'system' and not loop.first) -%}
<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- elif m.role == 'assistant' -%}
<|start_header_id|>assistant<|end_header_id|>

{% if m.tool_calls %}<|python_tag|>
{%- for call in m.tool_calls -%}
{{ '; ' if not loop.first }}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}
{%- endfor %}<|eom_id|>
{%- else %}{{ m.content or '' }}<|eot_id|>
{%- endif %}
{%- elif m.role == 'tool' -%}
<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
)

MISTRAL = """<s>
{%- set sys = messages[0].content if messages[0].role == 'system' else '' -%}
{%- if sys %}[SYSTEM_PROMPT]{{ sys }}[/SYSTEM_PROMPT]{% endif -%}
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' -%}
{{ m.content or '' }}
{%- for call in m.tool_calls or [] -%}
[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}
{%- endfor %}</s>
{%- elif m.role == 'tool' -%}
[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- endif -%}
{%- endfor -%}"""

DEEPSEEK_V3 = """<｜begin▁of▁sentence｜>
{%- set sys = messages[0].content if messages[0].role == 'system' else '' -%}
{{ sys }}
{%- if tools %}{{ '\\n\\n' }}## Tools
You may call these functions:
{% for tool in tools %}
### {{ tool.function.name }}
{{ tool.function.parameters | tojson }}
{% endfor %}
To call them, write <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME, a ```json block of the arguments, <｜tool▁call▁end｜> for each call, then <｜tool▁calls▁end｜>.
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' -%}
<｜Assistant｜>
{%- if m.reasoning_content is defined and m.reasoning_content is not none %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- if m.tool_calls %}<｜tool▁calls▁begin｜>
{%- for call in m.tool_calls -%}
<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ call.function.name }}
```json
{{ call.function.arguments | tojson }}
```<｜tool▁call▁end｜>
{%- endfor %}<｜tool▁calls▁end｜>
{%- endif %}<｜end▁of▁sentence｜>
{%- elif m.role == 'tool' -%}
<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<｜Assistant｜><think>
{% endif %}"""

GPT_OSS = """<|start|>system<|message|>You are a helpful assistant.
Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|>
{%- if messages[0].role == 'system' %}# Instructions

{{ messages[0].content }}

{% endif %}# Tools

## functions

namespace functions {
{% for tool in tools %}{{ '\\n// ' + (tool.function.description or '') + '\\ntype ' + tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;{{ '\\n' }}{% endfor %}{{ '\\n' }}} // namespace functions
{%- elif messages[0].role == 'system' %}<|end|><|start|>developer<|message|># Instructions

{{ messages[0].content }}
{%- endif %}<|end|>
{%- for m in messages -%}
{%- if m.role == 'user' -%}
<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' -%}
{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}
<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>
{%- endif -%}
{%- if m.content -%}
<|start|>assistant<|channel|>{{ 'commentary' if m.tool_calls else 'final' }}<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- for call in m.tool_calls or [] -%}
<|start|>assistant<|channel|>commentary to=functions.{{ call.function.name }} <|constrain|>json<|message|>{{ call.function.arguments | tojson }}<|call|>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
<|start|>functions.{{ m.name or 'tool' }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

FAMILIES = {
    family.name: family
    for family in (
        Family("qwen3", QWEN3, "hermes", "think", ("<|im_start|>assistant\n",), ("<|im_end|>",)),
        Family(
            "qwen3_coder",
            QWEN3_CODER,
            "qwen3_coder",
            "none",
            ("<|im_start|>assistant\n",),
            ("<|im_end|>",),
        ),
        Family(
            "llama3",
            LLAMA3,
            "llama3_json",
            "none",
            ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
            ("<|eot_id|>", "<|eom_id|>"),
        ),
        Family("mistral", MISTRAL, "mistral", "none", ("[/INST]", "[/TOOL_RESULTS]"), ("</s>",)),
        Family(
            "deepseek_v3",
            DEEPSEEK_V3,
            "deepseek_v3",
            "think",
            ("<｜Assistant｜>",),
            ("<｜end▁of▁sentence｜>",),
        ),
        Family(
            "gpt_oss",
            GPT_OSS,
            "harmony",
            "harmony",
            ("<|start|>assistant",),
            ("<|call|>", "<|return|>"),
        ),
    )
}
