"""Names and definitions of every stream, consumer and bucket (docs/design.md, "NATS objects").

One place decides every subject, stream name and setting; provisioning, producers,
consumers, the trainer and status all ask this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from agentarium.schemas import check_name

from .limits import Limits


@dataclass(frozen=True)
class Topology:
    """Subjects and names under one prefix (default ``agentarium``)."""

    prefix: str = "agentarium"

    def __post_init__(self) -> None:
        check_name(self.prefix, "prefix")

    # streams and buckets
    @property
    def tasks_stream(self) -> str:
        return f"{self.prefix.upper()}_TASKS"

    @property
    def trajectories_stream(self) -> str:
        return f"{self.prefix.upper()}_TRAJECTORIES"

    @property
    def dead_stream(self) -> str:
        return f"{self.prefix.upper()}_DEAD"

    @property
    def metrics_stream(self) -> str:
        return f"{self.prefix.upper()}_METRICS"

    @property
    def engines_bucket(self) -> str:
        return f"{self.prefix}-engines"

    @property
    def weights_bucket(self) -> str:
        return f"{self.prefix}-weights"

    @property
    def policy_bucket(self) -> str:
        return f"{self.prefix}-policy"

    @property
    def workers_bucket(self) -> str:
        return f"{self.prefix}-workers"

    @property
    def attempts_bucket(self) -> str:
        return f"{self.prefix}-attempts"

    def attempts_key(self, agent: str, job_id: str) -> str:
        """A job's entry in the attempts KV: how many of its runs failed so far."""
        return f"{check_name(agent, 'agent')}.{check_name(job_id, 'job_id')}"

    # subjects
    def tasks_subject(self, agent: str) -> str:
        return f"{self.prefix}.tasks.{check_name(agent, 'agent')}"

    def trajectory_subject(self, run: str, agent: str, job_id: str) -> str:
        return (
            f"{self.prefix}.trajectories.{check_name(run, 'run')}."
            f"{check_name(agent, 'agent')}.{check_name(job_id, 'job_id')}"
        )

    def trajectories_filter(self, run: str = "*", agent: str = "*") -> str:
        run = run if run == "*" else check_name(run, "run")
        agent = agent if agent == "*" else check_name(agent, "agent")
        return f"{self.prefix}.trajectories.{run}.{agent}.*"

    def dead_subject(self, agent: str) -> str:
        # A job whose agent name is itself invalid still has to be dead-lettered somewhere.
        try:
            token = check_name(agent, "agent")
        except ValueError:
            token = "_invalid"
        return f"{self.prefix}.dead.{token}"

    def metrics_subject(self, run: str) -> str:
        return f"{self.prefix}.metrics.{check_name(run, 'run')}"

    def demand_subject(self, run: str, agent: str) -> str:
        """Where a trainer asks the run's producers for more groups of one agent (dynamic
        sampling: a core NATS request, ``GroupDemand`` in, ``GroupSupply`` out)."""
        return f"{self.prefix}.demand.{check_name(run, 'run')}.{check_name(agent, 'agent')}"

    def demand_queue(self, run: str, agent: str) -> str:
        """The producers' queue group on a demand subject: one of them answers each request."""
        return f"{self.prefix}-refill-{check_name(run, 'run')}-{check_name(agent, 'agent')}"

    def worker_subject(self, worker_id: str) -> str:
        """A worker's entry in the workers KV, as a subject (``$KV.<bucket>.<key>``): written
        directly when the entry carries its own TTL (``Nats-TTL``, nats-server 2.11+)."""
        return f"$KV.{self.workers_bucket}.{worker_id}"

    def rollout_consumer(self, agent: str) -> str:
        return f"rollout-{check_name(agent, 'agent')}"

    @staticmethod
    def agent_of_rollout_consumer(name: str) -> str | None:
        """The agent whose ``rollout-<agent>`` consumer this is; None for any other consumer
        (the name is not validated: the caller decides)."""
        return name.removeprefix("rollout-") if name.startswith("rollout-") else None

    def trainer_consumer(self, run: str, agent: str) -> str:
        """The trainer's durable on TRAJECTORIES for one agent of a run: one per agent, since
        nats-server 2.9 has no multi-filter consumers (and each agent gets its own
        max_ack_pending). Names allow ``-``, so two (run, agent) pairs can meet on one name
        (``a-b``/``c`` and ``a``/``b-c``): the trainer checks the filter of a durable it finds."""
        return f"trainer-{check_name(run, 'run')}-{check_name(agent, 'agent')}"

    def legacy_trainer_consumer(self, run: str) -> str:
        """The one-agent trainer's durable before several agents: a trainer adopts its ack
        floor (then deletes it) instead of replaying the run from its first trajectory."""
        return f"trainer-{check_name(run, 'run')}"

    # environment services (docs/design.md "Environment sessions")
    def env_service(self, name: str) -> str:
        """The NATS micro service name of environment ``name``, also its start queue group."""
        return f"{self.prefix}-env-{check_name(name, 'env')}"

    def env_start_subject(self, name: str) -> str:
        return f"{self.prefix}.env.{check_name(name, 'env')}.start"

    def env_session_subject(self, name: str, worker: str, session_id: str) -> str:
        return (
            f"{self.prefix}.env.{check_name(name, 'env')}.s.{check_name(worker, 'worker')}."
            f"{check_name(session_id, 'session_id')}"
        )

    def env_sessions_filter(self, name: str, worker: str) -> str:
        """The one wildcard subscription of a worker instance: every session it holds."""
        return f"{self.prefix}.env.{check_name(name, 'env')}.s.{check_name(worker, 'worker')}.*"

    def agent_of_subject(self, subject: str) -> str:
        """The <agent> token of a tasks subject (not validated: the caller decides)."""
        return subject[len(self.prefix) + len(".tasks.") :]

    # definitions
    def stream_configs(self, limits: Limits) -> list[StreamConfig]:
        return [
            StreamConfig(
                name=self.tasks_stream,
                subjects=[f"{self.prefix}.tasks.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                discard=DiscardPolicy.NEW,
                max_msgs=limits.tasks_max_msgs,
                max_bytes=limits.tasks_max_bytes,
                duplicate_window=limits.duplicate_window_s,
                num_replicas=limits.replicas,
                description="rollout jobs, one per message; work queue",
            ),
            StreamConfig(
                name=self.trajectories_stream,
                subjects=[f"{self.prefix}.trajectories.>"],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                max_age=limits.trajectories_max_age_s,
                max_bytes=limits.trajectories_max_bytes,
                duplicate_window=120.0,
                num_replicas=limits.replicas,
                description="one trajectory per job, on a per-job subject",
            ),
            StreamConfig(
                name=self.dead_stream,
                subjects=[f"{self.prefix}.dead.>"],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                max_age=limits.dead_max_age_s,
                max_bytes=limits.dead_max_bytes,
                duplicate_window=120.0,
                num_replicas=limits.replicas,
                description="dead-lettered jobs with the reason and last error",
            ),
            StreamConfig(
                name=self.metrics_stream,
                subjects=[f"{self.prefix}.metrics.>"],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                max_age=limits.metrics_max_age_s,
                max_bytes=limits.metrics_max_bytes,
                duplicate_window=120.0,
                num_replicas=limits.replicas,
                description="the trainer's per-step metrics rows (JSON), for live views",
            ),
        ]

    def rollout_consumer_config(
        self,
        agent: str,
        limits: Limits,
        *,
        ack_wait_s: float | None = None,
        attempts: int | None = None,
        lost_deliveries: int | None = None,
    ) -> ConsumerConfig:
        attempts = limits.attempts if attempts is None else attempts
        lost = limits.lost_deliveries if lost_deliveries is None else lost_deliveries
        return ConsumerConfig(
            durable_name=self.rollout_consumer(agent),
            description=f"rollout workers for agent {agent}",
            filter_subject=self.tasks_subject(agent),
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=limits.ack_wait_s if ack_wait_s is None else ack_wait_s,
            max_deliver=attempts + lost + 1,
            max_ack_pending=limits.max_ack_pending,
            max_waiting=limits.max_waiting,
        )
