"""Environment services as the NATS service API shows them: ``$SRV.STATS`` from every worker.

A request to ``$SRV.STATS`` reaches every service instance on the server; each answers once,
so the replies are gathered on one inbox until none came for ``quiet_s`` (or ``timeout_s`` in
all). With no service at all the server answers no-responders at once. Workers of another
prefix, and services that are not environment workers, are left out (the ``kind`` and
``prefix`` in their metadata). The per-worker figures are ``schemas.EnvWorkerStats``, the
custom data of each worker's ``start`` endpoint.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from agentarium.schemas import EnvWorkerStats, SchemaError

from .topology import Topology

ENV_SERVICE_KIND = "agentarium-env"  # every environment worker's metadata "kind"
STATS_SUBJECT = "$SRV.STATS"


@dataclass
class EnvServiceStatus:
    """One environment (all the workers serving it) and its workers' own figures."""

    env: str
    service: str
    workers: list[dict[str, Any]] = field(default_factory=list)  # EnvWorkerStats, JSON form
    sessions: int = 0
    capacity: int = 0
    starts: int = 0
    starts_per_s: float = 0.0
    steps: int = 0
    errors: int = 0
    expired: int = 0
    rejected: int = 0
    accepting: int = 0  # workers listening on the start subject now (with room)
    step_p50_ms: float = 0.0  # the highest worker's: no exact merge of percentiles
    step_p99_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def gather_replies(
    nc: Client, subject: str, *, timeout_s: float = 1.0, quiet_s: float = 0.2
) -> list[Msg]:
    """Every reply to one request on ``subject`` until ``quiet_s`` passes without one."""
    inbox = nc.new_inbox()
    replies: list[Msg] = []
    arrived = asyncio.Event()
    done = asyncio.Event()

    async def on_reply(msg: Msg) -> None:
        if msg.headers and msg.headers.get("Status") == "503":  # no responders
            done.set()
            return
        replies.append(msg)
        arrived.set()

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, b"", reply=inbox)
        end = time.monotonic() + timeout_s
        while not done.is_set():
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            wait = remaining if not replies else min(quiet_s, remaining)
            arrived.clear()
            waiters = [asyncio.ensure_future(arrived.wait()), asyncio.ensure_future(done.wait())]
            finished, pending = await asyncio.wait(
                waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
            if not finished:
                break  # quiet: everyone who was going to answer has
    finally:
        await sub.unsubscribe()
    return replies


async def collect_env_status(
    nc: Client, topo: Topology, *, timeout_s: float = 1.0, quiet_s: float = 0.2
) -> list[EnvServiceStatus]:
    """The environment services of ``topo``'s prefix, with each worker's figures."""
    services: dict[str, EnvServiceStatus] = {}
    for msg in await gather_replies(nc, STATS_SUBJECT, timeout_s=timeout_s, quiet_s=quiet_s):
        try:
            stats = json.loads(msg.data)
        except ValueError:
            continue
        meta = stats.get("metadata") or {}
        if meta.get("kind") != ENV_SERVICE_KIND or meta.get("prefix") != topo.prefix:
            continue
        data = next(
            (e.get("data") for e in stats.get("endpoints") or [] if e.get("name") == "start"),
            None,
        )
        try:
            worker = EnvWorkerStats.from_wire(data or {})
        except SchemaError:
            continue
        env = meta.get("env") or worker.env
        row = services.setdefault(env, EnvServiceStatus(env=env, service=str(stats.get("name"))))
        row.workers.append(worker.to_wire(binary=False))
        row.sessions += worker.sessions
        row.capacity += worker.capacity
        row.starts += worker.starts
        row.starts_per_s = round(row.starts_per_s + worker.starts_per_s, 3)
        row.steps += worker.steps
        row.errors += worker.errors
        row.expired += worker.expired
        row.rejected += worker.rejected
        row.accepting += int(worker.accepting)
        row.step_p50_ms = max(row.step_p50_ms, worker.step_p50_ms)
        row.step_p99_ms = max(row.step_p99_ms, worker.step_p99_ms)
    for row in services.values():
        row.workers.sort(key=lambda w: w["worker"])
    return sorted(services.values(), key=lambda s: s.env)


def format_env_status(services: list[EnvServiceStatus], *, workers: bool = True) -> str:
    lines = [
        f"{'environment':<16} {'workers':>7} {'sessions':>13} {'starts/s':>9} {'steps':>8} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'expired':>7}"
    ]
    for s in services:
        lines.append(
            f"{s.env:<16} {len(s.workers):>7} {f'{s.sessions}/{s.capacity}':>13} "
            f"{s.starts_per_s:>9.1f} {s.steps:>8} {s.step_p50_ms:>8.1f} {s.step_p99_ms:>8.1f} "
            f"{s.errors:>6} {s.expired:>7}"
        )
        if workers:
            for w in s.workers:
                state = ""
                if w["draining"]:
                    state = "draining"
                elif not w["accepting"]:
                    full = w["sessions"] + w["starting"] >= w["capacity"]
                    state = "full" if full else f"{w['starting']} starting"
                lines.append(
                    f"  {w['worker']:<40} sessions={w['sessions']}/{w['capacity']} "
                    f"starts={w['starts']} steps={w['steps']} p50={w['step_p50_ms']:.1f}ms "
                    f"p99={w['step_p99_ms']:.1f}ms errors={w['errors']} expired={w['expired']}"
                    + (f"  ({state})" if state else "")
                )
    if not services:
        lines.append("(no environment workers: start one with `agentarium env serve sql`)")
    return "\n".join(lines)
