"""Environment workers and the client, against a real nats-server.

Workers run in-process (each on its own connection) where nothing is killed, and as
`agentarium env serve` subprocesses where SIGKILL and SIGTERM matter.
"""

from __future__ import annotations

import ast
import asyncio
import json
import signal
import sys
import time
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path

import nats.errors
import pytest
from envlib import EchoEnv, serve_process

from agentarium.broker import (
    Topology,
    collect_env_status,
    collect_status,
    format_env_status,
    format_status,
    round_trip,
)
from agentarium.consumers import (
    EnvClient,
    EnvironmentFailed,
    EnvironmentTimeout,
    EnvironmentUnavailable,
    EnvRequestError,
)
from agentarium.environments import EnvWorker, EnvWorkerConfig, SqlEnvironment
from agentarium.environments.sql import load_tasks
from agentarium.schemas import EnvCall, EnvError, EnvStart, decode, encode

ROOT = Path(__file__).resolve().parents[1]


@asynccontextmanager
async def serving(settings, env_cls=EchoEnv, **options):
    """An in-process worker on its own connection; stopped (sessions closed) on exit."""
    nc = await settings.connect(name="env-worker")
    config = EnvWorkerConfig(
        name=options.pop("name", env_cls.name), janitor_interval_s=0.05, **options
    )
    worker = EnvWorker(nc, Topology(), env_cls, config)
    await worker.start()  # a round trip: the server has the worker's subscriptions
    try:
        yield worker
    finally:
        await worker.stop(grace_s=0)
        await nc.close()


