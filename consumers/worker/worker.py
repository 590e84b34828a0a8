"""The rollout worker: pull jobs for one agent, run them concurrently, store trajectories.

Delivery rules (docs/design.md "Delivery and failure rules"):
- a job is acked only after its trajectory is stored (publish ack, or the server's
  "already stored" answer to ``Nats-Expected-Last-Subject-Sequence: 0``);
- a redelivered job first looks up whether its trajectory already exists;
- an undecodable/invalid job is dead-lettered and terminated; an agent error is retried
  with backoff (nak with delay), and on the last attempt stored as status ``error``,
  dead-lettered with the traceback and terminated;
- a delivery past the attempts (the previous one crashed a worker) is never run;
- SIGTERM drains: stop fetching, finish in-flight rollouts within a grace period, nak the rest
  (dead-letter and term one on its last delivery: a nak would strand it);
- while the agent's LLM fleet is down within its outage limit (consumers/fleet.py), fetch
  nothing: in-flight rollouts wait for the fleet, heartbeated, on their current delivery.

The worker owns the parts and their order: ``Intake`` (consumers/worker/intake.py) pulls and keeps
the deliveries in flight; ``DeliveryHandler`` (consumers/worker/handler.py) takes each through
decode → decide → run → settle, the decision being ``DeliveryPolicy``'s (consumers/delivery.py)
alone; the heartbeat and the registry entry run beside them (consumers/worker/background.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, replace
from typing import Any

import nats.js.errors
import structlog
from nats.js import JetStreamContext

from agentarium.broker import (
    TRANSIENT_NATS_ERRORS,
    Backoff,
    Limits,
    Topology,
    ensure_consumer,
    ensure_provisioned,
    remove_worker,
)
from agentarium.schemas import check_name, encoding

from ..config import ConsumerSettings
from ..fleet import fleets_summary
from ..metrics import RolloutMetrics
from ..rollout import RolloutEnv
from .background import BackgroundLoops, Heartbeat, RegistryEntry
from .counters import Counters
from .handler import DeliveryHandler
from .intake import Intake, sleep_or_stop
from .store import TrajectoryStore

log = structlog.get_logger("agentarium.consumers")

# What _attach rides out: a broker restarting, or still electing the stream's leader.
_ATTACH_RETRYABLE: tuple[type[Exception], ...] = (
    *TRANSIENT_NATS_ERRORS,
    nats.js.errors.ServiceUnavailableError,
)
ATTACH_BACKOFF = Backoff(initial_s=0.2, max_s=5.0)


class Worker:
    """A rollout worker for one agent; any number of them share the agent's durable consumer."""

    def __init__(
        self,
        js: JetStreamContext,
        topo: Topology,
        agent: str,
        config: ConsumerSettings,
        env: RolloutEnv,
        limits: Limits | None = None,
    ) -> None:
        check_name(agent, "agent")
        self.js = js
        self.topo = topo
        self.agent = agent
        self.config = config
        self.env = env
        self.limits = limits or Limits()
        self.counters = Counters()
        self.metrics = RolloutMetrics(agent)
        self.store = TrajectoryStore(js, topo, config.worker_id, encoding=encoding(config.encoding))
        self._stop = asyncio.Event()
        self._intake: Intake | None = None  # bound by _attach
        self._background = BackgroundLoops()
        # Set when the LLM fleet goes down or comes back: the registry shows it at once.
        self._registry_kick = asyncio.Event()
        for fleet in env.fleets:
            fleet.listeners.append(self._registry_kick.set)
            fleet.listeners.append(self._wake_intake)  # the pull loop pauses at once

    def __repr__(self) -> str:
        c = self.counters
        return (
            f"<Worker {self.config.worker_id} agent={self.agent} in_flight={self.in_flight} "
            f"ok={c.ok} errors={c.errors} timeouts={c.timeouts} retried={c.retried} dead={c.dead_lettered}>"
        )

    @property
    def in_flight(self) -> int:
        return self._intake.in_flight if self._intake is not None else 0

    @property
    def ready(self) -> bool:
        """Bound to the agent's consumer and pulling (false before that and while draining)."""
        return self._intake is not None and self._intake.bound and not self._stop.is_set()

    @property
    def paused(self) -> bool:
        """The pull loop waits for an LLM fleet that is down."""
        return self._intake is not None and self._intake.paused

    def stop(self) -> None:
        """Begin draining (what SIGTERM does)."""
        self._stop.set()
        self._wake_intake()

    def _wake_intake(self) -> None:
        if self._intake is not None:
            self._intake.wake()

    async def run(self) -> Counters:
        intake = await self._attach()
        cfg = self.config  # with the agent's consumer's settings, adopted by _attach
        log.info(
            "worker started",
            worker_id=cfg.worker_id,
            agent=self.agent,
            concurrency=cfg.concurrency,
            burst=cfg.burst,
            ack_wait_s=cfg.ack_wait_s,
            attempts=cfg.delivery.attempts,
            lost_deliveries=cfg.delivery.lost_deliveries,
        )
        self._background.start(
            Heartbeat(intake.messages, period_s=cfg.ack_wait_s / 3),
            RegistryEntry(
                self.js,
                self.topo,
                cfg.worker_id,
                self._status,
                interval_s=cfg.registry_interval_s,
                kick=self._registry_kick,
            ),
        )
        try:
            await intake.run()
            await intake.drain()
        finally:
            await self._background.stop()
            await intake.close()  # before any nc.drain(): a live subscription hangs it
            await remove_worker(self.js, self.topo, cfg.worker_id)
            await self.store.close()
            log.info(
                "worker stopped",
                worker_id=cfg.worker_id,
                agent=self.agent,
                **asdict(self.counters),
            )
        return self.counters

    async def _attach(self) -> Intake:
        """Provision, adopt the agent's consumer settings and bind the pull subscription,
        riding out a broker that is restarting or electing a leader (transient errors are
        retried with backoff until stop())."""
        consumer = self.topo.rollout_consumer_config(
            self.agent,
            self.limits,
            ack_wait_s=self.config.ack_wait_s,
            attempts=self.config.delivery.attempts,
            lost_deliveries=self.config.delivery.lost_deliveries,
        )
        durable = self.topo.rollout_consumer(self.agent)
        retry = 0
        while True:
            try:
                await ensure_provisioned(self.js, self.topo, self.limits)
                await ensure_consumer(
                    self.js,
                    self.topo.tasks_stream,
                    consumer,
                    keys=("filter_subject", "ack_policy"),
                )
                await self._adopt_consumer_settings(durable)
                intake = self._intake_for(durable)
                await intake.open()
                self._intake = intake
                return intake
            except _ATTACH_RETRYABLE as exc:
                if self._stop.is_set():
                    raise
                retry += 1
                delay = ATTACH_BACKOFF.delay(retry)
                log.warning(
                    "broker not ready; retrying",
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(delay, 2),
                )
                await sleep_or_stop(self._stop, delay)

    def _intake_for(self, durable: str) -> Intake:
        handler = DeliveryHandler(
            topo=self.topo,
            policy=self.config.delivery,
            store=self.store,
            env=self.env,
            counters=self.counters,
            metrics=self.metrics,
        )
        return Intake(
            self.js,
            self.topo,
            durable=durable,
            config=self.config,
            handler=handler,
            fleets=self.env.fleets,
            stopping=self._stop,
            counters=self.counters,
            metrics=self.metrics,
        )

    async def _adopt_consumer_settings(self, durable: str) -> None:
        """The durable consumer is shared by every worker of the agent: its ack_wait and
        max_deliver are set when it is created (by ``broker init`` or the first worker) and
        then adopted by all, so workers never fight over them and a job's last delivery is
        judged the same way everywhere."""
        info = await self.js.consumer_info(self.topo.tasks_stream, durable)
        max_deliver = info.config.max_deliver or 0
        ack_wait = float(info.config.ack_wait or self.config.ack_wait_s)
        retry = self.config.delivery
        if max_deliver >= 2 and (
            max_deliver != retry.max_deliver or ack_wait != self.config.ack_wait_s
        ):
            # max_deliver = attempts + lost_deliveries + 1; one made by a release before lost
            # deliveries (max_deliver = attempts + 1) leaves no room for them: it is read so.
            lost = retry.lost_deliveries if max_deliver - 1 - retry.lost_deliveries >= 1 else 0
            adopted = replace(retry, attempts=max_deliver - 1 - lost, lost_deliveries=lost)
            log.warning(
                "the agent's consumer already exists with other settings: using them; change "
                "them with `agentarium broker init --agent NAME --attempts N --ack-wait S`",
                consumer=durable,
                attempts=adopted.attempts,
                lost_deliveries=adopted.lost_deliveries,
                ack_wait_s=ack_wait,
                flag_attempts=retry.attempts,
                flag_ack_wait_s=self.config.ack_wait_s,
            )
            self.config = replace(self.config, delivery=adopted, ack_wait_s=ack_wait)

    def _status(self) -> dict[str, Any]:
        """What the registry entry shows of this worker now."""
        status: dict[str, Any] = {
            "agent": self.agent,
            "concurrency": self.config.concurrency,
            "in_flight": self.in_flight,
            "pulling": self.ready and not self.paused,
            **vars(self.counters),
        }
        if self.env.fleets:  # what `broker status` shows of the agent's LLM fleet
            status["fleet"] = fleets_summary(self.env.fleets)
        return status
