"""OrchestratorConfig: every setting of an ``AgentOrchestrator``, validated once, frozen."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker import Limits
from consumers import normalize_urls
from schemas import Sampling, check_name

from .ray_consumers import RayConfig
from .tensorize import MODES


def _default_run() -> str:
    return f"orch-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, kw_only=True)
class OrchestratorConfig:
    """``AgentOrchestrator(**options)`` builds one with ``of``; pass ``config=`` to reuse one.

    ``server_addresses``: SGLang-compatible servers every agent uses unless it names its own
    endpoint. ``nats_url``: a broker to use (None: an embedded nats-server). ``ray_config``:
    consumers as Ray actors; ``external_consumers``: ``agentarium consumer`` services pull the
    jobs instead. ``model``: 'tiny' or a model directory (tokenizer and chat template).
    """

    server_addresses: tuple[str, ...] = ()
    proxy_port: int = 0
    ray_config: RayConfig | None = None
    nats_url: str | None = None
    group_size: int = 1
    val_group_size: int = 1
    run: str = field(default_factory=_default_run)
    model: str = "tiny"
    model_name: str | None = None
    advertise_host: str | None = None
    # None: loopback, unless agents may call from elsewhere (consumers.ConsumerSpec.proxy_host)
    proxy_host: str | None = None
    concurrency: int | None = None  # None: the consumer's own default (ConsumerSettings)
    external_consumers: bool = False
    default_agent: str | None = None
    multi_turn: str = "concat"
    sampling: Sampling | None = None
    deadline_s: float = 600.0
    attempts: int = 3
    success_threshold: float = 1.0
    limits: Limits | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        if self.multi_turn not in MODES:
            raise ValueError(f"multi_turn must be one of {MODES}, got {self.multi_turn!r}")
        if self.ray_config is not None and self.external_consumers:
            raise ValueError(
                "ray_config starts consumer actors; external_consumers=True says "
                "consumers run elsewhere: pass one or the other"
            )
        for name in ("group_size", "val_group_size", "concurrency", "attempts"):
            value = getattr(self, name)
            if name == "concurrency" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.proxy_port, bool) or not isinstance(self.proxy_port, int):
            raise ValueError(f"proxy_port must be an integer, got {self.proxy_port!r}")
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
        sampling, None for defaults. Unknown options are refused by name."""
        unknown = sorted(set(options) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise TypeError(
                f"AgentOrchestrator got unknown option(s) {', '.join(unknown)}; see "
                "help(agentarium.OrchestratorConfig) for the settings"
            )
        if isinstance(ray_config, Mapping):
            ray_config = RayConfig.of(dict(ray_config))
        if isinstance(sampling, Mapping):
            sampling = Sampling(**sampling)
        if run is not None:
            options["run"] = run
        return cls(
            server_addresses=tuple(normalize_urls(server_addresses)),
            ray_config=ray_config,
            sampling=sampling,
            proxy_port=int(proxy_port or 0),
            **options,
        )
