"""ConsumerSettings: every setting of one rollout consumer, declared once.

The worker's pulling and acking, the retry policy (``DeliveryPolicy``), the fleet watch
(``FleetPolicy``), the tracing proxy and the LLM calls. ``agentarium consumer``'s flags and
file keys, ``AgentOrchestrator``'s and ``agentarium eval``'s consumers all read these fields
(schemas.settings), so a default lives here and nowhere else.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from agentarium.schemas import ENCODINGS, check_settings, section, setting, settings

from .delivery import DeliveryPolicy
from .fleet import FleetPolicy


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, kw_only=True)
class ConsumerSettings:
    """How one consumer runs its agent's jobs (what the agent is, is ``ConsumerSpec``'s)."""

    concurrency: int = setting(32, ge=1, help="rollouts run at once in this process")
    burst: bool = setting(
        False, help="exit once the agent's queue is empty and nothing is in flight"
    )
    delivery: DeliveryPolicy = section(
        DeliveryPolicy,
        rename={
            "retry_delay_s": "base_delay_s",
            "retry_max_delay_s": "max_delay_s",
            "retry_jitter": "jitter",
        },
    )
    # Short, so a crashed consumer's jobs come back within seconds; a live rollout of any
    # length is never redelivered, since its job is heartbeated every third of it.
    ack_wait_s: float = setting(
        10.0,
        ge=3,
        help="redelivery timeout: a dead consumer's jobs run elsewhere after about this long; "
        "in-flight jobs are heartbeated every third of it, so rollouts may run for hours "
        "(default %(default)s)",
    )
    drain_grace_s: float = setting(
        30.0,
        ge=0,
        help="on SIGTERM, how long in-flight rollouts may finish before they are requeued for "
        "another consumer (spending no attempt); a supervisor must wait this plus 20 s before "
        "SIGKILL (terminationGracePeriodSeconds, stop_grace_period)",
    )
    llm_retries: int = setting(3, ge=0, help="retries per LLM call before failing over")
    llm_timeout_s: float = setting(600.0, gt=0, help="per LLM request")
    tool_fallback: bool = setting(
        False,
        help="for a model whose chat template renders no tools (SmolLM2's): write the tools "
        "into the system message, earlier calls and results into the conversation, and parse "
        "<tool_call> blocks from the reply (formats/tool_fallback.py); without it such a call "
        "is refused",
    )
    fleet: FleetPolicy = section(FleetPolicy, prefix="fleet_")
    proxy_host: str | None = setting(
        None,
        help="bind address of the OpenAI-compatible tracing proxy, which endpoint-style agents "
        "call (each rollout's URL carries its own secret). Default: 127.0.0.1, agents on this "
        "machine; 0.0.0.0 when --advertise-host names another address, for agents on other "
        "machines or containers",
    )
    proxy_port: int = setting(
        0, ge=0, le=65535, help="proxy port; 0 picks a free one, another is scanned upwards"
    )
    advertise_host: str | None = setting(
        None,
        help="host name put in the per-rollout endpoint URLs, for agents on other machines "
        "(default: the --proxy-host address, or this host's when that is 0.0.0.0)",
    )
    encoding: str = setting(
        "msgpack",
        choices=tuple(ENCODINGS),
        help="how trajectories and dead letters are written: msgpack (token ids and logprobs "
        "as packed int32/float32 bytes, the smallest) or json (plain arrays, readable by any "
        "NATS client without a msgpack library; a long trajectory about 1.8x the bytes). Each "
        "message names its encoding in its Content-Type header and every Agentarium reader "
        "takes both, so consumers of one agent may differ",
    )
    worker_id: str = setting(
        factory=default_worker_id,
        help="name in the workers registry (default: host-pid-random)",
    )
    max_fetch: int = setting(
        256, ge=1, flagless="jobs asked for in one pull at most; the free slots bound it anyway"
    )
    fetch_timeout_s: float = setting(
        1.0,
        gt=0,
        flagless="how long one pull waits for jobs; in burst mode, how long an empty queue "
        "must stay empty",
    )
    registry_interval_s: float = setting(
        5.0, gt=0, flagless="how often the worker refreshes its entry in the workers registry"
    )

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def of(cls, **values: Any) -> ConsumerSettings:
        """From flat keys, as a config file spells them (``attempts=1``,
        ``fleet_outage_limit_s=0``); the rest keep their defaults."""
        unknown = set(values) - {k.name for k in settings.keys(cls)}
        if unknown:
            raise TypeError(f"unknown consumer setting(s): {', '.join(sorted(unknown))}")
        return settings.build(cls, values)  # type: ignore[no-any-return]
