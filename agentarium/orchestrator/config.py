"""OrchestratorConfig: every setting of an ``AgentOrchestrator``, validated once, frozen.

Its consumers' settings are a ``consumers.ConsumerSettings`` section, so their defaults
(concurrency, attempts, the proxy's host and port, ...) are the consumer's own, declared
once; ``AgentOrchestrator(concurrency=8, attempts=1)`` spells them as flat keys, as a
consumer's config file does. Its jobs' group size and deadline are ``producers.JobOptions``'
own fields (``settings.shared``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentarium.broker import Limits
from agentarium.consumers import ConsumerSettings, normalize_urls
from agentarium.producers import JobOptions
from agentarium.schemas import Sampling, check_name, check_settings, section, setting, settings

from .ray_consumers import RayConfig
from .tensorize import MODES

# Consumer settings the orchestrator decides itself, so an option for them would do nothing.
DECIDED = {
    "worker_id": "each agent's consumer is named <run>-<agent>",
    "burst": "the orchestrator's consumers serve until close()",
}


def _default_run() -> str:
    return f"orch-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, kw_only=True)
class OrchestratorConfig:
    """``AgentOrchestrator(**options)`` builds one with ``of``; pass ``config=`` to reuse one."""

    server_addresses: tuple[str, ...] = setting(
        (), help="SGLang-compatible servers every agent uses unless it names its own endpoint"
    )
    ray_config: RayConfig | None = setting(
        None, help="run the consumers as Ray actors (a dict of RayConfig's fields)"
    )
    nats_url: str | None = setting(None, help="the broker (None: an embedded nats-server)")
    external_consumers: bool = setting(
        False, help="start no consumers: `agentarium consumer` services pull the jobs"
    )
    group_size: int = settings.shared(JobOptions, "group_size")  # jobs per training row
    val_group_size: int = setting(1, ge=1, help="jobs per row of a validation batch")
    run: str = setting(factory=_default_run, help="the run id (default: orch-<time>-<random>)")
    model: str = setting(
        "tiny", help="'tiny', 'smol' or a model directory: tokenizer, chat template"
    )
    model_name: str | None = setting(
        None, help="model name handed to endpoint-style agents (default: from model)"
    )
    default_agent: str | None = setting(
        None, help="the agent of rows that name none (default: the only one registered)"
    )
    multi_turn: str = setting(
        "concat", choices=MODES, help="how a trajectory's calls become rows (tensorize)"
    )
    sampling: Sampling | None = setting(None, help="the jobs' sampling (None: Sampling())")
    deadline_s: float = settings.shared(JobOptions, "deadline_s")
    success_threshold: float = setting(
        1.0, help="a rollout succeeds when its reward >= this (success rate, pass@k)"
    )
    limits: Limits | None = setting(None, help="the streams' limits (None: broker.Limits())")
    progress: bool | None = setting(
        None, help="the progress bar (None: on a terminal); AgentOrchestrator.progress flips it"
    )
    consumer: ConsumerSettings = section(ConsumerSettings)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.ray_config is not None and self.external_consumers:
            raise ValueError(
                "ray_config starts consumer actors; external_consumers=True says "
                "consumers run elsewhere: pass one or the other"
            )
        # The bounds are checked by check_settings; a Python caller may also pass "8" or True.
        for name, value in (
            ("group_size", self.group_size),
            ("val_group_size", self.val_group_size),
            ("concurrency", self.consumer.concurrency),
            ("attempts", self.consumer.delivery.attempts),
            ("proxy_port", self.consumer.proxy_port),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        check_name(self.run, "run")
        if self.default_agent is not None:
            check_name(self.default_agent, "agent")

    @classmethod
    def of(
        cls,
        *,
        server_addresses: str | Sequence[str] | None = None,
        ray_config: RayConfig | Mapping[str, Any] | None = None,
        sampling: Sampling | Mapping[str, Any] | None = None,
        proxy_port: int | None = 0,
        run: str | None = None,
        **options: Any,
    ) -> OrchestratorConfig:
        """From the constructor's loose forms: a URL string or list, a dict for Ray and
        sampling, None for defaults; the consumers' settings as flat keys (``attempts=1``).
        Unknown options are refused by name."""
        known = {key.name for key in settings.keys(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"AgentOrchestrator got unknown option(s) {', '.join(unknown)}; see "
                "help(agentarium.OrchestratorConfig) for the settings, and "
                "consumers.ConsumerSettings for its consumers'"
            )
        for name in sorted(set(options) & set(DECIDED)):
            raise TypeError(f"AgentOrchestrator does not take {name}: {DECIDED[name]}")
        if isinstance(ray_config, Mapping):
            ray_config = RayConfig.of(dict(ray_config))
        if isinstance(sampling, Mapping):
            sampling = Sampling(**sampling)
        if run is not None:
            options["run"] = run
        values = {
            **options,
            "server_addresses": tuple(normalize_urls(server_addresses)),
            "ray_config": ray_config,
            "sampling": sampling,
            "proxy_port": int(proxy_port or 0),
        }
        return settings.build(cls, values)  # type: ignore[no-any-return]
