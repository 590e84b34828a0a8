"""Provisioning, status and the broker commands against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from agentarium.broker import Limits, NatsSettings, ProvisioningError, Topology, provision
from agentarium.broker.errors import BrokerUnavailable
from agentarium.broker.provision import ensure_provisioned, ensure_streams
from agentarium.broker.status import collect_status, format_status
from agentarium.broker.sweep import format_sweep, sweep_stranded
from agentarium.producers import TaskProducer
from agentarium.schemas import Job, Trajectory, decode, encode


@pytest.mark.nats_semantics
async def test_provision_is_idempotent_and_a_diff(nc, topology):
    js = nc.jetstream()
    first = await provision(js, topology, agents=("toy",))
    assert len(first.created) == 10 and not first.updated
    again = await provision(js, topology, agents=("toy",))
    assert not again.created and not again.updated and len(again.unchanged) == 10
    changed = await provision(
        js, topology, Limits(tasks_max_msgs=50, ack_wait_s=20), agents=("toy",)
    )
    assert changed.updated == ["stream AGENTARIUM_TASKS", "consumer AGENTARIUM_TASKS/rollout-toy"]
    info = await js.stream_info(topology.tasks_stream)
    assert info.config.max_msgs == 50 and info.config.duplicate_window == 3600
    consumer = await js.consumer_info(topology.tasks_stream, "rollout-toy")
    assert consumer.config.ack_wait == 20 and consumer.config.max_deliver == 3 + 5 + 1


@pytest.mark.nats_semantics
async def test_unsafe_change_is_refused_with_a_message(nc, topology):
    js = nc.jetstream()
    await provision(js, topology)
    with pytest.raises(ProvisioningError, match="work-queue stream is not safe"):
        await provision(js, topology, Limits(replicas=3))


@pytest.mark.nats_semantics
async def test_ensure_provisioned_creates_only_what_is_missing(nc, topology):
    js = nc.jetstream()
    await provision(js, topology, Limits(tasks_max_msgs=10, workers_ttl_s=7))
    await js.delete_key_value(topology.policy_bucket)
    assert await ensure_provisioned(js, topology) is True
    assert (await js.stream_info(topology.tasks_stream)).config.max_msgs == 10  # not reverted
    assert (await js.stream_info(f"KV_{topology.workers_bucket}")).config.max_age == 7
    await js.key_value(topology.policy_bucket)  # recreated
    assert await ensure_provisioned(js, topology) is False


@pytest.mark.nats_semantics
async def test_start_up_checks_wait_for_a_restarting_broker_then_say_so(nats_server, nc, topology):
    js = nc.jetstream(timeout=1)  # requests sent while the server is away fail sooner
    await provision(js, topology)
    nats_server.stop()
    waiting = asyncio.create_task(ensure_provisioned(js, topology, patience_s=30))
    await asyncio.sleep(1.0)  # the outage under test: the checks meet it, then it ends
    assert not waiting.done()
    nats_server.start()
    assert await asyncio.wait_for(waiting, 30) is False  # everything was there all along
    nats_server.stop()
    with pytest.raises(BrokerUnavailable, match=r"did not answer for 1s .*broker status"):
        await ensure_streams(js, topology, patience_s=1)
    nats_server.start()


@pytest.mark.nats_semantics
async def test_status_jobs_before_the_first_consumer_are_waiting_not_stranded(js, topology):
    await TaskProducer(js, topology).submit("nobody", [{"n": i} for i in range(3)], run="r")
    status = await collect_status(js, topology)
    [row] = status.agents
    assert (row.agent, row.waiting, row.stranded, row.has_consumer) == ("nobody", 3, 0, False)
    [note] = status.notes
    assert "3 jobs wait for their first consumer" in note and "rollout-nobody" in note
    text = format_status(status)
    [line] = [ln for ln in text.splitlines() if ln.startswith("nobody")]
    assert line.split()[:7] == ["nobody", "3", "0", "0", "0", "-", "0"], line
    assert line.endswith("(no consumer yet)") and "live workers: 0" in text
    # once the consumer exists it holds them all: pending, still nothing stranded
    await provision(js, topology, agents=("nobody",))
    [row] = (await collect_status(js, topology)).agents
    assert (row.waiting, row.pending, row.stranded, row.has_consumer) == (3, 3, 0, True)
    assert "no consumer yet" not in format_status(await collect_status(js, topology))


@pytest.mark.nats_semantics
async def test_sweep_removes_the_stranded_jobs_already_done_and_keeps_the_rest(
    js, topology, nats_url
):
    """A consumer made by hand with max_deliver 1 gives up on three jobs it nak'd: they stay in
    the work queue below its ack floor, never to be delivered again (stranded). Two of them
    have a trajectory stored (done: a lost ack); the sweep removes those two, keeps the one
    that may never have run, and never touches the job still waiting above the ack floor."""
    producer = TaskProducer(js, topology)
    ids = (await producer.submit("toy", [{"n": 0}], run="r")).job_ids
    # one job from another language's client: JSON, said so in its header
    json_job = {"job_id": "json-1", "agent": "toy", "run": "r", "task": {"n": 1}}
    await js.publish(
        topology.tasks_subject("toy"),
        json.dumps(json_job).encode(),
        headers={"Content-Type": "application/json", "Nats-Msg-Id": "json-1"},
    )
    ids += ["json-1"] + (await producer.submit("toy", [{"n": 2}], run="r")).job_ids
    await js.add_consumer(
        topology.tasks_stream,
        ConsumerConfig(
            durable_name=topology.rollout_consumer("toy"),
            filter_subject=topology.tasks_subject("toy"),
            ack_policy=AckPolicy.EXPLICIT,
            max_deliver=1,
            ack_wait=1,
        ),
    )
    pull = await js.pull_subscribe_bind(topology.rollout_consumer("toy"), topology.tasks_stream)
    for msg in await pull.fetch(3, timeout=5):
        await msg.nak()

    async def in_flight() -> int:
        info = await js.consumer_info(topology.tasks_stream, topology.rollout_consumer("toy"))
        return info.num_ack_pending

    # The server gives up on a nak'd job (no deliveries left) once its ack wait is over and a
    # pull request makes it look at its redeliveries.
    async with asyncio.timeout(10):
        while await in_flight():
            with contextlib.suppress(nats.errors.TimeoutError):
                await pull.fetch(1, timeout=0.2)  # nothing left to deliver: only the look
    # The next job's ack, with nothing else pending, moves the ack floor past all four.
    ids += (await producer.submit("toy", [{"n": 3}], run="r")).job_ids
    [fourth] = await pull.fetch(1, timeout=5)
    await fourth.ack_sync()
    ids += (await producer.submit("toy", [{"n": 4}], run="r")).job_ids  # waits above the floor
    for job_id in ids[:2]:
        done = Trajectory(
            job_id=job_id, agent="toy", run="r", task_id="t", group_id="g", status="ok", reward=1.0
        )
        await js.publish(topology.trajectory_subject("r", "toy", job_id), encode(done))
    status = await collect_status(js, topology)
    [row] = status.agents
    assert (row.waiting, row.pending, row.in_flight, row.stranded) == (4, 1, 0, 3)
    assert any("3 stranded jobs" in n and "broker sweep --agent toy" in n for n in status.notes)

    [dry] = await sweep_stranded(js, topology, dry_run=True)
    assert (dry.ack_floor, dry.stranded, dry.removed, dry.kept) == (4, 3, 2, 1)
    assert dry.to_json()["dry_run"] is True
    with pytest.raises(ValueError, match="no rollout consumer for agent.*nobody"):
        await sweep_stranded(js, topology, agents=("toy", "nobody"))  # checked before deleting
    assert (await js.stream_info(topology.tasks_stream)).state.messages == 4  # nothing deleted
    assert ids[2] in format_sweep([dry])
    run = await asyncio.to_thread(
        agentarium, "broker", "sweep", "--agent", "toy", "--nats-url", nats_url
    )
    assert run.returncode == 0, run.stderr
    header, row_line, kept = run.stdout.splitlines()
    assert header.split() == ["agent", "ack", "floor", "stranded", "removed", "kept"]
    assert row_line.split() == ["toy", "4", "3", "2", "1"]
    assert "kept 1 stranded job(s)" in kept and f"{ids[2]} (seq 3, no trajectory stored)" in kept
    assert "re-publish" in kept
    [row] = (await collect_status(js, topology)).agents
    assert (row.waiting, row.pending, row.stranded) == (2, 1, 1)  # the kept one, the waiting one
    left = [await js.get_msg(topology.tasks_stream, seq) for seq in (3, 5)]
    assert [decode(Job, m.data).job_id for m in left] == [ids[2], ids[4]]
    with pytest.raises(ValueError, match="no rollout consumer for agent.*nobody"):
        await sweep_stranded(js, topology, agents=("nobody",))
    [again] = await sweep_stranded(js, topology)  # idempotent: the kept one stays kept
    assert (again.stranded, again.removed, again.kept) == (1, 0, 1)


def agentarium(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentarium", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.nats_semantics
def test_broker_init_and_status_commands(nats_url):
    init = agentarium("broker", "init", "--nats-url", nats_url, "--agent", "toy")
    assert init.returncode == 0, init.stderr
    assert "created: 10" in init.stdout
    assert (
        "created: 0  updated: 0  unchanged: 10"
        in agentarium("broker", "init", "--nats-url", nats_url, "--agent", "toy").stdout
    )
    status = agentarium("broker", "status", "--json", "--nats-url", nats_url)
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["agents"][0]["agent"] == "toy" and data["agents"][0]["has_consumer"] is True


@pytest.mark.nats_semantics
@pytest.mark.parametrize("when", ["nats-server running", "created:"])
def test_broker_up_exits_cleanly_on_sigterm(tmp_path, when):
    """SIGTERM, a supervisor's stop signal, stops nats-server and the command itself (exit 0),
    whenever it comes.
    ``--sync-interval always`` is written into the server's config on 2.10+, and left out
    with a warning before."""
    from agentarium.broker import find_nats_server, free_port
    from agentarium.broker.version import SYNC_INTERVAL_SINCE, binary_version

    port = free_port()
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentarium", "broker", "up", "--port", str(port),
             "--store", str(tmp_path / "nats"), "--sync-interval", "always"],
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    try:
        # SIGTERM once the server runs (provisioning under way: its event loop defers the
        # signal), or once provisioning printed its report (its loop may still be closing)
        output = []
        for line in proc.stdout:
            output.append(line)
            if line.startswith(when):
                break
        assert output and output[-1].startswith(when), (
            "".join(output) + (tmp_path / "stderr").read_text()
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, (tmp_path / "stderr").read_text()
        with pytest.raises(OSError):  # nats-server stopped with it
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        config = tmp_path / "nats" / "agentarium-nats.conf"
        if binary_version(find_nats_server()) >= SYNC_INTERVAL_SINCE:
            assert 'sync_interval: "always"' in config.read_text()
        else:
            assert not config.exists()
            assert "sync_interval needs nats-server 2.10+" in (tmp_path / "stderr").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.nats_semantics
async def test_broker_up_refuses_a_port_another_server_holds(nats_server, nc, tmp_path):
    """Another process's nats-server on the port: broker up fails in one line naming the port,
    and provisions nothing there (it used to adopt the socket and fill the other server)."""
    result = agentarium(
        "broker", "up", "--port", str(nats_server.port), "--store", str(tmp_path / "mine"),
        timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {nats_server.port}" in lines[0], result.stderr
    assert "already in use" in lines[0] and "Traceback" not in result.stderr
    assert "created:" not in result.stdout
    names = [info.config.name async for info in _streams(nc.jetstream())]
    assert names == [], names  # the other server holds no Agentarium stream


async def _streams(js):
    for info in await js.streams_info():
        yield info


@pytest.mark.nats_semantics
def test_broker_up_fails_when_its_server_dies(tmp_path):
    """The server killed under broker up (SIGKILL, as the OOM killer would): the command exits
    1 with the signal and the server's last log lines, so a supervisor restarts it."""
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentarium", "broker", "up", "--port", "0",
             "--store", str(tmp_path / "nats")],
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
        try:
            for line in proc.stdout:
                if line.startswith("created:"):
                    break
            pids = list((tmp_path / "nats" / "ports").glob("*.ports"))
            assert len(pids) == 1, pids
            server_pid = int(pids[0].stem.rsplit("_", 1)[1])
            os.kill(server_pid, signal.SIGKILL)
            assert proc.wait(timeout=30) == 1
            err.seek(0)
            text = err.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    assert f"nats-server (pid {server_pid}) exited on its own (SIGKILL)" in text, text
    assert "nats-server.log" in text and "Traceback" not in text


