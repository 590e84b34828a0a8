"""Rollout consumers as Ray actors on the user's Ray cluster: scale rollouts without services.

Each actor is an async Ray actor that runs one ``consumers.ConsumerService`` (a worker loop,
its tracing proxy and its backend) in its own process, pulling the agent's jobs from
NATS like any ``agentarium consumer``. Its proxy binds a base port plus the actor's offset
(scanning upwards when taken), or any free port with 0, so several actors on one node never
collide. An agent that runs in the actor calls it on loopback; a Ray remote function agent,
whose tasks run anywhere in the cluster, on the node's IP (``consumers`` picks the address).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import structlog

from agentarium.broker import NatsSettings, Topology
from agentarium.consumers import AgentSpec, ConsumerService, ConsumerSpec

from .ray_resources import check_fits, task_cpus

log = structlog.get_logger("agentarium.ray")


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """``ray_config`` of the orchestrator. Unknown keys are refused, naming the known ones."""

    address: str | None = None  # ray.init(address=...) if Ray is not initialised yet ("auto": join)
    num_actors: int = 1  # consumer actors per registered agent
    num_cpus: float = 1.0  # per actor
    num_gpus: float = 0.0
    memory: int | None = None  # bytes per actor
    resources: dict[str, float] = field(default_factory=dict)  # custom resources per actor
    concurrency: int | None = None  # rollouts at once per actor (default: the orchestrator's)
    runtime_env: dict[str, Any] | None = None  # for ray.init, when the orchestrator starts Ray
    namespace: str | None = None
    # Refuse actors that leave no CPU for an agent's Ray tasks (ray_resources.check_fits);
    # off for an autoscaling cluster, whose CPUs are not all there when the actors start.
    check_resources: bool = True

    def __post_init__(self) -> None:
        if self.num_actors < 1:
            raise ValueError(f"ray_config num_actors must be >= 1, got {self.num_actors}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("ray_config num_cpus and num_gpus must be >= 0")

    @classmethod
    def of(cls, value: RayConfig | dict[str, Any]) -> RayConfig:
        if isinstance(value, RayConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"ray_config must be a dict or RayConfig, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"ray_config has unknown keys {unknown}; known keys: {sorted(known)}")
        return cls(**value)

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            options["memory"] = self.memory
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


def ensure_ray(config: RayConfig) -> None:
    """Use the Ray session the caller opened, or join/start one from ``config``."""
    import ray

    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"address": config.address, "ignore_reinit_error": True}
    if config.runtime_env:
        kwargs["runtime_env"] = config.runtime_env
    if config.namespace:
        kwargs["namespace"] = config.namespace
    if not config.address:
        kwargs["include_dashboard"] = False
        if not os.environ.get("RAY_ADDRESS"):
            # a Ray of our own: its workers at nice 0, not Ray's 15, since the consumer actors
            # are the work (docs/design.md, the trainer's Ray)
            kwargs["_system_config"] = {"worker_niceness": 0}
    ray.init(**kwargs)


class RolloutActor:
    """The body of one consumer actor (wrapped by ``ray.remote`` in ``RayConsumerPool``)."""

    def __init__(self) -> None:
        self.consumer: ConsumerService | None = None
        self.nc: Any = None

    async def start(self, settings: NatsSettings, spec: ConsumerSpec, model_ref: str | None) -> str:
        from ..models import resolve_model

        model_dir = spec.model_dir
        if model_ref and not (model_dir and Path(model_dir).is_dir()):
            model_dir = str(resolve_model(model_ref))  # another node: build or find it here
        spec = replace(spec, model_dir=model_dir)
        self.nc = await settings.connect(name=f"agentarium-ray-{spec.agent}")
        self.consumer = await ConsumerService(
            self.nc.jetstream(), Topology(settings.prefix), spec
        ).start()
        return self.consumer.endpoint_base

    async def counters(self) -> dict[str, int]:
        worker = self.consumer.worker if self.consumer else None
        return dict(vars(worker.counters)) if worker else {}

    async def stop(self) -> dict[str, int]:
        counters = await self.consumer.stop() if self.consumer else None
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        return dict(vars(counters)) if counters else {}


class RayConsumerPool:
    """``config.num_actors`` consumer actors per agent, started by ``start_agent``."""

    def __init__(self, config: RayConfig, settings: NatsSettings) -> None:
        self.config = config
        self.settings = settings
        self.actors: dict[str, list[Any]] = {}
        self.endpoints: dict[str, list[str]] = {}
        self.actor_cpus = 0.0  # CPUs the started actors hold, all agents together
        self._offset = 0
        ensure_ray(config)
        import ray

        self._actor_class = ray.remote(RolloutActor)

    @staticmethod
    async def _get(ref: Any) -> Any:
        return await asyncio.wrap_future(ref.future())

    async def start_agent(self, spec: ConsumerSpec, model_ref: str | None) -> list[str]:
        """Start this agent's actors; returns their proxy base URLs once all of them pull.

        Refuses (ValueError) actors that would hold CPUs the agent's Ray tasks need."""
        import ray

        if self.config.check_resources:
            agent = AgentSpec.of(spec.fn, spec.agent)
            check_fits(
                cluster_cpus=float(ray.cluster_resources().get("CPU", 0.0)),
                actor_cpus=self.actor_cpus,
                new_actors=self.config.num_actors,
                cpus_per_actor=self.config.num_cpus,
                agent=spec.agent,
                agent_task_cpus=task_cpus(spec.fn) if agent.kind == "ray" else None,
            )
        options = self.config.actor_options()
        concurrency = self.config.concurrency or spec.settings.concurrency
        actors, refs = [], []
        for i in range(self.config.num_actors):
            port = spec.settings.proxy_port + self._offset if spec.settings.proxy_port else 0
            self._offset += 1
            actor = self._actor_class.options(
                name=None, max_concurrency=max(1000, concurrency * 4), **options
            ).remote()
            own = replace(
                spec.settings,
                proxy_port=port,
                concurrency=concurrency,
                worker_id=f"{spec.settings.worker_id}-ray{i}",
            )
            actor_spec = replace(spec, settings=own)
            actors.append(actor)
            # Ray types .remote only on @ray.method-decorated methods (stub gap).
            refs.append(actor.start.remote(self.settings, actor_spec, model_ref))  # type: ignore[attr-defined]
        self.actors.setdefault(spec.agent, []).extend(actors)
        self.actor_cpus += self.config.num_actors * self.config.num_cpus
        try:
            endpoints = list(await asyncio.gather(*(self._get(r) for r in refs)))
        except Exception as exc:
            raise RuntimeError(
                f"Ray consumer actors for agent {spec.agent!r} failed to start: {exc}"
            ) from exc
        self.endpoints.setdefault(spec.agent, []).extend(endpoints)
        log.info(
            "ray consumer actors started",
            agent=spec.agent,
            actors=len(actors),
            endpoints=endpoints,
            options=options,
        )
        return endpoints

    async def counters(self) -> dict[str, list[dict[str, int]]]:
        out = {}
        for agent, actors in self.actors.items():
            out[agent] = list(
                await asyncio.gather(*(self._get(a.counters.remote()) for a in actors))
            )
        return out

    async def stop(self) -> None:
        import ray

        every = [a for actors in self.actors.values() for a in actors]
        if every:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.gather(
                        *(self._get(a.stop.remote()) for a in every), return_exceptions=True
                    ),
                    timeout=30,
                )
        for actor in every:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors.clear()
        self.actor_cpus = 0.0