async def until(condition, timeout_s: float = 5.0) -> None:
    """Until ``condition()`` holds: the worker's start subscription follows its sessions in a
    task of its own, which the test cannot await."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def tool_call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": name, "arguments": text}}
        ],
    }


@pytest.fixture(autouse=True)
def fresh_counts():
    EchoEnv.runs.clear()
    EchoEnv.closed.clear()
    EchoEnv.most_resets_at_once = 0


# ---- routing and capacity ---------------------------------------------------------------------


async def test_sessions_stay_on_the_worker_that_started_them(settings, nc):
    async with serving(settings, capacity=64) as a, serving(settings, capacity=64) as b:
        envs = EnvClient(nc)

        async def one(i: int) -> str:
            async with envs.session("echo", {"mark": f"s{i}"}) as env:
                instance = env.observation.info["instance"]
                for k in range(3):
                    result = await env.step({"content": f"{i}-{k}"})
                    # the same environment object answered: the session never left its worker
                    assert result.info["instance"] == instance
                    assert result.messages[0]["content"] == f"{i}-{k}" and result.seq == k + 1
            assert env.outcome.steps == 3
            return env.worker

        workers = Counter(await asyncio.gather(*(one(i) for i in range(40))))
    assert set(workers) == {a.config.worker_id, b.config.worker_id}
    for w in (a, b):
        assert w.counters.starts == workers[w.config.worker_id]
        assert w.counters.steps == 3 * workers[w.config.worker_id]
        assert w.counters.closed == workers[w.config.worker_id]
    assert all(count == 1 for count in EchoEnv.runs.values())


async def test_a_full_worker_takes_no_start_until_a_session_closes(settings, nc):
    async with serving(settings, capacity=2) as worker:
        envs = EnvClient(nc)
        first = await envs.start("echo", {})
        await envs.start("echo", {})
        await until(lambda: not worker.accepting)
        # no worker with room: the server answers no-responders at once
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(
                worker.start_subject, encode(EnvStart(session_id="raw", task={})), timeout=2
            )
        started = time.monotonic()
        with pytest.raises(EnvironmentUnavailable, match="no worker took the session"):
            await envs.start("echo", {}, deadline_s=0.4)
        assert time.monotonic() - started < 2
        # backpressure: a start waits (backing off) until a close frees a slot
        third = asyncio.create_task(envs.start("echo", {}, deadline_s=20))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(third), 0.3)
        await first.close()
        session = await asyncio.wait_for(third, 10)
        assert session.worker == worker.config.worker_id and worker.open_sessions == 2
        assert worker.stats().capacity == 2


async def test_a_start_delivered_after_the_worker_gave_up_its_subscription_is_answered(
    settings, nc
):
    """nats-server can deliver a start it routed to a worker before that worker's UNSUB even
    after the PONG of the worker's flush (the publisher's and the worker's connections race;
    seen 60 ms late under load, 3 % of starts lost at 2,000 sessions). NATS never re-routes it,
    so a worker that dropped it would leave its client waiting 60 s for a timeout: the old
    subscription still answers (here 503, full) for a while."""
    # a linger far longer than this test takes on a loaded machine: the race is injected below
    async with serving(settings, capacity=1, start_linger_s=60.0) as worker:
        old = worker.admission.subscription
        await EnvClient(nc).start("echo", {})
        await until(lambda: not worker.accepting)
        rejected = worker.counters.rejected
        replies = await nc.subscribe(inbox := nc.new_inbox(), max_msgs=1)
        # the server has the SUB before the worker answers: nats-py's flush() alone would not
        # make sure (its PING overtakes the SUB; the worker's 503 was then dropped under load)
        await round_trip(nc)
        late = encode(EnvStart(session_id="late", task={}))
        # what the server does in the race: a message on the old subscription's sid
        await worker.nc._process_msg(
            old._id, worker.start_subject.encode(), inbox.encode(), late, b""
        )
        reply = await replies.next_msg(timeout=10)
        assert reply.headers["Nats-Service-Error-Code"] == "503"
        assert worker.counters.rejected == rejected + 1 and worker.open_sessions == 1


async def test_starts_are_admitted_a_few_at_a_time(settings, nc):
    async with serving(settings, capacity=10, max_starting=2) as worker:
        envs = EnvClient(nc)
        sessions = await asyncio.gather(
            *(envs.start("echo", {"reset_sleep": 0.15}) for _ in range(6))
        )
        assert EchoEnv.most_resets_at_once == 2
        assert worker.open_sessions == 6 and worker.counters.starts == 6
        for s in sessions:
            await s.close()


# ---- steps: seq, caps, errors -------------------------------------------------------------------


async def test_a_retried_step_is_answered_again_never_run_twice(settings, nc):
    async with serving(settings):
        # the step takes 0.5 s; the client gives each try 0.2 s and sends it again, same seq
        envs = EnvClient(nc, step_timeout_s=0.2, max_timeouts=10)
        async with envs.session("echo", {"mark": "retry", "sleep": 0.5}) as env:
            result = await env.step({"content": "once"})
            assert result.seq == 1 and result.messages[0]["content"] == "once"
            # a step out of order is refused, and the session goes on
            reply = await nc.request(env.subject, encode(EnvCall(op="step", seq=5)), timeout=2)
            assert reply.headers["Nats-Service-Error-Code"] == "409"
            assert decode(EnvError, reply.data).error == "out_of_order"
            again = await nc.request(env.subject, encode(EnvCall(op="step", seq=1)), timeout=2)
            assert again.data == encode(result)  # the stored reply, byte for byte
    assert EchoEnv.runs[("retry", 1)] == 1


async def test_an_oversized_observation_is_cut_with_a_marker(settings, nc):
    cap = 8192
    async with serving(settings, max_observation_bytes=cap):
        envs = EnvClient(nc)
        async with envs.session("echo", {"big": 100_000, "big_reset": 50_000}) as env:
            assert env.observation.info["truncated"] is True
            result = await env.step({"content": "x"})
        assert result.truncated and len(encode(result)) <= cap
        text = result.messages[0]["content"]
        assert text.startswith("yyy") and text.endswith(
            f"bytes cut: the observation was over this worker's limit of {cap} bytes]"
        )
        assert env.truncated == 1


async def test_a_reply_over_the_servers_max_payload_fails_its_session_at_once(settings, nc):
    """The observation cap is measured on msgpack: a JSON client's reply (control characters
    escaped, 6 bytes each) or an outcome's info (not capped) can still exceed nats-server's
    max_payload, which would refuse it, leaving the client to time out three times. The
    worker answers 500 instead and ends the session."""
    limit = nc.max_payload
    assert 200_000 < limit < 6 * 200_000  # the fixture's server: 1 MiB, nats-server's default
    async with serving(settings) as worker:
        envs = EnvClient(nc)
        env = await envs.start("echo", {"control_chars": 200_000})  # 1.2 MB as JSON
        step = json.dumps({"op": "step", "seq": 1, "message": {"content": "x"}}).encode()
        reply = await nc.request(env.subject, step, timeout=10)
        assert reply.headers["Nats-Service-Error-Code"] == "500"
        error = json.loads(reply.data)
        assert f"over the server's max_payload of {limit}" in error["message"]
        again = await nc.request(env.subject, step, timeout=10)
        assert again.headers["Nats-Service-Error-Code"] == "404"  # the session is over
        assert worker.open_sessions == 0 and worker.counters.errors == 1

        env = await envs.start("echo", {"big_info": 2 * limit})
        with pytest.raises(EnvironmentFailed, match="over the server's max_payload") as failed:
            await env.close()
        assert failed.value.code == 500
        # a close sent again (its answer lost) gets the same failure, not "no such session"
        close = json.dumps({"op": "close"}).encode()
        again = await nc.request(env.subject, close, timeout=10)
        assert again.headers["Nats-Service-Error-Code"] == "500"
        assert "its outcome cannot be sent" in json.loads(again.data)["message"]
        assert worker.open_sessions == 0 and worker.counters.errors == 2


async def test_an_environment_that_raises_fails_its_session_only(settings, nc):
    async with serving(settings) as worker:
        envs = EnvClient(nc)
        other = await envs.start("echo", {})
        async with envs.session("echo", {"raise_on_step": 2}) as env:
            await env.step({"content": "fine"})
            with pytest.raises(EnvironmentFailed, match="echo broke on step 2") as err:
                await env.step({"content": "boom"})
        assert err.value.code == 500 and env.ended
        with pytest.raises(EnvRequestError, match="bad task") as bad:
            await envs.start("echo", {"bad": True})
        assert bad.value.code == 400
        # the worker goes on serving
        assert (await other.step({"content": "still here"})).messages[0]["content"] == "still here"
        await other.close()
        assert worker.counters.errors == 1 and worker.counters.start_failures == 1
        assert not envs.errors  # nothing here was the infrastructure's fault


async def test_idle_sessions_expire_and_deadlines_hold(settings, nc):
    async with serving(settings, idle_timeout_s=0.2) as worker:
        envs = EnvClient(nc)
        EchoEnv.closed["idle"] = asyncio.Event()
        env = await envs.start("echo", {"mark": "idle"})
        await asyncio.wait_for(EchoEnv.closed["idle"].wait(), 5)  # the worker closed it
        with pytest.raises(EnvironmentUnavailable, match="idle for more than 0.2 s"):
            await env.step({"content": "late"})
        assert worker.counters.expired == 1 and worker.open_sessions == 0
        assert envs.errors  # recorded for the rollout, even if an agent swallowed it
        # a step running past the session's deadline is cut: 408
        slow = await envs.start("echo", {"sleep": 5}, deadline_s=0.3)
        with pytest.raises(EnvironmentTimeout):
            await slow.step({"content": "too slow"})
        assert worker.counters.expired == 2


async def test_a_client_in_any_language_speaks_json(settings, nc):
    """JSON in, JSON out, with only the required fields: what another language sends."""
    async with serving(settings) as worker:
        start = {"session_id": "json-1", "task": {"mark": "json"}}
        reply = await nc.request(worker.start_subject, json.dumps(start).encode(), timeout=5)
        started = json.loads(reply.data)
        assert started["worker"] == worker.config.worker_id and started["schema_version"] == 1
        assert started["observation"]["messages"][0]["content"] == "hello json"
        step = {"op": "step", "seq": 1, "message": {"role": "assistant", "content": "hi"}}
        reply = await nc.request(started["subject"], json.dumps(step).encode(), timeout=5)
        assert json.loads(reply.data)["messages"][0]["content"] == "hi"
        reply = await nc.request(started["subject"], b'{"op": "close"}', timeout=5)
        assert json.loads(reply.data)["steps"] == 1
        # a broken request says what is wrong, in JSON too
        reply = await nc.request(started["subject"], b'{"op": "jump"}', timeout=5)
        assert reply.headers["Nats-Service-Error-Code"] == "400"
        assert "envcall.op must be one of" in json.loads(reply.data)["message"]


async def test_a_closed_connection_is_an_unavailable_environment(settings):
    async with serving(settings):
        own = await settings.connect(name="closing")
        envs = EnvClient(own)
        env = await envs.start("echo", {})
        await own.close()
        with pytest.raises(EnvironmentUnavailable, match="the NATS connection failed"):
            await env.step({"content": "x"})
        assert envs.errors


# ---- the sql environment through a worker ---------------------------------------------------------


def test_the_shipped_sql_tasks():
    tasks = load_tasks()
    assert len(tasks) >= 50
    assert {t["kind"] for t in tasks.values()} == {"select", "join", "aggregate", "update"}
    assert SqlEnvironment.indices() == list(tasks)
    for task in tasks.values():
        assert task["question"] and task["sql"]
        assert ("expected_table" in task) == (task["kind"] == "update"), task["id"]


async def test_every_shipped_sql_task_is_solved_by_its_reference_sql(settings, nc):
    """A scripted policy (run the reference SQL, commit what it returned) gets reward 1 on all."""
    tasks = list(load_tasks().values())
    async with serving(settings, env_cls=SqlEnvironment, name="sql", capacity=64):
        envs = EnvClient(nc)

        async def solve(task: dict) -> float:
            async with envs.session("sql", {"index": task["id"]}) as env:
                assert env.observation.tools[0]["function"]["name"] == "execute_sql"
                result = await env.step(tool_call("execute_sql", {"query": task["sql"]}))
                rows = result.messages[0]["content"]
                if task["kind"] == "update":
                    answer = ["done"]
                else:
                    answer = [str(row[0]) for row in ast.literal_eval(rows)]
                final = await env.step(tool_call("commit_final_answer", {"answer": answer}))
                assert final.done and final.reward == 1.0
            return env.outcome.score

        scores = await asyncio.gather(*(solve(t) for t in tasks))
        assert scores == [1.0] * len(tasks), [
            t["id"] for t, s in zip(tasks, scores, strict=True) if s != 1
        ]

        # a wrong answer, an unchanged table and an inline task
        async with envs.session("sql", {"index": "select-01"}) as env:
            final = await env.step(tool_call("commit_final_answer", {"answer": ["Alice"]}))
        assert (final.done, final.reward, env.outcome.score) == (True, 0.0, 0.0)
        async with envs.session("sql", {"index": "update-01"}) as env:
            await env.step(tool_call("commit_final_answer", {"answer": "done"}))
        assert env.outcome.score == 0.0
        inline = dict(load_tasks()["aggregate-01"])
        inline.pop("id")
        async with envs.session("sql", inline) as env:
            await env.step(tool_call("commit_final_answer", {"answer": "10"}))
        assert env.outcome.score == 1.0


async def test_bad_actions_on_sql_get_clear_observations_and_others_are_served(settings, nc):
    async with serving(settings, env_cls=SqlEnvironment, name="sql") as worker:
        envs = EnvClient(nc)
        async with (
            envs.session("sql", {"index": "select-01"}) as bad,
            envs.session("sql", {"index": "aggregate-01"}) as good,
        ):
            forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c"
            # rows that would stay in the worker's memory: one big statement, then growth by steps
            rows = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT {n}) "
            fill = (
                "CREATE TABLE big AS " + rows.format(n=10**6) + "SELECT x, randomblob(900) FROM c"
            )
            half = (
                "CREATE TABLE half AS "
                + rows.format(n=20_000)
                + "SELECT randomblob(900) AS b FROM c"
            )
            double = "INSERT INTO half SELECT b FROM half"  # ~18 MiB more: over the 32 MiB
            cases = [
                ({"role": "assistant", "content": "It is Alice."}, "No tool call found"),
                (tool_call("execute_sql", "{not json"), "not valid JSON"),
                (tool_call("execute_sql", "[1, 2]"), "must be a JSON object"),
                (tool_call("drop_everything", {}), "unknown tool 'drop_everything'"),
                (tool_call("execute_sql", {"sql": "SELECT 1"}), 'execute_sql needs {"query"'),
                (tool_call("execute_sql", {"query": "SELEC name FROM employees"}), "syntax error"),
                (tool_call("execute_sql", {"query": "SELECT * FROM nowhere"}), "no such table"),
                (tool_call("execute_sql", {"query": "SELECT 1; SELECT 2"}), "one statement"),
                (tool_call("execute_sql", {"query": forever}), "ran over 1 s and was stopped"),
                (tool_call("execute_sql", {"query": "ATTACH 'x.db' AS x"}), "not authorized"),
                (tool_call("execute_sql", {"query": "SELECT randomblob(5000000)"}), "too big"),
            ]
            # the database's size cap, and what would lift it, in a session of their own
            limits = [
                (fill, "the database is full"),
                (half, "OK"),
                (double, "the database is full"),
                ("SELECT count(*) FROM half", "[(20000,)]"),  # the statement was rolled back
                ("PRAGMA max_page_count = 2147483647", "not authorized"),
                ("PRAGMA temp_store = MEMORY", "not authorized"),
                ("CREATE TEMP TABLE t AS SELECT 1", "not authorized"),
                ("PRAGMA table_info(employees)", "'salary'"),  # reading the schema is fine
                ("SELECT full FROM employees", "no such column: full"),  # not "full"
            ]
            async with envs.session("sql", {"index": "select-01"}) as capped:
                for query, expected in limits:
                    result = await capped.step(tool_call("execute_sql", {"query": query}))
                    assert expected in result.messages[-1]["content"], (expected, result.messages)
            for action, expected in cases:
                result = await bad.step(action)
                assert expected in result.messages[-1]["content"], (expected, result.messages)
                assert not result.done
            result = await bad.step(tool_call("execute_sql", {"query": "SELECT 1 FROM employees"}))
            assert "only the first 50 rows" not in result.messages[0]["content"]
            wide = "SELECT a.id FROM employees a, employees b"  # 100 rows: 50 shown
            result = await bad.step(tool_call("execute_sql", {"query": wide}))
            assert "(only the first 50 rows are shown)" in result.messages[0]["content"]
            await good.step(tool_call("execute_sql", {"query": "SELECT COUNT(*) FROM employees"}))
            final = await good.step(tool_call("commit_final_answer", {"answer": [10]}))
            assert final.reward == 1.0
        assert bad.outcome.metrics["sql_errors"] >= 5 and bad.outcome.metrics["bad_calls"] >= 4
        assert good.outcome.score == 1.0 and worker.counters.errors == 0
    assert not (ROOT / "x.db").exists()


# ---- status, spans --------------------------------------------------------------------------------


async def test_a_worker_counts_sessions_steps_errors_and_expiries_for_prometheus(settings, nc):
    """What `env serve --metrics-port` serves: the worker's figures, labelled by environment."""
    import aiohttp
    from prometheus_client import REGISTRY
    from prometheus_client.parser import text_string_to_metric_families

    from agentarium.broker import MetricsServer

    async def scrape(url: str) -> dict:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "env"))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.labels.get("env") == "promecho"
        }

    async with (
        serving(settings, name="promecho", capacity=4) as worker,
        MetricsServer(0, host="127.0.0.1") as metrics,
    ):
        envs = EnvClient(nc)
        kept = await envs.start("promecho", {})
        broken = await envs.start("promecho", {"raise_on_step": 1})
        await kept.step({"content": "1"})
        await kept.step({"content": "2"})
        with pytest.raises(EnvironmentFailed):
            await broken.step({"content": "x"})
        left = await envs.start("promecho", {}, deadline_s=0.2)  # the worker expires it
        await until(lambda: worker.counters.expired == 1)
        with pytest.raises(EnvironmentUnavailable):
            await left.step({"content": "late"})  # 404: gone
        got = await scrape(metrics.url)
        assert got[("agentarium_env_sessions_open", ())] == 1
        assert got[("agentarium_env_sessions_capacity", ())] == 4
        assert got[("agentarium_env_accepting", ())] == 1
        assert got[("agentarium_env_session_starts_total", ())] == 3
        assert got[("agentarium_env_steps_total", ())] == 2
        assert got[("agentarium_env_step_duration_seconds_count", ())] == 2
        assert got[("agentarium_env_errors_total", ())] == 1
        assert got[("agentarium_env_sessions_expired_total", ())] == 1
        refused = {
            k[1]: v for k, v in got.items() if k[0] == "agentarium_env_requests_refused_total"
        }
        assert refused == {(("code", "500"),): 1, (("code", "404"),): 1}
        await kept.close()
        got = await scrape(metrics.url)
        assert got[("agentarium_env_sessions_open", ())] == 0
        assert got[("agentarium_env_sessions_closed_total", ())] == 1
    stopped = {"env": "promecho"}  # a stopped worker takes its capacity back
    assert REGISTRY.get_sample_value("agentarium_env_sessions_capacity", stopped) == 0
    assert REGISTRY.get_sample_value("agentarium_env_accepting", stopped) == 0


