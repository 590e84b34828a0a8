"""ops/nats/auth.conf: one user per role, least privilege, passwords from the environment.

Each role does its job with the calls the real services make; a role stepping outside its job
is refused by the server; wrong credentials make the CLI fail fast with a clear message.
"""

from __future__ import annotations

import asyncio
import io
import json
import secrets
import subprocess
import time

import agentlib
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from nats_configs import ROLES, agentarium_cli, single_node
from worker_env import worker_for

from agentarium.broker import Topology, collect_env_status, provision, round_trip
from agentarium.broker.provision import ensure_provisioned
from agentarium.dashboard import DashboardConfig, LiveView
from agentarium.inference import record_engine
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.trainer.live import LiveMetrics
from agentarium.trainer.metrics import StepMetrics
from agentarium.trainer.tasks import discover_agents

REFUSED_TIMEOUT_S = 1.0  # a refused JetStream request gets no answer: don't wait long for it


@pytest.fixture(scope="module")
def passwords():
    # nats-server parses a $VAR's value as a config value: one starting with a digit or a
    # '-' is read as a number and fails, so passwords here start with a letter (as in the docs).
    return {role: "p" + secrets.token_hex(12) for role in ROLES}


@pytest.fixture
def auth_server(tmp_path, passwords, monkeypatch):
    """nats-server -c auth.conf, with each role's password in the server's environment."""
    for role, password in passwords.items():
        monkeypatch.setenv(
            f"AGENTARIUM_{role.upper()}_PASSWORD", password
        )  # NatsServer inherits it
    server = single_node(tmp_path, config="auth.conf").server.start()
    yield server
    server.stop()


