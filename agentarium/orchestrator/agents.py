"""Registered agents and their consumers: ``AgentRegistry.register`` builds each agent's
``ConsumerSpec`` from the orchestrator's settings and starts its consumer in this process or
as Ray actors, or starts none when ``agentarium consumer`` services run the agents."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from agentarium.consumers import AgentSpec, ConsumerSettings, ConsumerSpec, LLMTarget, load_agent
from agentarium.consumers.agents import env_agent
from agentarium.schemas import check_name

from .config import OrchestratorConfig
from .model import PolicyModel
from .runtime import Runtime


class AgentRegistry:
    """``agents``: name -> its ``AgentSpec`` (None: an external consumer's agent, not known
    here); ``endpoints``: name -> its consumers' proxy base URLs."""

    def __init__(self, config: OrchestratorConfig, model: PolicyModel, runtime: Runtime) -> None:
        self.config = config
        self.model = model
        self.runtime = runtime
        self.agents: dict[str, AgentSpec | None] = {}
        self.endpoints: dict[str, list[str]] = {}
        self._next_proxy_port = config.consumer.proxy_port

    def register(
        self,
        agent_name: str,
        fn: Any,
        endpoint: str | Sequence[str] | None,
        model: str | None,
        *,
        reward_fn: Any,
        concurrency: int | None,
        env: str | None,
        max_turns: int | None,
    ) -> list[str]:
        """See ``AgentOrchestrator.register_agent_type``."""
        check_name(agent_name, "agent")
        if agent_name in self.agents:
            raise ValueError(f"agent {agent_name!r} is already registered")
        if env is not None:
            if fn is not None:
                raise ValueError(
                    f"register_agent_type({agent_name!r}): pass fn (your agent) or env (the "
                    "generic function-call agent on that environment), not both"
                )
            fn = env_agent(env) if max_turns is None else env_agent(env, max_turns=max_turns)
        elif isinstance(fn, str):  # "exec:CMD" (a program agent) or "module:function"
            fn = load_agent(fn)
        cfg = self.config
        if cfg.external_consumers:
            self.agents[agent_name] = AgentSpec.of(fn, agent_name) if fn is not None else None
            self.endpoints[agent_name] = []
            return []
        if fn is None:
            raise ValueError(
                f"register_agent_type({agent_name!r}) needs the agent function "
                "(or create the orchestrator with external_consumers=True)"
            )
        agent = AgentSpec.of(fn, agent_name)  # refuses an unsupported shape before any start
        model_name = model or self.model.name
        target = LLMTarget.of(endpoint, cfg.server_addresses, model_name)
        spec = ConsumerSpec(
            agent=agent_name,
            fn=fn,
            target=target,
            model_dir=self.model.dir if target.trainable else None,
            model_name=model_name,
            reward_fn=reward_fn,
            settings=self._settings(agent_name, concurrency),
        )
        endpoints = self._start(spec, trainable=target.trainable)
        self.agents[agent_name] = agent
        self.endpoints[agent_name] = endpoints
        return endpoints

    def _settings(self, agent_name: str, concurrency: int | None) -> ConsumerSettings:
        """The orchestrator's consumer settings for this agent: its own worker name and
        proxy port, and its ``concurrency`` when register_agent_type gave one."""
        return dataclasses.replace(
            self.config.consumer,
            concurrency=concurrency or self.config.consumer.concurrency,
            proxy_port=self._next_proxy_port,
            worker_id=f"{self.config.run}-{agent_name}",
        )

    def _start(self, spec: ConsumerSpec, *, trainable: bool) -> list[str]:
        core = self.runtime.core
        if self.config.ray_config is not None:
            model_ref = self.config.model if trainable else None
            return self.runtime.loop.call(core.start_ray(spec, model_ref))
        template = self.model.template if trainable else None
        endpoint = self.runtime.loop.call(core.start_local(spec, template))
        if self._next_proxy_port:
            self._next_proxy_port += 1  # the next agent's proxy starts above this one
        return [endpoint]