async def test_env_status_and_broker_status_show_the_workers(settings, nc, js, topology):
    async with serving(settings, capacity=3) as a, serving(settings, capacity=5) as b:
        envs = EnvClient(nc)
        env = await envs.start("echo", {})
        await env.step({"content": "x"})
        [echo] = await collect_env_status(nc, topology)
        assert (echo.env, echo.service, len(echo.workers)) == ("echo", "agentarium-env-echo", 2)
        assert (echo.sessions, echo.capacity, echo.starts, echo.steps) == (1, 8, 1, 1)
        assert echo.step_p99_ms > 0 and echo.starts_per_s > 0
        assert {w["worker"] for w in echo.workers} == {a.config.worker_id, b.config.worker_id}
        text = format_env_status([echo])
        assert "echo" in text and "1/8" in text and a.config.worker_id in text
        # another prefix's workers are not ours
        assert await collect_env_status(nc, Topology("other")) == []
        status = await collect_status(js, topology)
        assert [e["env"] for e in status.environments] == ["echo"]
        assert "environments:" in format_status(status)
        await env.close()


async def test_each_start_step_and_close_is_a_span(settings, nc, span_exporter):
    async with serving(settings, env_cls=SqlEnvironment, name="sql"):
        envs = EnvClient(nc).bind(job_id="job-1", deadline_s=60)
        async with envs.session("sql", {"index": "aggregate-01"}) as env:
            await env.step(tool_call("execute_sql", {"query": "SELECT COUNT(*) FROM employees"}))
            await env.step(tool_call("commit_final_answer", {"answer": ["10"]}))
    spans = {s.name: s for s in span_exporter.get_finished_spans() if s.name.startswith("env.")}
    assert set(spans) == {"env.start", "env.step", "env.close"}
    step = [s for s in span_exporter.get_finished_spans() if s.name == "env.step"][-1]
    assert step.attributes["agentarium.env.name"] == "sql"
    assert step.attributes["agentarium.env.seq"] == 2
    assert list(step.attributes["agentarium.env.tools"]) == ["commit_final_answer"]
    assert step.attributes["agentarium.env.done"] is True
    assert step.attributes["agentarium.env.reward"] == 1.0
    assert step.attributes["agentarium.job_id"] == "job-1"
    assert step.attributes["agentarium.env.session"] == env.session_id
    assert spans["env.close"].attributes["agentarium.env.score"] == 1.0
    assert spans["env.start"].attributes["agentarium.env.worker"] == env.worker
    assert envs.summary() == [
        {
            "env": "sql",
            "session": env.session_id,
            "worker": env.worker,
            "steps": 2,
            "done": True,
            "score": 1.0,
            "rewards": [1.0],
            "truncated_steps": 0,
            "error": None,
        }
    ]


