"""Several agents, one trainer: one Collector per agent, each step's batch composed by the mix.

A task is an agent name. The trainer holds one ``Collector`` (a durable consumer
``trainer-<run>-<agent>`` with its own ``max_ack_pending``, and its own group buffer: groups
never mix agents) per trained agent; ``TaskCollector.take`` gathers usable groups from all of
them and hands out one step's worth by the rule of ``--task-mix`` (trainer/mix.py: proportional,
balanced or weighted, and a bounded ``--task-wait`` for a task that is short). Acks go back to
the collector each group came from.

``--agent '*'`` (``discover_agents``) trains every agent of the run known when the trainer
starts: those whose trajectories the run already stores (read from the stream's per-subject
counts while the run holds at most 100,000 trajectories), those with a ``rollout-<agent>``
consumer on TASKS (a consumer ran for them, whatever the run), the agents of the checkpoint a
resumed trainer continues, and any named beside ``*``. An agent that appears later is trained
after a restart (``--resume`` keeps every other agent's place).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

import nats.js.errors
import structlog
from nats.js import JetStreamContext

from agentarium.broker import Topology, count_messages
from agentarium.schemas import check_name

from .collector import Collector, CollectorConfig, wait_for_any
from .config import TrainerConfig
from .draws import Draws, NoDraws
from .groups import BufferCounters, Group, Selection
from .mix import compose, quotas

log = structlog.get_logger("agentarium.trainer")

DISCOVERY_SUBJECT_LIMIT = 100_000  # above this, the per-subject map (one entry per job) is skipped


class TaskCollector:
    """``take`` hands out one step's groups across agents, ``ack`` retires them."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        config: TrainerConfig,
        agents: Sequence[str],
        *,
        seen: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
        vocab_size: int | None = None,
    ) -> None:
        assert agents, "a trainer trains at least one agent"
        seen = set(seen)  # one set, shared by every agent's buffer
        self.agents = tuple(agents)
        self.weights = config.mix.weights_for(self.agents)
        self.task_wait_s = config.task_wait_s
        self.collectors = {
            agent: Collector(
                js,
                topology,
                CollectorConfig.from_trainer(config, agent),
                seen=seen,
                clock=clock,
                vocab_size=vocab_size,
            )
            for agent in self.agents
        }
        self.taken = dict.fromkeys(self.agents, 0)  # groups per task trained since the start
        self.short: dict[str, int] = {}  # tasks short at the last step: groups missing
        self._short_steps = 0

    def __repr__(self) -> str:
        parts = " ".join(f"{a}={c.buffer!r}" for a, c in self.collectors.items())
        return f"<TaskCollector {parts}>"

    @property
    def counters(self) -> BufferCounters:
        return BufferCounters.total(c.counters for c in self.collectors.values())

    @property
    def task_counters(self) -> dict[str, BufferCounters]:
        return {agent: c.counters for agent, c in self.collectors.items()}

    def staleness_histogram(self, groups: Iterable[Group]) -> dict[int, int]:
        return self.collectors[self.agents[0]].buffer.staleness_histogram(groups)

    async def start(self) -> None:
        for collector in self.collectors.values():
            await collector.start()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.collectors.values()))

    async def take(
        self,
        n: int,
        selection: Selection,
        *,
        stop: asyncio.Event | None = None,
        draws: Draws | NoDraws | None = None,
    ) -> list[Group] | None:
        """Wait for one step's n groups, composed by the mix (oldest first). None if ``stop``
        was set first, every group held going back. With ``draws`` (dynamic sampling,
        trainer/draws.py) every group the selection drops is replaced by one asked from the
        producers, and once the step's bound is passed it takes the groups it holds."""
        draws = draws if draws is not None else NoDraws()
        started = time.monotonic()
        task_deadline = started + self.task_wait_s
        held: dict[str, list[Group]] = {a: [] for a in self.agents}
        while True:
            for agent, collector in self.collectors.items():
                collector.changed.clear()
                dropped = collector.counters.dropped_at_select
                held[agent] += await collector.gather(n - len(held[agent]), selection)
                held[agent].sort(key=_age)
                await draws.replace(
                    agent,
                    collector.counters.dropped_at_select - dropped,
                    holding=sum(len(groups) for groups in held.values()),
                )
            now = time.monotonic()
            holding = sum(len(groups) for groups in held.values())
            short = draws.exhausted and 0 < holding < n  # the bound: train what is held
            wanted = holding if short else n
            plan = compose(
                wanted,
                {a: [_age(g) for g in groups] for a, groups in held.items()},
                weights=self.weights,
                taken=self.taken,
                waited_out=short or now >= task_deadline,
            )
            if plan is not None:
                if short:
                    log.warning(
                        "dynamic sampling: the step's draws are spent; training the groups held",
                        groups=holding,
                        wanted=n,
                        asked=draws.asked,
                    )
                return self._hand_out(wanted, held, plan, waited=now - started)
            if stop is not None and stop.is_set():
                self._requeue(held)
                return None
            wait = self.collectors[self.agents[0]].config.fetch_timeout_s
            if self.weights is not None and now < task_deadline:
                wait = min(wait, task_deadline - now)
            await wait_for_any([*self._changed, stop], timeout=wait)

    @property
    def _changed(self) -> list[asyncio.Event]:
        return [c.changed for c in self.collectors.values()]

    def _hand_out(
        self, n: int, held: dict[str, list[Group]], plan: dict[str, int], *, waited: float
    ) -> list[Group]:
        chosen: list[Group] = []
        for agent, groups in held.items():
            k = plan.get(agent, 0)
            chosen += groups[:k]
            self.collectors[agent].buffer.requeue(groups[k:])
            self.taken[agent] += k
        before, self.short = self.short, {}
        if self.weights is not None:
            wanted = quotas(n, self.weights, {a: self.taken[a] - plan[a] for a in self.agents})
            self.short = {a: wanted[a] - plan[a] for a in self.agents if plan[a] < wanted[a]}
        # a dead task is short at every step: say so when that changes, then at the 10th,
        # 100th... step in a row, not at every one
        self._short_steps = self._short_steps + 1 if self.short.keys() == before.keys() else 1
        if self.short and _power_of_ten(self._short_steps):
            log.warning(
                "tasks short: their share went to the others",
                short=self.short,
                steps_in_a_row=self._short_steps,
                waited_s=round(waited, 3),
                task_wait_s=self.task_wait_s,
                took=plan,
            )
        return sorted(chosen, key=_age)

    def _requeue(self, held: dict[str, list[Group]]) -> None:
        for agent, groups in held.items():
            self.collectors[agent].buffer.requeue(groups)

    async def ack(self, groups: list[Group]) -> None:
        """Ack every member of groups a checkpoint now covers, each on its own consumer."""
        by_task: dict[str, list[Group]] = {}
        for group in groups:
            by_task.setdefault(group.task, []).append(group)
        for agent, mine in by_task.items():
            await self.collectors[agent].ack(mine)

    def take_decided(self) -> list[str]:
        """Job ids acked without training since the last call, every agent's."""
        return [j for c in self.collectors.values() for j in c.take_decided()]

    async def wait_received(self, n: int, *, timeout: float = 30.0) -> None:
        """Wait until n trajectories, all agents together, have been delivered (tests)."""
        async with asyncio.timeout(timeout):
            while self.counters.received < n:
                await wait_for_any(self._changed, timeout=0.5)


