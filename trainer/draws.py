"""Dynamic sampling: the groups a step drops are replaced by groups asked from the producers.

DAPO's dynamic sampling keeps every step at its batch size: a group whose rewards are all
equal has zero advantage and teaches nothing, so it is dropped and another is drawn. Jobs come
from producers, not from the trainer, so the trainer *asks*: for every group the step's
selection drops (flat, too few trainable members once overlong responses are filtered, every
member too stale) it sends a ``GroupDemand`` request on ``<p>.demand.<run>.<agent>``; one
producer of the run (``producers.GroupRefill``, a queue group) publishes that many new groups
and answers with a ``GroupSupply``. The step goes on waiting for its B groups, which the
replacements complete.

The bound: a step asks for at most ``draw_limit`` x B replacement groups. A group dropped after
that trains the step with the groups it holds rather than waiting on a task that keeps producing
flat groups; what arrives later serves the next step. A step that holds no group at all by then
goes on asking, one group for each drop, since it has nothing to train (a random policy on a
hard task: every group flat until one is not). A request nobody
answers (no producer serves the run: no responders, or a timeout) is counted and warned
about, and the step waits for groups from wherever they come, as with ``--filter-flat-groups``.

``NoDraws`` is the do-nothing object of a trainer without dynamic sampling.
"""

from __future__ import annotations

import itertools

import nats.errors
import structlog

from agentarium.broker import Topology
from agentarium.schemas import JSON, GroupDemand, GroupSupply, SchemaError, decode

log = structlog.get_logger("agentarium.trainer")

REQUEST_TIMEOUT_S = 10.0  # a producer publishes the groups before it answers


class Draws:
    """Replacement groups asked per step; ``drawn`` is what producers supplied, per agent."""

    def __init__(
        self,
        nc,
        topology: Topology,
        run: str,
        *,
        limit: int,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        assert limit >= 1, "a step may draw at least one group"
        self.nc = nc
        self.topology = topology
        self.run = run
        self.limit = limit
        self.timeout_s = timeout_s
        self.step = 0
        self.asked = 0  # this step, answered or not
        self.spent = False  # this step dropped a group it could not replace
        self.drawn: dict[str, int] = {}  # this step, per agent: groups producers published
        self.total: dict[str, int] = {}  # since the start, per agent
        self.unanswered = 0  # requests no producer answered, since the start
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return (
            f"<Draws run={self.run} step={self.step} asked={self.asked}/{self.limit} "
            f"drawn={sum(self.drawn.values())} unanswered={self.unanswered}>"
        )

    def begin(self, step: int) -> None:
        """A new step starts filling: its counts start at 0."""
        self.step, self.asked, self.drawn, self.spent = step, 0, {}, False

    @property
    def exhausted(self) -> bool:
        """The step dropped a group past its bound: train what it holds."""
        return self.spent

    async def replace(
        self, agent: str, dropped: int, *, holding: int = 0, reason: str = "dropped"
    ) -> int:
        """Ask for ``dropped`` groups of ``agent`` (within the step's bound, unless the step
        is ``holding`` none); returns how many a producer published."""
        n = min(dropped, max(self.limit - self.asked, 0))
        if n < dropped:
            self.spent = True
            n = n if holding else dropped  # nothing to train yet: keep drawing
        if n <= 0:
            return 0
        self.asked += n
        demand = GroupDemand(
            demand_id=f"{self.run}-{self.step}-{next(self._ids)}",
            run=self.run,
            agent=agent,
            groups=n,
            step=self.step,
            reason=reason,
        )
        subject = self.topology.demand_subject(self.run, agent)
        try:
            reply = await self.nc.request(
                subject, JSON.encode(demand), timeout=self.timeout_s, headers=JSON.headers()
            )
            supply = decode(GroupSupply, reply.data, (reply.headers or {}).get("Content-Type"))
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, SchemaError) as exc:
            self.unanswered += 1
            if _power_of_ten(self.unanswered):
                log.warning(
                    "dynamic sampling: no producer answered a request for replacement groups; "
                    "run a producers.GroupRefill for the run (agentarium demo "
                    "--dynamic-sampling does)",
                    subject=subject,
                    groups=n,
                    error=type(exc).__name__,
                    unanswered=self.unanswered,
                )
            return 0
        self.drawn[agent] = self.drawn.get(agent, 0) + supply.groups
        self.total[agent] = self.total.get(agent, 0) + supply.groups
        log.debug("replacement groups drawn", agent=agent, asked=n, drawn=supply.groups)
        return supply.groups


class NoDraws:
    """No dynamic sampling: nothing is asked, and no step is cut short."""

    exhausted = False
    asked = 0
    unanswered = 0

    def __init__(self) -> None:
        self.drawn: dict[str, int] = {}
        self.total: dict[str, int] = {}

    def __repr__(self) -> str:
        return "<NoDraws>"

    def begin(self, step: int) -> None:
        pass

    async def replace(
        self, agent: str, dropped: int, *, holding: int = 0, reason: str = "dropped"
    ) -> int:
        return 0


def _power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1