# ---- worker processes: SIGKILL and SIGTERM --------------------------------------------------------


async def test_a_killed_worker_fails_its_sessions_fast_with_a_clear_error(nats_url, nc):
    async with serve_process(nats_url, "--capacity", "4") as (proc, worker_id):
        envs = EnvClient(nc, step_timeout_s=600)
        env = await envs.start("echo", {}, deadline_s=600)
        assert env.worker == worker_id
        await env.step({"content": "before"})
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        started = time.monotonic()
        with pytest.raises(EnvironmentUnavailable, match=f"worker {worker_id} is gone"):
            await env.step({"content": "after"})
        # seconds, not the step timeout or the session's deadline: both are 600 s here, so the
        # defect costs >= 600 s and a 200 s bound is no guess against a busy 2-core machine
        assert time.monotonic() - started < 200
        assert envs.errors and env.ended
        with pytest.raises(EnvironmentUnavailable):
            await env.close()


async def test_sigterm_drains_new_starts_refused_open_sessions_finish(nats_url, nc):
    async with serve_process(nats_url, "--capacity", "4", "--drain-grace", "30") as (proc, _):
        envs = EnvClient(nc)
        env = await envs.start("echo", {})
        out = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentarium", "env", "status", "--json", "--nats-url", nats_url,
            stdout=asyncio.subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        [echo] = json.loads((await out.communicate())[0])
        assert (echo["env"], echo["sessions"], echo["capacity"]) == ("echo", 1, 4)
        proc.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            services = await collect_env_status(nc, Topology())
            return any(w.get("draining") for s in services for w in s.workers)

        for _ in range(100):  # the signal is handled by the child in its own time
            if await draining():
                break
        else:
            raise AssertionError("the worker never reported draining after SIGTERM")
        with pytest.raises(EnvironmentUnavailable):  # draining: no new sessions
            await envs.start("echo", {}, deadline_s=1.0)
        assert proc.returncode is None  # still serving its open session
        assert (await env.step({"content": "during drain"})).messages[0][
            "content"
        ] == "during drain"
        await env.close()
        assert await asyncio.wait_for(proc.wait(), 10) == 0  # the last session gone: exits


