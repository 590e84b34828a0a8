"""Which agent a task row goes to: the one rule ``AgentOrchestrator`` and ``agentarium produce``
share.

A row's ``agent_name`` names its agent. Otherwise its source column (verl's ``data_source``)
does, when that value is an agent the caller knows (the orchestrator: a registered agent;
``produce``: any valid agent name). Otherwise the row goes to the default agent, if there is
one. verl datasets name datasets in ``data_source`` (``openai/gsm8k``), so a source that names
no agent is not an error while a default exists.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

AGENT_COLUMN = "agent_name"
SOURCE_COLUMN = "data_source"


class Unrouted(enum.Enum):
    """Why a row has no agent."""

    UNKNOWN_AGENT = "unknown"  # its agent_name is not an agent the caller knows
    SOURCE_NOT_AGENT = "source"  # its source names no agent, and there is no default
    NOTHING_NAMES_ONE = "missing"  # no agent_name, no source value, no default


@dataclass(frozen=True)
class RoutingProblem:
    """A row ``agent_of`` could not route: why, and the value that failed (the row's
    ``agent_name`` or source value; empty when nothing names an agent). Callers word it in
    their own terms: a flag to pass, or an argument."""

    kind: Unrouted
    value: str = ""


def agent_of(
    row: Mapping[str, Any],
    *,
    known: Callable[[str], bool],
    default: str | None,
    source: str = SOURCE_COLUMN,
) -> tuple[str | None, RoutingProblem | None]:
    """``(agent, None)`` when the row has an agent, else ``(None, problem)``."""
    name = row.get(AGENT_COLUMN)
    if name not in (None, ""):
        name = str(name)
        return (name, None) if known(name) else (None, RoutingProblem(Unrouted.UNKNOWN_AGENT, name))
    value = row.get(source)
    if value not in (None, "") and known(str(value)):
        return str(value), None
    if default is not None:
        return default, None
    if value in (None, ""):
        return None, RoutingProblem(Unrouted.NOTHING_NAMES_ONE)
    return None, RoutingProblem(Unrouted.SOURCE_NOT_AGENT, str(value))
