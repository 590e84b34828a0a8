"""Idempotent provisioning: make every stream, consumer and bucket match its definition.

Provisioning is a diff: each object is created when missing, updated in place when one
of the settings we own differs, and left alone otherwise, so ``broker init`` is safe to
run on every start. Changes the server cannot make safely are refused with a message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, KeyValueConfig, ObjectStoreConfig, StorageType, StreamConfig

from .errors import ProvisioningError
from .limits import Limits
from .patience import patiently
from .topology import Topology
from .version import DISCARD_NEW_BYTES_SINCE, MSG_TTL_SINCE, format_version, js_server_version

log = structlog.get_logger("agentarium.broker")

# Settings compared for streams (the rest are server defaults we do not own).
_STREAM_KEYS = (
    "subjects",
    "retention",
    "storage",
    "discard",
    "max_msgs",
    "max_bytes",
    "max_age",
    "duplicate_window",
    "num_replicas",
    "max_msgs_per_subject",
)
_CONSUMER_KEYS = (
    "filter_subject",
    "ack_wait",
    "max_deliver",
    "max_ack_pending",
    "max_waiting",
    "ack_policy",
)
_IMMUTABLE = ("retention", "storage")


@dataclass
class ProvisionReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    def merge(self, other: ProvisionReport) -> ProvisionReport:
        self.created += other.created
        self.updated += other.updated
        self.unchanged += other.unchanged
        return self


def _norm(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return sorted(value)
    return getattr(value, "value", value)


def _diff(want, have, keys) -> dict[str, tuple]:
    out = {}
    for key in keys:
        wanted = getattr(want, key, None)
        if wanted is None:
            continue
        if key == "num_replicas" and wanted == 1 and not getattr(have, key, None):
            continue
        got = getattr(have, key, None)
        if _norm(wanted) != _norm(got):
            out[key] = (got, wanted)
    return out


async def ensure_stream(
    js: JetStreamContext, want: StreamConfig, *, update: bool = True
) -> ProvisionReport:
    report = ProvisionReport()
    assert want.name, "a stream definition needs a name"
    try:
        info = await js.stream_info(want.name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(want)
        log.info("stream created", stream=want.name)
        report.created.append(f"stream {want.name}")
        return report
    changes = _diff(want, info.config, _STREAM_KEYS) if update else {}
    if not changes:
        report.unchanged.append(f"stream {want.name}")
        return report
    frozen = [k for k in changes if k in _IMMUTABLE]
    if frozen:
        raise ProvisioningError(
            f"stream {want.name}: {frozen} cannot change on an existing stream "
            f"(have {[changes[k][0] for k in frozen]}, want {[changes[k][1] for k in frozen]}); "
            "drain it and delete it first, or keep the old setting"
        )
    if (
        "num_replicas" in changes
        and want.retention is not None
        and _norm(want.retention) == "workqueue"
    ):
        raise ProvisioningError(
            f"stream {want.name}: changing replicas {changes['num_replicas'][0]} -> "
            f"{changes['num_replicas'][1]} on a work-queue stream is not safe here: drain the "
            "queue, delete the stream and run `agentarium broker init` again with --replicas"
        )
    merged = info.config
    for key, (_, wanted) in changes.items():
        setattr(merged, key, wanted)
    try:
        await js.update_stream(merged)
    except nats.js.errors.APIError as exc:
        raise ProvisioningError(
            f"stream {want.name}: update {sorted(changes)} refused: {exc.description}"
        ) from exc
    log.info("stream updated", stream=want.name, changes={k: v[1] for k, v in changes.items()})
    report.updated.append(f"stream {want.name}")
    return report


async def ensure_consumer(
    js: JetStreamContext,
    stream: str,
    want: ConsumerConfig,
    *,
    keys: tuple[str, ...] = _CONSUMER_KEYS,
) -> ProvisionReport:
    """Create the consumer, or update the settings named in ``keys`` when they differ.

    A worker passes only the keys its own flags decide (ack wait, deliveries), so it never
    reverts what an operator set with ``broker init`` (max_ack_pending, max_waiting).
    """
    report = ProvisionReport()
    name = want.durable_name
    assert name, "a rollout consumer is durable: its definition needs durable_name"
    try:
        info = await js.consumer_info(stream, name)
    except nats.js.errors.NotFoundError:
        await js.add_consumer(stream, want)
        log.info("consumer created", stream=stream, consumer=name)
        report.created.append(f"consumer {stream}/{name}")
        return report
    changes = _diff(want, info.config, keys)
    if not changes:
        report.unchanged.append(f"consumer {stream}/{name}")
        return report
    merged = info.config
    for key, (_, wanted) in changes.items():
        setattr(merged, key, wanted)
    try:
        await js.add_consumer(stream, merged)  # same durable name = update on 2.9+
    except nats.js.errors.APIError as exc:
        raise ProvisioningError(
            f"consumer {stream}/{name}: update {sorted(changes)} refused by the server "
            f"({exc.description}); delete the consumer when no worker runs and retry"
        ) from exc
    log.info(
        "consumer updated",
        stream=stream,
        consumer=name,
        changes={k: v[1] for k, v in changes.items()},
    )
    report.updated.append(f"consumer {stream}/{name}")
    return report


async def _ensure_bucket_stream(
    js, stream_name: str, label: str, create, want_settings: dict, *, update: bool = True
) -> ProvisionReport:
    report = ProvisionReport()
    try:
        info = await js.stream_info(stream_name)
    except nats.js.errors.NotFoundError:
        await create()
        log.info("bucket created", bucket=label)
        report.created.append(f"bucket {label}")
        return report
    config = info.config
    changes = (
        {}
        if not update
        else {
            k: (getattr(config, k), v)
            for k, v in want_settings.items()
            if _norm(getattr(config, k)) != _norm(v)
        }
    )
    if not changes:
        report.unchanged.append(f"bucket {label}")
        return report
    if "num_replicas" in changes:
        raise ProvisioningError(
            f"bucket {label}: replicas {changes['num_replicas'][0]} -> {changes['num_replicas'][1]} "
            "needs a new bucket: copy it out, delete it and run broker init again"
        )
    for key, (_, wanted) in changes.items():
        setattr(config, key, wanted)
    if config.max_age and config.duplicate_window and config.duplicate_window > config.max_age:
        config.duplicate_window = config.max_age  # the server refuses a window longer than max age
    try:
        await js.update_stream(config)
    except nats.js.errors.APIError as exc:
        raise ProvisioningError(
            f"bucket {label}: update {sorted(changes)} refused: {exc.description}"
        ) from exc
    log.info("bucket updated", bucket=label, changes={k: v[1] for k, v in changes.items()})
    report.updated.append(f"bucket {label}")
    return report


async def ensure_buckets(
    js: JetStreamContext, topo: Topology, limits: Limits, *, update: bool = True
) -> ProvisionReport:
    report = ProvisionReport()
    policy = KeyValueConfig(
        bucket=topo.policy_bucket,
        description="latest WeightUpdate per run (JSON)",
        history=limits.policy_history,
        storage=StorageType.FILE,
        replicas=limits.replicas,
    )
    workers = KeyValueConfig(
        bucket=topo.workers_bucket,
        description="live rollout workers and their counters",
        history=1,
        ttl=limits.workers_ttl_s,
        storage=StorageType.FILE,
        replicas=limits.replicas,
    )
    engines = KeyValueConfig(
        bucket=topo.engines_bucket,
        description="each engine's weight version, written by its syncer (JSON)",
        history=1,
        ttl=limits.engines_ttl_s,
        storage=StorageType.FILE,
        replicas=limits.replicas,
    )
    attempts = KeyValueConfig(
        bucket=topo.attempts_bucket,
        description="failed runs per job (<agent>.<job_id>), so lost deliveries spend no attempt",
        history=1,
        ttl=limits.attempts_ttl_s,
        storage=StorageType.FILE,
        replicas=limits.replicas,
    )
    weights = ObjectStoreConfig(
        bucket=topo.weights_bucket,
        description="policy weights (safetensors), <run>/v<version>",
        storage=StorageType.FILE,
        replicas=limits.replicas,
        max_bytes=limits.weights_max_bytes,
    )
    workers_settings: dict = {"max_age": limits.workers_ttl_s, "num_replicas": limits.replicas}
    if js_server_version(js) >= MSG_TTL_SINCE:
        # per-entry TTLs for the registry (broker.registry); a bucket made on 2.9 lacks it.
        # The server can turn it on for an existing stream, never off again.
        workers_settings["allow_msg_ttl"] = True
    report.merge(
        await _ensure_bucket_stream(
            js,
            f"KV_{topo.policy_bucket}",
            topo.policy_bucket,
            lambda: js.create_key_value(policy),
            {"max_msgs_per_subject": limits.policy_history, "num_replicas": limits.replicas},
            update=update,
        )
    )
    report.merge(
        await _ensure_bucket_stream(
            js,
            f"KV_{topo.workers_bucket}",
            topo.workers_bucket,
            lambda: js.create_key_value(workers),
            workers_settings,
            update=update,
        )
    )
    report.merge(
        await _ensure_bucket_stream(
            js,
            f"KV_{topo.attempts_bucket}",
            topo.attempts_bucket,
            lambda: js.create_key_value(attempts),
            {"max_age": limits.attempts_ttl_s, "num_replicas": limits.replicas},
            update=update,
        )
    )
    report.merge(
        await _ensure_bucket_stream(
            js,
            f"KV_{topo.engines_bucket}",
            topo.engines_bucket,
            lambda: js.create_key_value(engines),
            {"max_age": limits.engines_ttl_s, "num_replicas": limits.replicas},
            update=update,
        )
    )
    report.merge(
        await _ensure_bucket_stream(
            js,
            f"OBJ_{topo.weights_bucket}",
            topo.weights_bucket,
            lambda: js.create_object_store(topo.weights_bucket, weights),
            {"num_replicas": limits.replicas, "max_bytes": limits.weights_max_bytes},
            update=update,
        )
    )
    return report


_warned_byte_limit = False


def stream_configs(js: JetStreamContext, topo: Topology, limits: Limits) -> list[StreamConfig]:
    """``topo.stream_configs(limits)`` fitted to the connected server: before nats-server
    2.10.5 a discard-new stream gets no byte limit (its message limit stays, and is exact),
    since such a server, once the byte limit is reached, deletes the oldest messages (jobs
    not yet run) to make room (broker/version.py). Logged once per process."""
    global _warned_byte_limit
    configs = topo.stream_configs(limits)
    version = js_server_version(js)
    if version >= DISCARD_NEW_BYTES_SINCE:  # an unknown version (0.0.0) is treated as 2.9
        return configs
    for config in configs:
        if _norm(config.discard) == "new" and (config.max_bytes or -1) > 0:
            if not _warned_byte_limit:
                _warned_byte_limit = True
                log.warning(
                    "this nats-server drops the oldest messages of a full discard-new stream "
                    "(fixed in 2.10.5): the job queue gets no byte limit, only its message "
                    "limit; upgrade nats-server to have both",
                    stream=config.name,
                    server=format_version(version),
                    max_bytes=config.max_bytes,
                    max_msgs=config.max_msgs,
                )
            config.max_bytes = -1
    return configs


def _job_streams(topo: Topology) -> tuple[str, ...]:
    """What jobs need to flow. The live-view objects (the metrics stream, the engines KV) are
    left to ``provision``: a service started against a broker provisioned by an older release
    must not fail, or try what its role may not do, over a view (``broker init`` adds them)."""
    return (topo.tasks_stream, topo.trajectories_stream, topo.dead_stream)


async def ensure_streams(
    js: JetStreamContext,
    topo: Topology,
    limits: Limits | None = None,
    *,
    patience_s: float = 0.0,
) -> list[str]:
    """Create the missing streams only, never updating one: what a producer needs, and all
    that its least-privilege role may look at (no buckets). With ``patience_s`` a broker that
    is restarting or electing a leader is waited for that long (``patience.patiently``)."""

    async def once() -> list[str]:
        created: list[str] = []
        for config in stream_configs(js, topo, limits or Limits()):
            if config.name in _job_streams(topo):
                created += (await ensure_stream(js, config, update=False)).created
        return created

    return await patiently(once, patience_s=patience_s, what="checking the job streams")


async def ensure_provisioned(
    js: JetStreamContext,
    topo: Topology,
    limits: Limits | None = None,
    *,
    patience_s: float = 0.0,
) -> bool:
    """When a stream or bucket that jobs need is missing, create whatever is missing (with
    ``limits`` or defaults); never update what exists, so every service may call it on start
    without reverting an operator's ``broker init``.
    Returns True if anything was created. On a cluster run ``broker init --replicas 3``
    first: a stream created here gets ``limits``' replicas. With ``patience_s`` a broker that
    is restarting or electing a leader is waited for that long (``patience.patiently``)."""

    async def once() -> bool:
        try:  # the common case, and all a least-privilege role may look at: everything exists
            for name in _job_streams(topo):
                await js.stream_info(name)
            await js.key_value(topo.workers_bucket)
            await js.key_value(topo.policy_bucket)
            return False
        except nats.js.errors.NotFoundError:
            pass
        report = await provision(js, topo, limits, update=False)
        return bool(report.created)

    return await patiently(once, patience_s=patience_s, what="checking the broker's streams")


async def provision(
    js: JetStreamContext,
    topo: Topology,
    limits: Limits | None = None,
    *,
    agents: tuple[str, ...] = (),
    update: bool = True,
) -> ProvisionReport:
    """Create or update everything in docs/design.md's "NATS objects" table (and rollout consumers for ``agents``).
    With ``update=False`` existing objects are left exactly as they are."""
    limits = limits or Limits()
    report = ProvisionReport()
    for stream in stream_configs(js, topo, limits):
        report.merge(await ensure_stream(js, stream, update=update))
    report.merge(await ensure_buckets(js, topo, limits, update=update))
    for agent in agents:
        report.merge(
            await ensure_consumer(
                js,
                topo.tasks_stream,
                topo.rollout_consumer_config(agent, limits),
                keys=_CONSUMER_KEYS if update else (),
            )
        )
    return report