async def test_env_bridge_serves_an_agentbench_worker_with_the_same_rules(nats_url, nc):
    """`agentarium env bridge --agentbench URL`: sessions on an AgentBench (fc) task worker;
    its errors keep their meaning (a task that raised: the environment failed)."""
    from agentbench_worker import Worker, WorkerThread

    with WorkerThread(Worker("fc")) as served:
        bridge = ("bridge", "--agentbench", served.url)
        async with serve_process(nats_url, "--capacity", "2", command=bridge) as (_, worker_id):
            envs = EnvClient(nc)
            async with envs.session("agentbench", {"index": 0}) as env:
                assert "17 + 25" in env.observation.messages[-1]["content"]
                assert env.worker == worker_id
                await env.step(tool_call("calculate", {"expression": "17+25"}))
                final = await env.step(tool_call("commit_final_answer", {"answer": "42"}))
                assert final.done and final.reward == 1.0
            assert env.outcome.score == 1.0
            async with envs.session("agentbench", {"index": 3}) as broken:
                with pytest.raises(EnvironmentFailed):
                    for _ in range(5):
                        await broken.step(tool_call("calculate", {"expression": "1/0"}))
        assert served.worker.sessions == {}


async def test_env_serve_shell_by_name_with_options(nats_url, nc):
    """The built-in `shell` by name (imported when asked), its class built with --option."""
    from agentarium.environments import ShellEnvironment, check_options

    with pytest.raises(ValueError, match="does not take the options"):
        check_options(ShellEnvironment, {"max_stepz": 3})
    options = ("--option", "max_steps=1", "--option", "limits={wall_s: 5}")
    async with serve_process(nats_url, *options, command=("serve", "shell")) as (_, worker_id):
        envs = EnvClient(nc)
        async with envs.session("shell", {"index": "count-lines"}) as env:
            assert [t["function"]["name"] for t in env.observation.tools][0] == "bash"
            result = await env.step(tool_call("bash", {"command": "echo hi"}))
            assert result.done  # max_steps=1 reached the worker's instances
        assert env.worker == worker_id and env.outcome.score == 0.0


