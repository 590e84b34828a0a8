"""The names other processes (and other languages' clients) rely on, pinned.

Moving code must never rename a subject, stream, durable, bucket or key: a consumer of an older
release would silently stop seeing jobs. docs/design.md lists the same names.
"""

from __future__ import annotations

from agentarium.broker import Limits, Topology
from agentarium.inference import engine_key, object_name


def test_default_prefix_names():
    t = Topology()
    assert t.prefix == "agentarium"
    assert (t.tasks_stream, t.trajectories_stream, t.dead_stream, t.metrics_stream) == (
        "AGENTARIUM_TASKS",
        "AGENTARIUM_TRAJECTORIES",
        "AGENTARIUM_DEAD",
        "AGENTARIUM_METRICS",
    )
    assert (t.policy_bucket, t.workers_bucket, t.weights_bucket, t.engines_bucket) == (
        "agentarium-policy",
        "agentarium-workers",
        "agentarium-weights",
        "agentarium-engines",
    )
    assert t.tasks_subject("calc") == "agentarium.tasks.calc"
    assert t.trajectory_subject("r1", "calc", "j1") == "agentarium.trajectories.r1.calc.j1"
    assert t.trajectories_filter() == "agentarium.trajectories.*.*.*"
    assert t.trajectories_filter("r1", "calc") == "agentarium.trajectories.r1.calc.*"
    assert t.dead_subject("calc") == "agentarium.dead.calc"
    assert t.dead_subject("bad name") == "agentarium.dead._invalid"
    assert t.rollout_consumer("calc") == "rollout-calc"
    assert t.metrics_subject("r1") == "agentarium.metrics.r1"
    assert t.demand_subject("r1", "a1") == "agentarium.demand.r1.a1"
    assert t.demand_queue("r1", "a1") == "agentarium-refill-r1-a1"
    # a worker's registry entry written directly with its own TTL (nats-server 2.11+)
    assert t.worker_subject("w1") == "$KV.agentarium-workers.w1"
    # the syncer's engine record: <run>.<16 hex of the URL's sha256>
    assert engine_key("r1", "http://127.0.0.1:30000") == "r1.0efdded5ae1f69f9"
    assert t.trainer_consumer("r1", "calc") == "trainer-r1-calc"
    assert t.legacy_trainer_consumer("r1") == "trainer-r1"  # adopted once, then deleted
    assert t.agent_of_subject("agentarium.tasks.calc") == "calc"
    # environment services: start through the queue group, then the session's own subject
    assert t.env_service("sql") == "agentarium-env-sql"  # micro service name = queue group
    assert t.env_start_subject("sql") == "agentarium.env.sql.start"
    assert t.env_session_subject("sql", "h-1-ab", "s1") == "agentarium.env.sql.s.h-1-ab.s1"
    assert t.env_sessions_filter("sql", "h-1-ab") == "agentarium.env.sql.s.h-1-ab.*"
    assert object_name("r1", 3) == "r1/v3"  # object store name; the policy KV key is the run
    # failed runs per job, so that lost deliveries spend no attempt
    assert t.attempts_bucket == "agentarium-attempts"
    assert t.attempts_key("calc", "j1") == "calc.j1"


def test_stream_subjects_and_durable_config():
    t = Topology("acme")
    streams = {c.name: c for c in t.stream_configs(Limits())}
    assert {name: list(c.subjects) for name, c in streams.items()} == {
        "ACME_TASKS": ["acme.tasks.>"],
        "ACME_TRAJECTORIES": ["acme.trajectories.>"],
        "ACME_DEAD": ["acme.dead.>"],
        "ACME_METRICS": ["acme.metrics.>"],
    }
    durable = t.rollout_consumer_config("calc", Limits())
    assert durable.durable_name == "rollout-calc"
    assert durable.filter_subject == "acme.tasks.calc"
    assert (t.policy_bucket, t.workers_bucket, t.weights_bucket, t.engines_bucket) == (
        "acme-policy",
        "acme-workers",
        "acme-weights",
        "acme-engines",
    )
    assert t.attempts_bucket == "acme-attempts"
    assert durable.max_deliver == 3 + 5 + 1  # attempts, lost deliveries, the dead-letter one
