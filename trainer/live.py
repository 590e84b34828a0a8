"""Live metrics: each step's metrics row, as JSON, on ``<prefix>.metrics.<run>``.

The CSV stays on the trainer's disk; this copy of the row reaches whatever watches the run
from anywhere (``agentarium dashboard``) through the ``<P>_METRICS`` stream, which keeps a
bounded history (max age and bytes in ``broker.Limits``). The row is the CSV's row (same
names, same order, ``staleness_hist`` as ``"0:96 1:24"``) plus ``run`` and ``agent``; a
non-finite float becomes null, which JSON can carry.

It is a view, not a record: a row that cannot be stored is logged and dropped, and training
goes on (the next row carries the running totals again).
"""

from __future__ import annotations

import json
import math

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext

from agentarium.broker import Topology
from agentarium.schemas import JSON

from .metrics import StepMetrics

log = structlog.get_logger("agentarium.trainer")

PUBLISH_TIMEOUT_S = 1.0  # a broker in trouble costs a step at most this


def live_row(m: StepMetrics, *, run: str, agent: str) -> dict[str, object]:
    row: dict[str, object] = {"run": run, "agent": agent}
    for key, value in m.as_row().items():
        # no value (an empty CSV cell, a NaN) is null on the wire
        unknown = value == "" or (isinstance(value, float) and not math.isfinite(value))
        row[key] = None if unknown else value
    return row


class LiveMetrics:
    """Publishes each step's row; ``published`` and ``dropped`` count what happened."""

    def __init__(self, js: JetStreamContext, topology: Topology, *, run: str, agent: str) -> None:
        self.js = js
        self.subject = topology.metrics_subject(run)
        self.run = run
        self.agent = agent
        self.published = 0
        self.dropped = 0

    def __repr__(self) -> str:
        return (
            f"<LiveMetrics subject={self.subject} published={self.published} "
            f"dropped={self.dropped}>"
        )

    async def publish(self, m: StepMetrics) -> bool:
        payload = json.dumps(live_row(m, run=self.run, agent=self.agent)).encode()
        try:
            await self.js.publish(
                self.subject,
                payload,
                timeout=PUBLISH_TIMEOUT_S,
                headers=JSON.headers(),
            )
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            self.dropped += 1
            log.warning(
                "live metrics row not stored; training goes on (run `agentarium broker init` "
                "if the metrics stream is missing)",
                subject=self.subject,
                step=m.step,
                error=str(exc) or type(exc).__name__,
                dropped=self.dropped,
            )
            return False
        self.published += 1
        return True