# ---- rollouts that use environments ----------------------------------------------------------------


async def solve_with_sql(task: dict, llm, envs) -> dict:
    async with envs.session("sql", {"index": task["index"]}) as env:
        await env.step(tool_call("execute_sql", {"query": "SELECT COUNT(*) FROM employees"}))
        await env.step(tool_call("commit_final_answer", {"answer": ["10"]}))
    return {"reward": env.outcome.score}


@asynccontextmanager
async def rollout_worker(js, nc, agent_fn, *, attempts: int = 3):
    """A rollout worker for agent ``db`` whose agent never calls its LLM: no model, no fleet."""
    from agentarium.consumers import ConsumerSettings
    from agentarium.consumers.agents.loading import AgentRunner, AgentSpec
    from agentarium.consumers.rollout import RolloutEnv
    from agentarium.consumers.tracing.proxy import TracingProxy
    from agentarium.consumers.worker.worker import Worker

    proxy = TracingProxy(host="127.0.0.1", port=0, advertised_host="127.0.0.1")
    await proxy.start()
    runner = AgentRunner(AgentSpec.of(agent_fn, "db"), model_name="none", threads=2)
    env = RolloutEnv(
        runner=runner,
        backend=None,
        template=None,
        proxy=proxy,
        model_name="none",
        worker_id="test-db",
        envs=EnvClient(nc),
    )
    config = ConsumerSettings.of(
        burst=True,
        fetch_timeout_s=0.3,
        worker_id="test-db",
        attempts=attempts,
        retry_delay_s=0.05,
        retry_max_delay_s=0.2,
    )
    try:
        yield Worker(js, Topology(), "db", config, env)
    finally:
        runner.close()
        await proxy.stop()