@pytest.mark.parametrize("port", ["-1", "70000", "x"])
def test_broker_up_refuses_a_port_out_of_range_at_once(port, tmp_path):
    result = agentarium("broker", "up", "--port", port, "--store", str(tmp_path), timeout=30)
    assert result.returncode == 2 and "--port" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("init", "--ack-wait", "-1"),
        ("init", "--ack-wait", "0"),  # the consumer's rule: >= 3 (it used to become 30 s)
        ("init", "--max-ack-pending", "-5"),
        ("init", "--tasks-max-msgs", "-1"),  # it used to remove the queue's limit
        ("init", "--tasks-max-bytes", "0"),
        ("init", "--max-waiting", "0"),
        ("init", "--duplicate-window", "0"),
        ("up", "--ack-wait", "2"),
    ],
)
def test_broker_limits_are_refused_before_anything_starts(command, flag, value, tmp_path):
    """One rule per setting, whichever door: a value the server would store (or silently
    replace) is refused in one line naming the flag, before a connection or a server."""
    where = {
        "init": ["--nats-url", "nats://127.0.0.1:1"],
        "up": ["--port", "0", "--store", str(tmp_path)],
    }[command]
    result = agentarium("broker", command, flag, value, *where, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert flag in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "ports").exists()  # broker up started no server


