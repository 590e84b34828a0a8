"""The tool the families' tests offer: ``get_weather`` (``WEATHER``, alone in ``TOOLS``), which
tests/test_families.py's conversations call in each family's chat template and
tests/test_family_rollouts.py's endpoint agents offer through each API."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city for some days.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]
