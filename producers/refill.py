"""GroupRefill: the producer side of dynamic sampling, publishing groups a trainer asks for.

A trainer with ``--dynamic-sampling`` replaces every group its step drops (flat rewards, too
few trainable members) by asking the run's producers for another: a ``GroupDemand`` request on
``<p>.demand.<run>.<agent>`` (trainer/draws.py). A ``GroupRefill`` subscribes there in a queue
group, so each request is answered once whatever the number of producers; it draws that many
tasks from its ``tasks(n)`` source, publishes them as groups of ``group_size`` jobs through the
``TaskProducer`` (ids derived as for any submit, so a request answered twice publishes
nothing new), and answers with a ``GroupSupply`` saying how many it published. A source with
nothing left returns fewer tasks (none): the answer says so and the trainer's bound decides.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from agentarium.broker import Topology
from agentarium.schemas import JSON, GroupDemand, GroupSupply, Sampling, SchemaError, decode

from .sdk import TaskProducer

log = structlog.get_logger("agentarium.producer")

TaskSource = Callable[[int], Sequence[Mapping[str, Any]]]


class GroupRefill:
    """``await start()``: answers the run's demands for ``agent`` until ``close()``."""

    def __init__(
        self,
        producer: TaskProducer,
        *,
        run: str,
        agent: str,
        tasks: TaskSource,
        group_size: int,
        sampling: Sampling | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.producer = producer
        self.topology = topology or producer.topology
        self.run = run
        self.agent = agent
        self.tasks = tasks
        self.group_size = group_size
        self.sampling = sampling
        self.answered = 0  # demands answered
        self.drawn = 0  # groups published for them
        self._sub: Any = None

    def __repr__(self) -> str:
        return (
            f"<GroupRefill run={self.run} agent={self.agent} answered={self.answered} "
            f"drawn={self.drawn}>"
        )

    async def start(self) -> GroupRefill:
        self._sub = await self.producer.nc.subscribe(
            self.topology.demand_subject(self.run, self.agent),
            queue=self.topology.demand_queue(self.run, self.agent),
            cb=self._answer,
        )
        return self

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):  # a closed connection has nothing to drop
                await self._sub.unsubscribe()
            self._sub = None

    async def __aenter__(self) -> GroupRefill:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _answer(self, msg: Any) -> None:
        try:
            demand = decode(GroupDemand, msg.data, "application/json")
        except SchemaError as exc:
            log.warning("undecodable group demand ignored", subject=msg.subject, error=str(exc))
            return
        tasks = list(self.tasks(demand.groups))
        jobs, batch_id = 0, ""
        if tasks:
            result = await self.producer.submit(
                self.agent,
                tasks,
                run=self.run,
                group_size=self.group_size,
                sampling=self.sampling,
                metadata={"demand_id": demand.demand_id},
            )
            jobs, batch_id = result.published, result.batch_id
        self.answered += 1
        self.drawn += len(tasks)
        log.info(
            "groups drawn for the trainer",
            run=self.run,
            agent=self.agent,
            asked=demand.groups,
            drawn=len(tasks),
            step=demand.step,
        )
        supply = GroupSupply(
            demand_id=demand.demand_id, groups=len(tasks), jobs=jobs, batch_id=batch_id
        )
        if msg.reply:
            await self.producer.nc.publish(msg.reply, JSON.encode(supply), headers=JSON.headers())
