"""GroupDemand and GroupSupply: a trainer asking the run's producers for more groups.

Dynamic sampling (the trainer's ``--dynamic-sampling``) drops groups that teach nothing (every
reward equal) and asks for replacements: a NATS request ``GroupDemand`` on
``<p>.demand.<run>.<agent>``, answered by one producer of the run (a queue group) with the
``GroupSupply`` it published. JSON both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SchemaError
from .fields import INT, NAME, STR, WireMessage, spec


@dataclass(frozen=True, kw_only=True)
class GroupDemand(WireMessage):
    WIRE_DOC = (
        "A trainer asking the run's producers for more groups of one agent (request on "
        "<p>.demand.<run>.<agent>)."
    )

    demand_id: str = spec(STR, doc="unique per request: the trainer's run, step and a counter")
    run: str = spec(NAME, doc="run id")
    agent: str = spec(NAME, doc="the agent whose groups are wanted")
    groups: int = spec(INT, doc="groups wanted (tasks, each expanded to group_size jobs)")
    step: int = spec(INT, 0, doc="the trainer step that asks (the one being filled)")
    reason: str = spec(STR, "flat", doc="why: the groups it dropped (flat, small, stale)")

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise SchemaError("groupdemand.groups must be >= 1", field="groupdemand.groups")


@dataclass(frozen=True, kw_only=True)
class GroupSupply(WireMessage):
    WIRE_DOC = "A producer's answer to a GroupDemand: the groups it published for it."

    demand_id: str = spec(STR, doc="the GroupDemand answered")
    groups: int = spec(INT, doc="groups published (0: the producer has no task left)")
    jobs: int = spec(INT, 0, doc="jobs published (groups x group_size, less duplicates)")
    batch_id: str = spec(STR, "", doc="the batch the groups were published as")