class Login:
    """A connection as one role, recording the server's asynchronous errors (refusals)."""

    def __init__(self, nc: nats.NATS, errors: list[str]):
        self.nc = nc
        self.errors = errors
        self.js = nc.jetstream()
        self.js_short = nc.jetstream(timeout=REFUSED_TIMEOUT_S)

    async def wait_refused(self, fragment: str, timeout: float = 3.0) -> bool:
        """The server's -ERR reaches nats-py's error callback asynchronously (a task), even
        after a flush: wait for it, bounded."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.refused(fragment) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        return self.refused(fragment)

    def refused(self, fragment: str) -> bool:
        # nats-py lowercases the server's message
        return any(
            "permissions violation" in e.lower() and fragment.lower() in e.lower()
            for e in self.errors
        )


@pytest.fixture
async def login(auth_server, passwords):
    opened = []

    async def connect(role: str) -> Login:
        errors: list[str] = []

        async def on_error(exc):
            errors.append(str(exc))

        nc = await nats.connect(
            auth_server.url,
            user=role,
            password=passwords[role],
            error_cb=on_error,
            max_reconnect_attempts=0,
            connect_timeout=3,
        )
        opened.append(nc)
        return Login(nc, errors)

    yield connect
    for nc in opened:
        await nc.close()


@pytest.fixture
async def admin(login):
    who = await login("admin")
    await provision(who.js, Topology())
    return who


async def settle(who: Login) -> None:
    """The server answers a refused publish asynchronously: a round trip makes sure it arrived
    (broker.round_trip: nats-py's flush() alone sends its PING ahead of the buffered PUB)."""
    await round_trip(who.nc, timeout_s=2)


def cli(*args: str, user: str, password: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return agentarium_cli(
        *args, timeout=timeout, AGENTARIUM_NATS_USER=user, AGENTARIUM_NATS_PASSWORD=password
    )


@pytest.mark.nats_semantics
async def test_the_pipeline_runs_with_one_user_per_role(
    admin, login, fake, auth_server, passwords, tmp_path
):
    topo = Topology()
    consumer, trainer, sync, orchestrator = [
        await login(r) for r in ("consumer", "trainer", "sync", "orchestrator")
    ]
    # producer: `agentarium produce` (checks the streams, publishes, PubAcks on its inbox)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"task_id": f"t{i}", "prompt": f"say {i}"}) + "\n" for i in range(4))
    )
    produced = await asyncio.to_thread(
        cli,
        "produce",
        "--agent",
        "echo",
        "--file",
        str(tasks),
        "--run",
        "auth",
        "--group-size",
        "2",
        "--nats-url",
        auth_server.url,
        user="producer",
        password=passwords["producer"],
    )
    assert produced.returncode == 0, produced.stderr[-2000:]
    assert "published=8" in produced.stdout, produced.stdout
    # orchestrator: publishes jobs too
    more = await TaskProducer(orchestrator.js, topo).submit("echo", [{"task_id": "o1"}], run="auth")
    assert more.published == 1
    # a job for another agent on this subject is dead-lettered by the consumer
    await orchestrator.js.publish(
        topo.tasks_subject("echo"),
        json.dumps({"job_id": "misrouted", "agent": "other", "task": {}}).encode(),
    )

    # consumer: creates its durable, pulls, stores trajectories, dead-letters, acks, registers
    async with worker_for(
        consumer.js, "echo", agentlib.echo, [fake.url], worker_id="auth-worker"
    ) as worker:
        counters = await worker.run()
    assert counters.ok == 9 and counters.dead_lettered == 1, counters
    assert (await admin.js.stream_info(topo.tasks_stream)).state.messages == 0
    assert (await admin.js.stream_info(topo.dead_stream)).state.messages == 1

    # orchestrator: reads them back
    trajectories = await TrajectoryReader(orchestrator.js, topo).read("auth")
    assert len(trajectories) == 9 and set(more.job_ids) < {t.job_id for t in trajectories}

    # trainer and sync check at start that every stream and bucket exists
    assert not await ensure_provisioned(trainer.js, topo)
    assert not await ensure_provisioned(sync.js, topo)
    # trainer: its own durable consumer on TRAJECTORIES; weights into the object store; policy KV
    await trainer.js.add_consumer(
        topo.trajectories_stream,
        ConsumerConfig(
            durable_name="trainer-auth",
            filter_subject=topo.trajectories_filter("auth"),
            ack_policy=AckPolicy.EXPLICIT,
        ),
    )
    sub = await trainer.js.pull_subscribe_bind("trainer-auth", topo.trajectories_stream)
    msgs = await sub.fetch(9, timeout=5)
    assert len(msgs) == 9
    for msg in msgs:
        await msg.ack()
    await sub.unsubscribe()
    # --agent '*': the run's stored agents and the rollout consumers, within the trainer's rights
    assert await discover_agents(trainer.js, topo, "auth") == ["echo"]
    weights = b"\x00\x01" * 300_000  # several chunks
    obs = await trainer.js.object_store(topo.weights_bucket)
    await obs.put("auth/v1", weights)
    await obs.put("auth/v1", weights)  # a re-publish purges the old chunks
    policy = await trainer.js.key_value(topo.policy_bucket)
    await policy.put(
        "auth", json.dumps({"run": "auth", "version": 1, "object": "auth/v1"}).encode()
    )

    # sync: watches the policy, streams the weights to a file (ordered consumers, flow control)
    kv = await sync.js.key_value(topo.policy_bucket)
    watcher = await kv.watch("auth")
    entry = await watcher.updates(timeout=5)
    assert json.loads(entry.value)["version"] == 1
    await watcher.stop()
    assert json.loads((await kv.get("auth")).value)["object"] == "auth/v1"
    sink = io.BytesIO()
    await (await sync.js.object_store(topo.weights_bucket)).get("auth/v1", writeinto=sink)
    assert sink.getvalue() == weights

    # consumer: reads the policy KV
    ckv = await consumer.js.key_value(topo.policy_bucket)
    assert json.loads((await ckv.get("auth")).value)["version"] == 1

    # trainer: each step's metrics row; sync: what its engine serves (both for live views)
    assert await LiveMetrics(trainer.js, topo, run="auth", agent="echo").publish(
        StepMetrics(step=1, version=0, reward_mean_received=0.5)
    )
    await record_engine(
        sync.js, topo, run="auth", url=fake.url, weight_version="1", status="updated",
        target_version=1,
    )  # fmt: skip

    # dashboard: reads all of it, read-only
    dashboard = await login("dashboard")
    view = LiveView(dashboard.js, topo, DashboardConfig())
    state = await view.refresh()
    assert state["notes"] == [] and state["error"] is None
    counted = await LiveView(dashboard.js, topo, DashboardConfig(runs=("auth",))).refresh()
    assert counted["runs"][0]["trajectories"] == 9  # --run counts with a consumer of its own
    # the misrouted job's dead letter is the subject's agent's: no row for the agent it named
    assert {a["agent"]: a["dead_lettered"] for a in state["agents"]} == {"echo": 1}
    assert state["runs"][0]["trajectories"] == 9 and state["runs"][0]["trainer_step"] == 1
    assert len(state["trajectories"]) == 9 and len(state["dead_letters"]) == 1
    assert [e["weight_version"] for e in state["engines"]] == ["1"]

    # consumer: a failed run is counted in the attempts KV and read back on the redelivery
    await TaskProducer(orchestrator.js, topo).submit("flaky", [{"n": "auth"}], run="auth-retry")
    async with worker_for(
        consumer.js, "flaky", agentlib.flaky, [fake.url], worker_id="auth-flaky"
    ) as worker:
        counters = await asyncio.wait_for(worker.run(), 60)
    assert (counters.retried, counters.ok) == (1, 1), counters

    for who in (consumer, trainer, sync, orchestrator, dashboard):
        await settle(who)
        assert not who.errors, who.errors


async def test_a_consumer_draining_requeues_its_unfinished_job(admin, login, fake):
    """A drain's release publishes the job again (so it spends no delivery): the consumer role
    may put a job it was given back in the queue."""
    topo = Topology()
    await TaskProducer(admin.js, topo).submit("slow", [{"n": 0, "sleep": 60}], run="drained")
    consumer = await login("consumer")
    async with worker_for(
        consumer.js, "slow", agentlib.slow, [fake.url], burst=False, drain_grace=0.1
    ) as worker:
        runner = asyncio.create_task(worker.run())
        await fake.wait_for_requests(1)
        worker.stop()
        counters = await asyncio.wait_for(runner, 15)
    assert counters.released == 1 and counters.dead_lettered == 0, (counters, consumer.errors)
    stream = await admin.js.stream_info(topo.tasks_stream)
    assert stream.state.messages == 1
    msg = await admin.js.get_msg(topo.tasks_stream, stream.state.last_seq)
    assert msg.headers["Agentarium-Releases"] == "1"


@pytest.mark.nats_semantics
async def test_a_consumer_cannot_publish_weights_or_a_policy(admin, login):
    topo = Topology()
    policy = await admin.js.key_value(topo.policy_bucket)
    await policy.put("guarded", b'{"version": 1}')
    consumer = await login("consumer")

    kv = await consumer.js_short.key_value(topo.policy_bucket)  # reading is allowed
    with pytest.raises(nats.errors.TimeoutError):
        await kv.put("guarded", b'{"version": 99}')
    await settle(consumer)
    assert await consumer.wait_refused("$KV.agentarium-policy.guarded"), consumer.errors

    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
        await consumer.js_short.object_store(topo.weights_bucket)
    with pytest.raises(nats.errors.TimeoutError):  # even straight to the bucket's subjects
        await consumer.js_short.publish("$O.agentarium-weights.C.forged", b"weights")
    await settle(consumer)
    assert await consumer.wait_refused("$O.agentarium-weights"), consumer.errors

    assert (await policy.get("guarded")).value == b'{"version": 1}'
    assert (await admin.js.stream_info(f"OBJ_{topo.weights_bucket}")).state.messages == 0


async def test_a_producer_cannot_read_trajectories_or_publish_them(admin, login):
    topo = Topology()
    producer = await login("producer")
    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
        await TrajectoryReader(producer.js_short, topo).read("auth")
    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
        await producer.js_short.get_last_msg(
            topo.trajectories_stream, topo.trajectory_subject("r", "a", "j")
        )
    await producer.nc.subscribe("agentarium.trajectories.>")  # refused asynchronously
    await producer.nc.publish(topo.trajectory_subject("r", "a", "forged"), b"{}")
    await settle(producer)
    assert await producer.wait_refused('Subscription to "agentarium.trajectories.>"'), (
        producer.errors
    )
    assert await producer.wait_refused('Publish to "agentarium.trajectories.r.a.forged"'), (
        producer.errors
    )
    assert (await admin.js.stream_info(topo.trajectories_stream)).state.messages == 0


async def test_sync_and_orchestrator_cannot_change_weights_or_policy(admin, login):
    topo = Topology()
    for role in ("sync", "orchestrator"):
        who = await login(role)
        with pytest.raises(nats.errors.TimeoutError):
            await who.js_short.publish(f"$KV.{topo.policy_bucket}.forged", b"{}")
        await settle(who)
        assert await who.wait_refused(f"$KV.{topo.policy_bucket}.forged"), (role, who.errors)
    assert (await admin.js.stream_info(f"KV_{topo.policy_bucket}")).state.messages == 0


@pytest.mark.nats_semantics
async def test_the_dashboard_cannot_publish_jobs_or_change_anything(admin, login):
    topo = Topology()
    who = await login("dashboard")
    with pytest.raises(nats.errors.TimeoutError):
        await who.js_short.publish(topo.tasks_subject("echo"), b'{"job_id": "j", "agent": "echo"}')
    with pytest.raises(nats.errors.TimeoutError):
        await who.js_short.publish(f"$KV.{topo.engines_bucket}.auth.forged", b"{}")
    await settle(who)
    assert await who.wait_refused('Publish to "agentarium.tasks.echo"'), who.errors
    assert await who.wait_refused(f"$KV.{topo.engines_bucket}.auth.forged"), who.errors
    assert (await admin.js.stream_info(topo.tasks_stream)).state.messages == 0


async def test_an_environment_worker_serves_its_sessions_and_nothing_else(admin, login):
    """The environment role serves sessions (starts, steps, close) to a consumer and its
    figures to the service API (admin, dashboard); it can publish nothing of its own."""
    from agentarium.consumers import EnvClient
    from agentarium.environments import EnvWorker, EnvWorkerConfig, SqlEnvironment

    topo = Topology()
    env_user, consumer, dashboard = [
        await login(r) for r in ("environment", "consumer", "dashboard")
    ]
    worker = EnvWorker(env_user.nc, topo, SqlEnvironment, EnvWorkerConfig(name="sql"))
    await worker.start()
    try:
        envs = EnvClient(consumer.nc, topo)
        async with envs.session("sql", {"index": "aggregate-01"}) as env:
            call = {"name": "commit_final_answer", "arguments": '{"answer": ["10"]}'}
            result = await env.step({"tool_calls": [{"id": "c", "function": call}]})
            assert result.done and result.reward == 1.0
        assert env.outcome.score == 1.0
        for who in (admin, dashboard):  # broker status and the dashboard read the stats
            [sql] = await collect_env_status(who.nc, topo)
            assert (sql.env, sql.starts, sql.steps) == ("sql", 1, 1)

        # it cannot publish jobs, trajectories or session starts, nor read trajectories
        await env_user.nc.publish(topo.tasks_subject("echo"), b"{}")
        await env_user.nc.publish(topo.trajectory_subject("r", "a", "forged"), b"{}")
        await env_user.nc.publish(topo.env_start_subject("sql"), b"{}")
        await env_user.nc.subscribe("agentarium.trajectories.>")
        await settle(env_user)
        for refused in (
            'Publish to "agentarium.tasks.echo"',
            'Publish to "agentarium.trajectories.r.a.forged"',
            'Publish to "agentarium.env.sql.start"',
            'Subscription to "agentarium.trajectories.>"',
        ):
            assert await env_user.wait_refused(refused), (refused, env_user.errors)
        with pytest.raises(nats.errors.TimeoutError):  # no JetStream at all
            await env_user.js_short.stream_info(topo.tasks_stream)
    finally:
        await worker.stop(grace_s=0)
    assert (await admin.js.stream_info(topo.tasks_stream)).state.messages == 0
    assert (await admin.js.stream_info(topo.trajectories_stream)).state.messages == 0
    for who in (consumer, dashboard):
        await settle(who)
        assert not who.errors, who.errors


@pytest.mark.nats_semantics
def test_wrong_credentials_fail_fast_with_a_clear_message(auth_server):
    started = time.monotonic()
    proc = cli(
        "broker",
        "status",
        "--nats-url",
        auth_server.url,
        "--nats-user",
        "x",
        "--nats-password",
        "wrong",
        user="",
        password="",
    )
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "credentials" in proc.stderr, proc.stderr
    # Python start-up included. nats-py retries a refused login ~10 times (10 x 0.5 s
    # reconnect_time_wait, about 5 s) before the CLI reports it; failing on the first refusal
    # would make this about 1.5 s. The defect guarded against is retrying forever (a service's
    # reconnect_forever), which never returns: cli() kills it at 60 s. The bound is derived from
    # the two, not guessed against a busy machine: 5 s of waits + start-up (1.5 s alone, a few
    # times that in a loaded 2-core suite) < 40 s < 60 s.
    assert elapsed < 40, f"took {elapsed:.1f}s"