async def test_an_agent_with_envs_gets_the_client_and_its_steps_are_recorded(settings, nc, js):
    from agentarium.producers import TrajectoryReader

    await js.publish(
        "agentarium.tasks.db",
        json.dumps({"job_id": "db-1", "agent": "db", "task": {"index": "aggregate-01"}}).encode(),
    )
    async with (
        serving(settings, env_cls=SqlEnvironment, name="sql"),
        rollout_worker(js, nc, solve_with_sql) as w,
    ):
        counters = await w.run()
    assert counters.ok == 1
    traj = await TrajectoryReader(js, Topology()).get("default", "db", "db-1")
    assert traj.status == "ok" and traj.reward == 1.0
    [record] = traj.metadata["envs"]
    assert (record["env"], record["steps"], record["score"], record["done"]) == (
        "sql",
        2,
        1.0,
        True,
    )


async def test_a_rollout_without_an_environment_worker_is_retried_then_stored_as_error(nc, js):
    from agentarium.producers import TrajectoryReader

    job = {"job_id": "db-2", "agent": "db", "task": {"index": "aggregate-01"}, "deadline_s": 1.0}
    await js.publish("agentarium.tasks.db", json.dumps(job).encode())
    async with rollout_worker(js, nc, solve_with_sql, attempts=2) as w:
        counters = await w.run()
    assert (counters.retried, counters.errors, counters.failed) == (1, 1, 1)
    traj = await TrajectoryReader(js, Topology()).get("default", "db", "db-2")
    assert traj.status == "error" and traj.reward is None and traj.attempts == 2
    assert "environment unavailable" in traj.error and "no worker took the session" in traj.error


# ---- the command's settings ----------------------------------------------------------------------


def test_env_serve_takes_flags_a_config_file_and_overrides(tmp_path):
    from agentarium.cli import build_parser
    from agentarium.commands import env_cmd

    def parse(*argv: str):
        return env_cmd.config_from_args(build_parser().parse_args(["env", "serve", *argv]))

    path = tmp_path / "env.yaml"
    path.write_text("env: sql\ncapacity: 8\nidle_timeout_s: 30\n")
    config, source = parse("--config", str(path), "--capacity", "16", "max_starting=2")
    worker = config.worker
    assert (config.env, worker.capacity, worker.max_starting, worker.idle_timeout_s) == (
        "sql", 16, 2, 30.0,
    )  # fmt: skip
    assert source["set_by"] == {
        "env": "file",
        "capacity": "flag",
        "idle_timeout_s": "file",
        "max_starting": "override",
    }
    config, _ = parse("sql", "capacity=3")
    assert (config.env, config.worker.capacity) == ("sql", 3)
    with pytest.raises(ValueError, match="name the environment to serve"):
        parse("capacity=3")
