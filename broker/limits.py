"""Limits: the tunable settings of every stream, bucket and rollout consumer, declared once.

``broker init``'s and ``broker up``'s flags are derived from these fields (schemas.settings);
the keys without a flag are set in code (tests, the orchestrator) and say why they have none.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentarium.schemas import SettingError, check_settings, setting

GiB = 1024**3
DAY_S = 86400.0
GROUP = "stream and consumer settings"


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Tunable settings; the defaults suit one box to a few hundred workers."""

    replicas: int = setting(
        1,
        choices=(1, 3, 5),
        group=GROUP,
        help="replicas of every stream and bucket (3 on a 3-node cluster; default %(default)s)",
    )
    tasks_max_msgs: int = setting(
        1_000_000, ge=1, group=GROUP, help="queue capacity in jobs; producers wait when full"
    )
    tasks_max_bytes: int = setting(
        4 * GiB,
        ge=1,
        group=GROUP,
        help="queue capacity in bytes (default %(default)s; not set on nats-server < 2.10.5, "
        "which drops the oldest jobs of a byte-full queue)",
    )
    # Re-publishing a batch inside this window is deduplicated by the server; a redelivery
    # later than that is caught by the per-job trajectory subject (see docs/design.md).
    duplicate_window_s: float = setting(
        3600.0, gt=0, group=GROUP, help="server-side dedup window for re-published jobs"
    )
    trajectories_max_age_s: float = setting(
        30 * DAY_S,
        gt=0,
        group=GROUP,
        help="how long trajectories are kept (default %(default)s = 30 days)",
    )
    # Byte bounds: on a cluster every node stores every stream and bucket in full (R3), so
    # their sum must fit one node's JetStream volume (docs/operations.md, "Sizing storage").
    trajectories_max_bytes: int = setting(
        -1,
        group=GROUP,
        help="trajectories' byte bound, oldest dropped first past it (default %(default)s: "
        "bounded by age only)",
    )
    dead_max_age_s: float = setting(
        30 * DAY_S, flagless="how long dead-lettered jobs are kept; set in code"
    )
    dead_max_bytes: int = setting(
        -1,
        group=GROUP,
        help="dead letters' byte bound, oldest dropped first (default %(default)s: by age only)",
    )
    weights_max_bytes: int = setting(
        -1,
        group=GROUP,
        help="the weights object store's byte bound: above (versions kept + 1) x the model's "
        "bytes, or the trainer's publish is refused (default %(default)s: none)",
    )
    workers_ttl_s: float = setting(
        30.0,
        flagless="the workers registry's bucket TTL, the backstop of each entry's own TTL "
        "(broker.registry)",
    )
    policy_history: int = setting(5, flagless="policy versions kept per subject")
    # Live views (the dashboard): the trainer's step rows and the engines' weight versions.
    metrics_max_age_s: float = setting(
        7 * DAY_S, flagless="how long the trainer's step rows are kept (the dashboard's)"
    )
    metrics_max_bytes: int = setting(256 * 1024**2, flagless="the step rows' byte bound")
    # A running syncer rewrites its engines' entries every --recheck-s (30 s): an entry this
    # old belongs to an engine nobody syncs any more.
    engines_ttl_s: float = setting(3600.0, flagless="how long an engine's version entry lives")
    # Rollout consumer defaults (each worker's flags may change ack_wait/attempts).
    # The same rule as the consumer's --ack-wait (consumers/config.py): heartbeats every third.
    ack_wait_s: float = setting(
        10.0,
        ge=3,
        group=GROUP,
        help="redelivery timeout of rollout consumers; workers heartbeat every third of it",
    )
    attempts: int = setting(
        3,
        ge=1,
        group=GROUP,
        help="failed runs per job before it is dead-lettered; deliveries lost to a crashed or "
        "drained worker do not count (max_deliver = attempts + 5 + 1; default %(default)s)",
    )
    # Deliveries a job may lose besides (its worker crashed or was stopped, its ack timed
    # out): they spend no attempt. max_deliver = attempts + lost_deliveries + 1, the last one
    # never run, only dead-lettered (a job that keeps crashing its workers ends there).
    lost_deliveries: int = setting(
        5, ge=0, flagless="deliveries a job may lose to crashed or drained workers; set in code"
    )
    # How long a job's count of failed runs is kept (the attempts KV): longer than a retried
    # job may wait in the queue. An expired count only gives a job more runs, never fewer.
    attempts_ttl_s: float = setting(
        7 * DAY_S, flagless="how long a job's count of failed runs is kept"
    )
    max_ack_pending: int = setting(
        20_000,
        ge=1,
        group=GROUP,
        help="in-flight jobs per agent across all workers; keep above total concurrency",
    )
    max_waiting: int = setting(
        2048, ge=1, group=GROUP, help="concurrent pull requests per agent (one per worker batch)"
    )

    def __post_init__(self) -> None:
        check_settings(self)
        for name in ("trajectories_max_bytes", "dead_max_bytes", "weights_max_bytes"):
            value = getattr(self, name)
            if value != -1 and value < 1:
                flag = "--" + name.replace("_", "-")
                raise SettingError(f"{flag} must be -1 (no byte bound) or >= 1, got {value}")
        if self.duplicate_window_s > self.trajectories_max_age_s:
            raise ValueError("duplicate window must not exceed the trajectories max age")
