"""The producer SDK and `agentarium produce`, against a real nats-server."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from agentarium.broker import Backoff, Limits, provision
from agentarium.commands import produce_cmd as producers_cli
from agentarium.commands import trajectories_cmd
from agentarium.producers import ProducerError, StreamMissing, TaskProducer, expand_tasks
from agentarium.schemas import Job, Sampling, SchemaError, decode, encode_json

FAST = Backoff(initial_s=0.02, max_s=0.3, jitter=0.5)


def tasks(n: int, **extra) -> list[dict]:
    return [
        {"task_id": f"q{i}", "question": f"{i}+{i}", "answer": 2 * i, **extra} for i in range(n)
    ]


async def stored_jobs(js, topology) -> list[tuple[dict, Job]]:
    """(headers, job) of every message in TASKS, in order."""
    info = await js.stream_info(topology.tasks_stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg(topology.tasks_stream, seq)
        out.append((raw.headers or {}, decode(Job, raw.data)))
    return out


async def task_count(js, topology) -> int:
    return (await js.stream_info(topology.tasks_stream)).state.messages


@pytest.fixture
def warnings_seen():
    """Collect structlog events; ``seen`` is set by the first warning (an event to await)."""
    events: list[dict] = []
    seen = asyncio.Event()

    def capture(_logger, method, event_dict):
        events.append({**event_dict, "level": method})
        if method == "warning":
            seen.set()
        raise structlog.DropEvent

    old = structlog.get_config()
    structlog.configure(processors=[capture], wrapper_class=structlog.BoundLogger)
    try:
        yield events, seen
    finally:
        structlog.configure(**old)


# expansion: pure


def test_expansion_is_deterministic_and_grouped():
    rows = [{"id": 7, "q": "a"}, {"task_id": "x", "q": "b"}, {"q": "c"}]
    batch, jobs = expand_tasks("calc", rows, run="r1", group_size=3)
    again_batch, again = expand_tasks(
        "calc", [dict(reversed(list(r.items()))) for r in rows], run="r1", group_size=3
    )
    assert batch == again_batch and [j.job_id for j in jobs] == [j.job_id for j in again]
    assert len(jobs) == 9 and len({j.job_id for j in jobs}) == 9
    assert [j.task_id for j in jobs[::3]] == ["7", "x", "t2"]
    for start in range(0, 9, 3):
        group = jobs[start : start + 3]
        assert len({j.group_id for j in group}) == 1
        assert [j.sample_index for j in group] == [0, 1, 2]
        assert all(j.group_size == 3 and j.batch_id == batch and j.run == "r1" for j in group)
    assert len({j.group_id for j in jobs}) == 3
    assert all(len(j.job_id) == 32 and int(j.job_id, 16) >= 0 for j in jobs)
    # Anything in the id recipe changes the ids.
    assert expand_tasks("calc", rows, run="r2", group_size=3)[1][0].job_id != jobs[0].job_id
    assert expand_tasks("calc", rows, run="r1", group_size=2)[0] != batch
    assert expand_tasks("calc", rows, run="r1", group_size=3, is_train=False)[0] != batch
    explicit, ejobs = expand_tasks("calc", rows, run="r1", group_size=3, batch_id="b-1")
    assert explicit == "b-1" and ejobs[0].job_id != jobs[0].job_id


def test_expansion_copies_settings_into_every_job():
    sampling = Sampling(temperature=0.7, max_new_tokens=32)
    _, jobs = expand_tasks(
        "calc",
        tasks(2),
        run="r",
        group_size=2,
        is_train=False,
        sampling=sampling,
        deadline_s=30,
        metadata={"k": 1},
    )
    assert all(j.sampling == sampling and j.deadline_s == 30.0 and not j.is_train for j in jobs)
    assert all(j.metadata == {"k": 1} and j.task["question"] for j in jobs)


def test_duplicate_task_ids_name_both_rows():
    with pytest.raises(SchemaError, match=r"'q1'.*tasks\[1\] and tasks\[3\]") as info:
        expand_tasks("calc", tasks(3) + [{"task_id": "q1"}])
    assert info.value.rows == (1, 3)


@pytest.mark.parametrize(
    "kw",
    [
        {"agent": "a.b"},
        {"agent": "a*"},
        {"agent": "my agent"},
        {"run": "r.1"},
        {"run": "r>"},
        {"batch_id": "b c"},
    ],
)
async def test_bad_names_are_refused_before_anything_is_published(js, topology, kw):
    producer = TaskProducer(js, topology)
    agent = kw.pop("agent", "calc")
    kw.setdefault("run", "r")
    with pytest.raises(SchemaError, match="not a valid name"):
        await producer.submit(agent, tasks(3), **kw)
    assert await task_count(js, topology) == 0


async def test_one_bad_job_in_a_list_publishes_nothing(js, topology):
    _, good = expand_tasks("calc", tasks(3), run="r")
    bad = Job(job_id="bad.id", agent="calc", task={})
    with pytest.raises(SchemaError, match="job_id 'bad.id'"):
        await TaskProducer(js, topology).publish_jobs([*good, bad])
    assert await task_count(js, topology) == 0


# publishing


@pytest.mark.nats_semantics
async def test_resubmitting_a_batch_adds_nothing(js, topology):
    producer = TaskProducer(js, topology)
    first = await producer.submit("calc", tasks(5), run="r1", group_size=3)
    assert (first.published, first.duplicates) == (15, 0)
    assert len(first.job_ids) == 15 and len(first.group_ids) == 5
    second = await producer.submit("calc", tasks(5), run="r1", group_size=3)
    assert (second.published, second.duplicates) == (0, 15)
    assert second.job_ids == first.job_ids and second.batch_id == first.batch_id
    stored = await stored_jobs(js, topology)
    assert len(stored) == 15
    assert [h["Nats-Msg-Id"] for h, _ in stored] == first.job_ids
    assert [job.job_id for _, job in stored] == first.job_ids
    assert all(job.created_at > 0 and job.agent == "calc" for _, job in stored)
    assert producer.stats.published == 15 and producer.stats.duplicates == 15
    assert "duplicates=15" in repr(producer)


async def test_stored_jobs_match_the_exported_json_schema(js, topology):
    jsonschema = pytest.importorskip(
        "jsonschema", reason="jsonschema is not installed (pip install jsonschema)"
    )
    schema_path = Path(__file__).parents[1] / "schemas" / "json" / "job.schema.json"
    schema = json.loads(schema_path.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    await TaskProducer(js, topology).submit(
        "calc", tasks(2), run="r", group_size=2, sampling=Sampling(temperature=0.5, stop=("\n",))
    )
    stored = await stored_jobs(js, topology)
    assert len(stored) == 4
    for _, job in stored:
        validator.validate(json.loads(encode_json(job)))
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"job_id": "a.b", "agent": "calc", "task": {}})


@pytest.mark.nats_semantics
async def test_full_stream_backpressure_waits_and_loses_nothing(js, topology, warnings_seen):
    events, warned = warnings_seen
    await provision(js, topology, Limits(tasks_max_msgs=10), agents=("bp",))
    producer = TaskProducer(js, topology, retry=FAST)
    submit = asyncio.create_task(producer.submit("bp", tasks(30), run="bp"))
    await asyncio.wait_for(warned.wait(), 10)  # the stream filled up and the producer noticed
    assert await task_count(js, topology) == 10

    drained: list[str] = []
    sub = await js.pull_subscribe_bind(
        topology.rollout_consumer("bp"), stream=topology.tasks_stream
    )
    while len(drained) < 30:
        try:
            msgs = await sub.fetch(10, timeout=2)
        except TimeoutError:
            continue
        for msg in msgs:
            drained.append(msg.headers["Nats-Msg-Id"])
            await msg.ack_sync()  # the work queue frees the slot once the server has the ack
    result = await asyncio.wait_for(submit, 30)

    assert sorted(drained) == sorted(result.job_ids) and len(set(drained)) == 30
    assert (result.published, result.duplicates) == (30, 0)
    assert await task_count(js, topology) == 0
    assert producer.stats.full_waits > 0
    full = [e for e in events if e["level"] == "warning" and "TASKS stream is full" in e["event"]]
    assert len(full) == 1  # once per episode, not once per retry


@pytest.mark.nats_semantics
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_broker_restart_during_submit_stores_every_job_once(nats_server, js, topology, how):
    producer = TaskProducer(js, topology, max_in_flight=64, ack_timeout_s=1.0, retry=FAST)
    stopped = asyncio.Event()

    def progress(done: int, total: int) -> None:
        if done == 300 and not stopped.is_set():
            # Synchronously, inside the loop: 2700 jobs are still to publish. SIGTERM flushes
            # the store; SIGKILL is a crash (what the server acked is on disk already).
            getattr(nats_server, how)()
            stopped.set()

    submit = asyncio.create_task(
        producer.submit("rs", tasks(3000), run="restart", on_progress=progress)
    )
    await asyncio.wait_for(stopped.wait(), 20)
    assert not submit.done()
    await asyncio.to_thread(nats_server.start)
    result = await asyncio.wait_for(submit, 60)

    assert result.published + result.duplicates == 3000
    assert producer.stats.retries > 0
    stored = await stored_jobs(js, topology)
    ids = [job.job_id for _, job in stored]
    assert len(ids) == 3000 and set(ids) == set(result.job_ids)


async def test_traceparent_carries_the_publish_span(js, topology, span_exporter):
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        result = await TaskProducer(js, topology).submit("tr", tasks(2), run="traced", group_size=2)
    spans = {
        s.attributes["messaging.message.id"]: s
        for s in span_exporter.get_finished_spans()
        if s.name == "publish tasks"
    }
    assert set(spans) == set(result.job_ids)
    for headers, job in await stored_jobs(js, topology):
        version, trace_id, span_id, _flags = headers["traceparent"].split("-")
        span = spans[job.job_id]
        assert version == "00"
        assert (
            trace_id
            == format(span.context.trace_id, "032x")
            == format(caller.get_span_context().trace_id, "032x")
        )
        assert span_id == format(span.context.span_id, "016x")
        assert span.parent.span_id == caller.get_span_context().span_id
        assert span.kind is SpanKind.PRODUCER
        assert span.attributes["messaging.system"] == "nats"
        assert span.attributes["messaging.destination.name"] == topology.tasks_subject("tr")
        assert span.attributes["messaging.operation"] == "publish"
        assert span.attributes["agentarium.batch_id"] == result.batch_id
        assert span.attributes["agentarium.run"] == "traced"


@pytest.mark.nats_semantics
async def test_missing_stream_is_a_clear_error(nc, topology):
    with pytest.raises(StreamMissing, match="broker init"):
        await TaskProducer(nc.jetstream(), topology, retry=FAST).submit("calc", tasks(3), run="r")


@pytest.mark.nats_semantics
async def test_a_refusal_that_retrying_cannot_fix_names_the_job(js, topology):
    config = (await js.stream_info(topology.tasks_stream)).config
    config.max_msg_size = 1024
    await js.update_stream(config)
    producer = TaskProducer(js, topology)
    _, jobs = expand_tasks("calc", [{"task_id": "big", "blob": "x" * 4096}], run="r")
    with pytest.raises(
        ProducerError, match=rf"job {jobs[0].job_id} \(task 'big'\) was refused"
    ) as info:
        await producer.publish_jobs(jobs)
    assert info.value.job_id == jobs[0].job_id


async def test_connect_owns_its_connection(js, settings, topology):
    async with await TaskProducer.connect(settings, max_in_flight=8) as producer:
        result = await producer.submit("calc", tasks(4), run="owned")
        assert result.published == 4
    assert producer.nc.is_closed
    assert await task_count(js, topology) == 4


# the produce command


def produce_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    producers_cli.add_produce_arguments(parser)
    return parser.parse_args(list(argv))


def summary(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("run="))


@pytest.mark.nats_semantics
async def test_produce_command_on_a_fresh_broker(settings, topology, tmp_path, capsys):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": 1, "q": "1+1"}\n\n{"id": 2, "q": "2+2"}\n   \n{"q": "3+3"}\n')
    args = produce_args(
        "--agent", "calc", "--file", str(path), "--group-size", "2", "--run", "cli", "--eval"
    )
    assert await producers_cli.run_produce(args, settings) == 0
    first = summary(capsys.readouterr().out)
    assert first.startswith("run=cli batch=") and first.endswith("jobs=6 published=6 duplicates=0")
    assert await producers_cli.run_produce(args, settings) == 0
    second = summary(capsys.readouterr().out)
    assert second == first.replace("published=6 duplicates=0", "published=0 duplicates=6")

    nc = await settings.connect()
    try:
        js = nc.jetstream()
        stored = [job for _, job in await stored_jobs(js, topology)]
        assert len(stored) == 6 and not any(j.is_train for j in stored)
        assert {j.task_id for j in stored} == {"1", "2", "t2"}
    finally:
        await nc.close()


async def test_produce_command_names_the_bad_line(settings, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"q": 1}\n\n{"q": 2\n')
    assert (
        await producers_cli.run_produce(
            produce_args("--agent", "calc", "--file", str(path)), settings
        )
        == 2
    )
    assert f"{path}:3: not valid JSON" in capsys.readouterr().err

    path.write_text('{"id": "a"}\n\n{"id": "b"}\n{"id": "a"}\n')
    assert (
        await producers_cli.run_produce(
            produce_args("--agent", "calc", "--file", str(path)), settings
        )
        == 2
    )
    assert "lines 1 and 4 have the same task id" in capsys.readouterr().err

    path.write_text("[1, 2]\n")
    assert (
        await producers_cli.run_produce(
            produce_args("--agent", "calc", "--file", str(path)), settings
        )
        == 2
    )
    assert ":1: a task must be a JSON object" in capsys.readouterr().err


def test_every_produce_flag_has_help():
    parser = argparse.ArgumentParser()
    producers_cli.add_produce_arguments(parser)
    trajectories_cmd.add_show_arguments(argparse.ArgumentParser())
    assert all(action.help for action in parser._actions)
