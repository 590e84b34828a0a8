"""Which agent a task row goes to: the one rule ``AgentOrchestrator`` and ``agentarium produce``
share.

A row's ``agent_name`` names its agent. Otherwise its source column (verl's ``data_source``)
does, when that value is an agent the caller knows (the orchestrator: a registered agent;
``produce``: any valid agent name). Otherwise the row goes to the default agent, if there is
one. verl datasets name datasets in ``data_source`` (``openai/gsm8k``), so a source that names
no agent is not an error while a default exists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

AGENT_COLUMN = "agent_name"
SOURCE_COLUMN = "data_source"


def agent_of(
    row: Mapping[str, Any],
    *,
    known: Callable[[str], bool],
    default: str | None,
    source: str = SOURCE_COLUMN,
) -> tuple[str | None, str]:
    """``(agent, problem)``; ``problem`` is ``""`` when the row has an agent, else
    ``unknown:<name>`` (its ``agent_name`` is not known), ``source:<value>`` (its source names
    no agent and there is no default) or ``missing`` (nothing names one, no default). Callers
    word the problems in their own terms: a flag to pass, or an argument."""
    name = row.get(AGENT_COLUMN)
    if name not in (None, ""):
        name = str(name)
        return (name, "") if known(name) else (None, f"unknown:{name}")
    value = row.get(source)
    if value not in (None, "") and known(str(value)):
        return str(value), ""
    if default is not None:
        return default, ""
    return None, "missing" if value in (None, "") else f"source:{value}"