def test_commands_fail_fast_without_a_broker():
    from agentarium.broker import free_port

    result = agentarium(
        "broker", "status", "--nats-url", f"nats://127.0.0.1:{free_port()}", timeout=30
    )
    assert result.returncode == 2
    assert "cannot connect to NATS" in result.stderr and "agentarium broker up" in result.stderr


async def test_connect_error_is_translated():
    from agentarium.broker import free_port

    with pytest.raises(BrokerUnavailable, match="cannot connect"):
        await NatsSettings(url=f"nats://127.0.0.1:{free_port()}", connect_timeout_s=1).connect()


def test_settings_from_env_and_validation():
    env = {"AGENTARIUM_NATS_URL": "nats://a:1,nats://b:2", "AGENTARIUM_NATS_TOKEN": "t"}
    settings = NatsSettings.from_env(env, prefix="x")
    assert settings.servers == ["nats://a:1", "nats://b:2"] and settings.prefix == "x"
    assert settings.redacted()["token"] == "***"
    assert NatsSettings.from_env(env, url="nats://c:3").url == "nats://c:3"
    with pytest.raises(ValueError, match="needs a scheme"):
        NatsSettings(url="localhost:4222")
    with pytest.raises(ValueError, match="go together"):
        NatsSettings(user="u")