def _power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1


def _age(group: Group) -> tuple[int, float]:
    """The order groups are trained in: oldest policy version first, then first arrival."""
    return group.oldest_version, group.first_arrival


async def discover_agents(
    js: JetStreamContext, topology: Topology, run: str, *, also: Iterable[str] = ()
) -> list[str]:
    """The agents ``--agent '*'`` trains (the module docstring's rule), sorted, ``also`` first
    in its own order."""
    found: set[str] = set()
    stream = topology.trajectories_stream
    run_filter = topology.trajectories_filter(run)
    try:
        stored = await count_messages(js, stream, run_filter)
        if stored <= DISCOVERY_SUBJECT_LIMIT:
            stored_info = await js.stream_info(stream, subjects_filter=run_filter)
            subjects = stored_info.state.subjects or {}
            found.update(subject.split(".")[-2] for subject in subjects)
        else:
            log.warning(
                "agents of the run not read from its stored trajectories: too many subjects; "
                "name the agents with --agent",
                run=run,
                stored=stored,
            )
    except nats.js.errors.NotFoundError:
        pass
    try:
        for consumer in await js.consumers_info(topology.tasks_stream):
            agent = topology.agent_of_rollout_consumer(consumer.name)
            if agent is not None and _valid(agent):
                found.add(agent)
    except nats.js.errors.NotFoundError:
        pass
    first = [a for a in dict.fromkeys(also) if a != "*"]
    return first + sorted(found - set(first))


def _valid(agent: str) -> bool:
    try:
        check_name(agent, "agent")
    except ValueError:
        return False
    return True