def test_topology_rejects_names_that_would_reroute():
    topo = Topology()
    assert topo.tasks_subject("toy") == "agentarium.tasks.toy"
    assert topo.trajectory_subject("r1", "toy", "j-1") == "agentarium.trajectories.r1.toy.j-1"
    for bad in ("a.b", "a*", "a>", "a b", ""):
        with pytest.raises(ValueError, match="not a valid name"):
            topo.tasks_subject(bad)
    assert topo.dead_subject("a.b") == "agentarium.dead._invalid"


async def test_removing_a_worker_from_a_broker_that_does_not_answer_is_not_an_error(
    nc, js, topology, nats_server
):
    # A worker's last act on stopping; a broker that is slow (an election, a restart) then
    # made a drained consumer exit 2 (found by tests/chaos: a cluster's node restarted).
    from frozen import frozen

    from agentarium.broker.registry import live_workers, publish_worker, remove_worker

    await publish_worker(js, topology, "w1", {"agent": "toy"})
    impatient = nc.jetstream(timeout=0.3)
    with frozen(nats_server.pid):  # every thread stopped before the removal is sent
        await asyncio.wait_for(remove_worker(impatient, topology, "w1"), 10)
    assert [w["worker_id"] for w in await live_workers(js, topology)] == ["w1"]  # TTL's job now


@pytest.mark.nats_semantics
async def test_status_shows_live_workers_and_their_throughput(js, topology):
    from agentarium.broker.registry import publish_worker

    await provision(js, topology, agents=("toy",))
    await publish_worker(
        js, topology, "w1", {"agent": "toy", "rollouts_per_s": 12.5, "completed": 40}
    )
    await publish_worker(
        js, topology, "w2", {"agent": "toy", "rollouts_per_s": 7.5, "completed": 10}
    )
    status = await collect_status(js, topology)
    [row] = status.agents
    assert (row.workers, row.rollouts_per_s) == (2, 20.0)
    assert [w["worker_id"] for w in status.workers] == ["w1", "w2"]
    assert "20.0" in format_status(status)


@pytest.mark.nats_semantics
async def test_servers_started_side_by_side_pick_their_own_ports_and_keep_them(tmp_path):
    """Parallel test workers start many servers at once: each binds a port it picks itself
    (nothing can take it between choosing and binding), reports it, and keeps it on restart."""
    from agentarium.broker import NatsServer

    servers = [NatsServer(store_dir=tmp_path / f"s{n}") for n in range(4)]
    with pytest.raises(RuntimeError, match="start"):
        servers[0].url  # noqa: B018 - the port is the server's own pick, known once it starts
    await asyncio.gather(*(asyncio.to_thread(server.start) for server in servers))
    try:
        assert len({server.port for server in servers}) == 4
        for server in servers:
            client = await NatsSettings(url=server.url).connect(name="side-by-side")
            assert client.connected_url.port == server.port
            await client.close()
        first = servers[0]
        port = first.port
        first.stop()
        first.start()
        assert first.port == port
        client = await NatsSettings(url=first.url).connect(name="restarted")
        await client.close()
    finally:
        for server in servers:
            server.stop()


async def test_status_after_a_producer_alone_reports_the_jobs_and_what_is_missing(nc, topology):
    """A producer creates the streams only (its least-privilege role sees no buckets): status
    then shows the waiting jobs and says which buckets are missing, not 'not provisioned'."""
    js = nc.jetstream()
    await ensure_streams(js, topology)
    await TaskProducer(js, topology).submit("toy", [{"n": 1}, {"n": 2}], run="r")
    status = await collect_status(js, topology, environments=False)
    assert [(a.agent, a.waiting) for a in status.agents] == [("toy", 2)]
    assert any(f"bucket {topology.workers_bucket} does not exist" in n for n in status.notes)


async def test_byte_bounds_reach_every_stream_and_the_weights_store(nc, topology):
    """What the Kubernetes sizing relies on (docs/operations.md, "Sizing storage"): broker init
    bounds the trajectories, dead letters and weights in bytes, and changes the bounds in place."""
    js = nc.jetstream()
    mib = 1024**2
    limits = Limits(
        trajectories_max_bytes=256 * mib,
        dead_max_bytes=16 * mib,
        weights_max_bytes=512 * mib,
    )
    await provision(js, topology, limits)

    async def bounds() -> dict[str, int]:
        names = {  # (the job queue's byte bound depends on the server's version: tested apart)
            "trajectories": topology.trajectories_stream,
            "dead": topology.dead_stream,
            "weights": f"OBJ_{topology.weights_bucket}",
        }
        return {k: (await js.stream_info(v)).config.max_bytes for k, v in names.items()}

    assert await bounds() == {
        "trajectories": 256 * mib,
        "dead": 16 * mib,
        "weights": 512 * mib,
    }
    report = await provision(js, topology, Limits(weights_max_bytes=1024 * mib))
    assert f"bucket {topology.weights_bucket}" in report.updated
    assert (await bounds())["weights"] == 1024 * mib


def test_a_byte_bound_is_minus_one_or_positive():
    with pytest.raises(ValueError, match="--weights-max-bytes must be -1"):
        Limits(weights_max_bytes=0)
