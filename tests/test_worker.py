"""The rollout worker against a real nats-server, with a fake SGLang fleet (SGLang's shapes)."""

from __future__ import annotations

import asyncio
import json

import agentlib
import msgpack
import nats.js.errors
import pytest
import structlog.testing
from fake_sglang import FakeSGLang
from worker_env import dead_letters, tiny_template, worker_for

from agentarium.broker import Limits, provision
from agentarium.broker.errors import ERR_STREAM_FULL
from agentarium.consumers.redact import log_safe
from agentarium.examples import calculator, openai_agent
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.schemas import Job, encode


@pytest.fixture
async def two_fakes():
    servers = [FakeSGLang(), FakeSGLang()]
    for s in servers:
        await s.start()
    yield servers
    for s in servers:
        await s.close()


@pytest.mark.nats_semantics
async def test_minimal_json_job_from_plain_nats_py_is_a_group_of_one(js, topology, fake):
    # Published with nats-py alone: no SDK, JSON, only the three required fields.
    await js.publish(
        topology.tasks_subject("echo"),
        json.dumps({"job_id": "plain-1", "agent": "echo", "task": {"prompt": "hello"}}).encode(),
    )
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as worker:
        counters = await worker.run()
    assert counters.ok == 1
    traj = await TrajectoryReader(js, topology).get("default", "echo", "plain-1")
    assert traj is not None and traj.status == "ok"
    assert (traj.group_id, traj.task_id, traj.group_size, traj.sample_index) == (
        "plain-1",
        "plain-1",
        1,
        0,
    )
    call = traj.calls[0]
    assert call.response_ids == fake.output_ids
    assert len(call.response_logprobs) == len(call.response_ids)
    assert call.prompt_ids == fake.requests[0]["input_ids"]
    assert call.weight_version == "default" and call.backend == fake.url
    assert (await js.stream_info(topology.tasks_stream)).state.messages == 0


@pytest.mark.nats_semantics
async def test_sdk_batch_groups_and_republish_adds_nothing(js, topology, fake):
    producer = TaskProducer(js, topology)
    tasks = [{"task_id": f"t{i}", "prompt": f"p{i}"} for i in range(4)]
    first = await producer.submit("echo", tasks, run="r1", group_size=3)
    again = await producer.submit("echo", tasks, run="r1", group_size=3)
    assert again.job_ids == first.job_ids and again.published == 0
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as worker:
        await worker.run()
    # Re-published after the jobs were consumed: server dedup (window) still holds.
    await producer.submit("echo", tasks, run="r1", group_size=3)
    # And past any dedup window: the same job id published raw runs again, but the
    # per-job trajectory subject refuses a second trajectory.
    job = Job(job_id=first.job_ids[0], agent="echo", task={"prompt": "again"}, run="r1")
    await js.publish(topology.tasks_subject("echo"), encode(job))
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as worker:
        counters = await worker.run()
    assert counters.already_stored == 1
    trajs = await TrajectoryReader(js, topology).read("r1")
    assert sorted(t.job_id for t in trajs) == sorted(first.job_ids)
    groups = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t.sample_index)
    assert len(groups) == 4 and all(sorted(v) == [0, 1, 2] for v in groups.values())


@pytest.mark.nats_semantics
async def test_bad_jobs_are_dead_lettered_and_free_a_full_queue(js, topology, fake):
    await provision(js, topology, Limits(tasks_max_msgs=5))
    subject = topology.tasks_subject("echo")
    bad = [
        b"\xc1\x00 garbage bytes",
        b"{not json",
        json.dumps({"job_id": "no-task", "agent": "echo"}).encode(),
        json.dumps({"job_id": "dotted", "agent": "bad.name", "task": {}}).encode(),
        msgpack.packb({"job_id": "other", "agent": "someone-else", "task": {}}),
    ]
    for payload in bad:
        await js.publish(subject, payload)
    with pytest.raises(nats.js.errors.APIError) as full:
        await js.publish(
            subject, json.dumps({"job_id": "ok-1", "agent": "echo", "task": {}}).encode()
        )
    assert full.value.err_code == ERR_STREAM_FULL
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as worker:
        counters = await worker.run()
    assert counters.dead_lettered == 5 and counters.invalid == 5
    # The dead-lettered jobs left the work queue: new jobs are accepted and served.
    await js.publish(subject, json.dumps({"job_id": "ok-1", "agent": "echo", "task": {}}).encode())
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as worker:
        counters = await worker.run()
    assert counters.ok == 1
    letters = await dead_letters(js, topology)
    assert len(letters) == 5
    errors = " | ".join(letter.error for letter in letters)
    assert "not valid msgpack" in errors and "not valid JSON" in errors
    assert "job.task: required field missing" in errors
    assert "job.agent 'bad.name' is not a valid name" in errors
    assert "does not match its subject" in errors
    assert sum(1 for letter in letters if letter.raw) == 4  # invalid ones keep their raw bytes


@pytest.mark.nats_semantics
async def test_agent_that_always_raises_is_retried_then_dead_lettered(js, topology, fake):
    producer = TaskProducer(js, topology)
    result = await producer.submit("boom", [{"n": 1}, {"n": 2}], run="r-boom")
    async with worker_for(js, "boom", agentlib.always_raises, [fake.url], attempts=3) as worker:
        counters = await worker.run()
    assert counters.retried == 4 and counters.dead_lettered == 2
    trajs = await TrajectoryReader(js, topology).read("r-boom")
    assert sorted(t.job_id for t in trajs) == sorted(result.job_ids)
    assert all(t.status == "error" and t.reward is None and "agent bug" in t.error for t in trajs)
    assert all(t.attempts == 3 for t in trajs)
    letters = await dead_letters(js, topology)
    assert {letter.reason for letter in letters} == {"agent_error"}
    assert all("Traceback" in letter.error and letter.attempts == 3 for letter in letters)
    assert (await js.stream_info(topology.tasks_stream)).state.messages == 0


async def test_retry_timeout_missing_reward_and_sync_agents(js, topology, fake):
    producer = TaskProducer(js, topology)
    await producer.submit("flaky", [{"n": i} for i in range(3)], run="mix")
    await producer.submit("hangs", [{"n": 0}], run="mix", deadline_s=0.3)
    await producer.submit("noreward", [{"n": 0}], run="mix")
    await producer.submit("sync", [{"n": 0}], run="mix")
    async with worker_for(js, "flaky", agentlib.flaky, [fake.url]) as w:
        assert (await w.run()).retried == 3
    async with worker_for(js, "hangs", agentlib.hangs, [fake.url]) as w:
        assert (await w.run()).timeouts == 1
    async with worker_for(js, "noreward", agentlib.no_reward, [fake.url], attempts=1) as w:
        assert (await w.run()).dead_lettered == 1
    async with worker_for(js, "sync", agentlib.sync_agent, [fake.url]) as w:
        assert (await w.run()).ok == 1
    by_agent = {t.agent: t for t in await TrajectoryReader(js, topology).read("mix")}
    assert by_agent["flaky"].status == "ok" and by_agent["flaky"].attempts == 2
    assert by_agent["hangs"].status == "timeout" and "deadline" in by_agent["hangs"].error
    assert by_agent["noreward"].status == "error" and "no reward" in by_agent["noreward"].error
    assert by_agent["sync"].status == "ok" and by_agent["sync"].reward == 2  # max_new_tokens=2


async def test_llm_unreachable_is_status_error_not_reward_zero(js, topology):
    from fake_sglang import dead_url

    await TaskProducer(js, topology).submit("echo", [{"n": 0}], run="down")
    async with worker_for(js, "echo", agentlib.echo, [dead_url()]) as w:
        counters = await w.run()
    assert counters.errors == 1 and counters.dead_lettered == 0
    [traj] = await TrajectoryReader(js, topology).read("down")
    assert traj.status == "error" and traj.reward is None and "LLM backend failed" in traj.error


async def test_a_dead_llm_fleet_warns_for_each_failed_rollout(js, topology):
    from fake_sglang import dead_url

    url = dead_url().replace("http://", "http://operator:sekrit@")  # credentials in the URL
    result = await TaskProducer(js, topology).submit("echo", [{"n": 0}, {"n": 1}], run="dark")
    with structlog.testing.capture_logs() as logs:
        async with worker_for(js, "echo", agentlib.echo, [url]) as w:
            counters = await w.run()
    assert counters.errors == 2 and counters.failed == 2 and counters.dead_lettered == 0
    failed = [e for e in logs if e["event"] == "rollout failed"]
    assert sorted(e["job_id"] for e in failed) == sorted(result.job_ids)
    assert all(e["log_level"] == "warning" and e["attempt"] == 1 for e in failed)
    assert all("LLM backend failed" in e["error"] and len(e["error"]) <= 300 for e in failed)
    assert "***@127.0.0.1" in failed[0]["error"]
    assert "sekrit" not in repr(logs)
    [stopped] = [e for e in logs if e["event"] == "worker stopped"]
    assert (stopped["failed"], stopped["errors"], stopped["ok"]) == (2, 2, 0)  # fields, not a repr


def test_error_texts_are_cut_and_masked_for_the_log():
    traceback = "Traceback (most recent call last):\n  ...\nValueError: agent bug\n"
    assert log_safe(traceback) == "ValueError: agent bug"
    masked = log_safe(
        "GET https://me:pw@llm.example/v1?api_key=abc123&x=1 failed; Authorization: Bearer t0k"
    )
    assert "pw" not in masked and "abc123" not in masked and "t0k" not in masked
    assert "https://***@llm.example/v1?api_key=***&x=1" in masked
    long = log_safe("x" * 1000)
    assert len(long) == 300 and long.endswith("…")
    assert log_safe("") == ""


async def test_two_engines_groups_stick_to_one_and_spread(js, topology, two_fakes):
    await TaskProducer(js, topology).submit(
        "echo", [{"task_id": f"g{i}"} for i in range(8)], run="spread", group_size=4
    )
    async with worker_for(
        js, "echo", agentlib.echo, [s.url for s in two_fakes], concurrency=32
    ) as w:
        await w.run()
    trajs = await TrajectoryReader(js, topology).read("spread")
    assert len(trajs) == 32
    per_group: dict[str, set] = {}
    for t in trajs:
        per_group.setdefault(t.group_id, set()).add(t.calls[0].backend)
    assert all(len(backends) == 1 for backends in per_group.values())
    used = {next(iter(b)) for b in per_group.values()}
    assert used == {s.url for s in two_fakes}


async def test_one_trace_covers_publish_rollout_and_chat(js, topology, fake, span_exporter):
    result = await TaskProducer(js, topology).submit("echo", [{"prompt": "trace me"}], run="traced")
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as w:
        await w.run()
    [traj] = await TrajectoryReader(js, topology).read("traced")
    spans = span_exporter.get_finished_spans()
    by_name = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    publish = by_name["publish tasks"][0]
    rollout = by_name["rollout"][0]
    chat = by_name["chat tiny"][0]
    trace_id = format(publish.context.trace_id, "032x")
    assert traj.trace_id == trace_id
    assert (
        format(rollout.context.trace_id, "032x")
        == trace_id
        == format(chat.context.trace_id, "032x")
    )
    assert chat.parent.span_id == rollout.context.span_id
    assert rollout.attributes["messaging.system"] == "nats"
    assert rollout.kind.name == "CONSUMER" and publish.kind.name == "PRODUCER"
    assert chat.attributes["gen_ai.usage.output_tokens"] == len(fake.output_ids)
    assert result.job_ids == [traj.job_id]


async def test_openai_sdk_agent_through_proxy_is_traced_token_by_token(js, topology, fake):
    await TaskProducer(js, topology).submit("oai", [{"prompt": "hi", "answer": "x"}], run="oai")
    await TaskProducer(js, topology).submit("direct", [{"prompt": "hi"}], run="oai")
    async with worker_for(js, "oai", openai_agent.rollout, [fake.url]) as w:
        assert (await w.run()).ok == 1
    async with worker_for(js, "direct", agentlib.echo, [fake.url]) as w:
        assert (await w.run()).ok == 1
    by_agent = {t.agent: t for t in await TrajectoryReader(js, topology).read("oai")}
    via_proxy, direct = by_agent["oai"].calls[0], by_agent["direct"].calls[0]
    assert via_proxy.response_ids == direct.response_ids == fake.output_ids
    assert via_proxy.response_logprobs == direct.response_logprobs
    assert via_proxy.prompt_ids == fake.requests[0]["input_ids"]
    assert via_proxy.finish_reason == "stop" and via_proxy.weight_version == "default"


async def test_multi_turn_tool_agent_records_every_call_without_tool_tokens(js, topology):
    template = tiny_template()
    tool_text = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    )
    eos = template.eos_token_ids[0]
    replies = [template.encode(tool_text) + [eos], template.encode("5") + [eos]]

    def reply(body):
        ids = replies[min(len(server.requests) - 1, 1)]
        return ids, template.decode(ids[:-1])

    server = FakeSGLang(reply=reply)
    await server.start()
    try:
        await TaskProducer(js, topology).submit(
            "calc", [{"prompt": "What is 2+3?", "answer": "5", "max_new_tokens": 128}], run="calc"
        )
        async with worker_for(js, "calc", calculator.rollout, [server.url]) as w:
            assert (await w.run()).ok == 1
    finally:
        await server.close()
    [traj] = await TrajectoryReader(js, topology).read("calc")
    assert traj.reward == 1.0 and traj.metrics["tool_uses"] == 1.0
    first, second = traj.calls
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    assert first.response_ids == replies[0] and second.response_ids == replies[1]
    # The second prompt extends the first prompt + response, then the tool result.
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    tool_result = template.encode("<tool_response>\n5\n</tool_response>")
    tail = second.prompt_ids[len(first.prompt_ids) + len(first.response_ids) :]
    assert _contains(tail, tool_result)
    assert not any(_contains(c.response_ids, tool_result) for c in traj.calls)
    assert first.messages[-1]["tool_calls"][0]["function"]["name"] == "calculator"


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


@pytest.mark.nats_semantics
async def test_sigterm_style_stop_drains_in_flight_jobs(js, topology, fake):
    await TaskProducer(js, topology).submit(
        "slow", [{"n": i, "sleep": 0.5} for i in range(4)], run="drain"
    )
    async with worker_for(js, "slow", agentlib.slow, [fake.url], burst=False, concurrency=4) as w:
        runner = asyncio.create_task(w.run())
        await fake.wait_for_requests(4)  # every rollout is in flight
        w.stop()
        counters = await asyncio.wait_for(runner, 10)
    assert counters.ok == 4
    assert len(await TrajectoryReader(js, topology).read("drain")) == 4


@pytest.mark.nats_semantics
async def test_a_drain_requeues_what_it_gives_back_without_spending_deliveries_or_attempts(
    js, topology, fake
):
    """A job released by four drains (a consumer scaled down four times while it ran), on a
    consumer allowing 3 deliveries, is requeued each time as a fresh message: never
    dead-lettered, and its count of failed runs (one, before the drains) still holds after."""
    await provision(js, topology, Limits(attempts=2, lost_deliveries=0), agents=("slow",))
    result = await TaskProducer(js, topology).submit("slow", [{"n": 0, "sleep": 60}], run="requeue")
    [job_id] = result.job_ids
    kv = await js.key_value(topology.attempts_bucket)
    await kv.put(topology.attempts_key("slow", job_id), b"1")  # one run failed already
    for release in range(1, 5):
        async with worker_for(
            js, "slow", agentlib.slow, [fake.url], burst=False, attempts=2, drain_grace=0.2
        ) as w:
            runner = asyncio.create_task(w.run())
            await fake.wait_for_requests(release)  # the rollout is running
            w.stop()
            counters = await asyncio.wait_for(runner, 10)
        assert counters.released == 1 and counters.dead_lettered == 0, counters
        stream = await js.stream_info(topology.tasks_stream)
        assert stream.state.messages == 1  # the released delivery acked, its copy queued
        msg = await js.get_msg(topology.tasks_stream, stream.state.last_seq)
        assert msg.headers["Agentarium-Releases"] == str(release)
        assert msg.headers["Nats-Msg-Id"].startswith(f"{job_id}.released.")
    info = await js.consumer_info(topology.tasks_stream, "rollout-slow")
    assert info.config.max_deliver == 3 and info.num_redelivered == 0
    # the fifth run fails: with the failure counted before the drains, it is the last attempt
    async with worker_for(js, "slow", agentlib.always_raises, [fake.url], attempts=2) as w:
        counters = await w.run()
    assert (counters.retried, counters.dead_lettered) == (0, 1)
    [letter] = await dead_letters(js, topology)
    assert letter.reason == "agent_error" and letter.job_id == job_id


async def test_agent_spans_nest_under_the_rollout_span(js, topology, fake, span_exporter):
    await TaskProducer(js, topology).submit("spans", [{"n": 1}], run="spans")
    async with worker_for(js, "spans", agentlib.with_own_span, [fake.url]) as w:
        assert (await w.run()).ok == 1
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    rollout, own, chat = spans["rollout"], spans["agent thinking"], spans["chat tiny"]
    assert own.parent.span_id == rollout.context.span_id
    assert chat.parent.span_id == own.context.span_id  # the LLM call inside the agent's span
    assert (
        own.context.trace_id == rollout.context.trace_id == spans["publish tasks"].context.trace_id
    )


@pytest.mark.nats_semantics
async def test_worker_started_while_the_broker_restarts_waits_for_it(
    js, topology, nats_server, fake
):
    await TaskProducer(js, topology).submit("echo", [{"n": 1}], run="late")
    nats_server.stop()
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as w:
        runner = asyncio.create_task(w.run())
        await asyncio.sleep(1.0)  # the outage's length is the point: the worker retries its start
        assert not runner.done()
        nats_server.start()
        counters = await asyncio.wait_for(runner, 60)
    assert counters.ok == 1


@pytest.mark.nats_semantics
async def test_rollouts_longer_than_ack_wait_are_heartbeated_not_redelivered(js, topology, fake):
    await TaskProducer(js, topology).submit("slow", [{"n": 0, "sleep": 4.5}], run="long")
    async with worker_for(js, "slow", agentlib.slow, [fake.url], ack_wait=3.0) as w:
        counters = await w.run()
    assert counters.ok == 1 and counters.fetched == 1  # never delivered a second time
    [traj] = await TrajectoryReader(js, topology).read("long")
    assert traj.attempts == 1
    info = await js.consumer_info(topology.tasks_stream, "rollout-slow")
    assert info.num_redelivered == 0


async def test_a_job_redelivered_while_it_still_runs_here_is_left_to_that_run(js, topology, fake):
    """The worker's loop stalls past ack_wait (a blocking call in the agent), so the broker
    redelivers the job while its first delivery still runs: the redelivery is not run again
    (that raced the first run for the job's proxy route and counted a failure), and the first
    run stores the job's one trajectory and acks it."""
    await TaskProducer(js, topology).submit("stalls", [{"n": 7, "block": 4.5}], run="stall")
    async with worker_for(js, "stalls", agentlib.stalls, [fake.url], ack_wait=3.0) as w:
        counters = await w.run()
    assert counters.redelivered_running >= 1  # the broker did redeliver while the job ran
    assert (counters.fetched, counters.ok, counters.retried, counters.failed) == (1, 1, 0, 0)
    assert agentlib.STALLED_RUNS[7] == 1
    [traj] = await TrajectoryReader(js, topology).read("stall")
    assert traj.attempts == 1 and traj.status == "ok"
    info = await js.consumer_info(topology.tasks_stream, "rollout-stalls")
    assert info.num_ack_pending == 0 and info.num_pending == 0  # acked: not delivered again


@pytest.mark.nats_semantics
async def test_an_oversized_undecodable_job_is_dead_lettered_not_stranded(js, topology, fake):
    garbage = b"\xc1" * 800_000  # its base64 alone would exceed the server's 1 MiB max payload
    await js.publish(topology.tasks_subject("echo"), garbage)
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as w:
        counters = await w.run()
    assert counters.dead_lettered == 1
    [letter] = await dead_letters(js, topology)
    assert "truncated to 65536 of 800000 bytes" in letter.error
    assert (await js.stream_info(topology.tasks_stream)).state.messages == 0


@pytest.mark.nats_semantics
async def test_workers_adopt_the_shared_consumers_attempts(js, topology, fake):
    # An operator set one attempt for this agent; a worker started with --attempts 3 follows it,
    # so the job's last delivery is judged the same way by every worker.
    await provision(js, topology, Limits(attempts=1, ack_wait_s=20), agents=("boom",))
    await TaskProducer(js, topology).submit("boom", [{"n": 1}], run="adopt")
    async with worker_for(js, "boom", agentlib.always_raises, [fake.url], attempts=3) as w:
        counters = await w.run()
        assert (w.config.delivery.attempts, w.config.ack_wait_s) == (1, 20)
    assert counters.retried == 0 and counters.dead_lettered == 1
    info = await js.consumer_info(topology.tasks_stream, "rollout-boom")
    assert info.config.max_deliver == 1 + 5 + 1  # not overwritten by the worker's flag


async def lose_deliveries(js, topology, agent: str, times: int) -> None:
    """Take the agent's next job ``times`` times and give it back unfinished, as a worker
    stopped mid-rollout does (a drain's nak; a crash is the same after ack_wait)."""
    sub = await js.pull_subscribe_bind(topology.rollout_consumer(agent), topology.tasks_stream)
    for delivery in range(1, times + 1):
        [msg] = await sub.fetch(1, timeout=5)
        assert msg.metadata.num_delivered == delivery
        await msg.nak()
    await sub.unsubscribe()


@pytest.mark.nats_semantics
async def test_lost_deliveries_spend_no_attempt(js, topology, fake):
    # Found by tests/chaos: three consumers SIGKILLed in turn dead-lettered the jobs each of
    # them held (max_deliveries), though no run of those jobs had failed.
    await provision(js, topology, Limits(attempts=1), agents=("echo",))
    await TaskProducer(js, topology).submit("echo", [{"n": 1}], run="lost")
    await lose_deliveries(js, topology, "echo", 3)
    async with worker_for(js, "echo", agentlib.echo, [fake.url], attempts=1) as w:
        counters = await w.run()
    assert (counters.ok, counters.dead_lettered) == (1, 0)
    [traj] = await TrajectoryReader(js, topology).read("lost")
    assert traj.status == "ok" and traj.attempts == 4  # the fourth delivery ran it


@pytest.mark.nats_semantics
async def test_failed_runs_are_counted_across_lost_deliveries(js, topology, fake):
    await provision(js, topology, Limits(attempts=2), agents=("boom",))
    result = await TaskProducer(js, topology).submit("boom", [{"n": 1}], run="counted")
    await lose_deliveries(js, topology, "boom", 2)
    async with worker_for(js, "boom", agentlib.always_raises, [fake.url], attempts=2) as w:
        counters = await w.run()
    # two runs, both failed: the second is the last attempt, whatever was lost before
    assert (counters.retried, counters.dead_lettered) == (1, 1)
    [letter] = await dead_letters(js, topology)
    assert letter.reason == "agent_error" and letter.attempts == 4
    kv = await js.key_value(topology.attempts_bucket)
    entry = await kv.get(topology.attempts_key("boom", result.job_ids[0]))
    assert entry.value == b"1"  # the failure before the last one, counted before its nak


async def test_sync_agents_past_their_deadline_are_counted_as_busy_threads():
    import threading

    from agentarium.consumers.agents.loading import AgentRunner, AgentSpec

    release = threading.Event()

    def stuck(task, llm):
        release.wait(10)
        return 1.0

    runner = AgentRunner(AgentSpec.of(stuck, "stuck"), model_name="tiny", threads=1)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.run({}, llm=None, endpoint=""), 0.2)
        assert runner.busy_threads == 1  # the rollout timed out; its thread did not
        release.set()
        await asyncio.get_running_loop().run_in_executor(runner._pool, lambda: None)
        assert runner.busy_threads == 0
    finally:
        runner.close()


async def test_agent_threads_hand_results_errors_and_context_to_the_loop():
    """Sync agents' threads: a result, an exception (SystemExit and StopIteration included)
    and the caller's context reach the rollout; a call cancelled while queued never runs; no
    more threads than asked for."""
    import contextvars
    import threading

    from agentarium.consumers.agents.loading import AgentThreads

    loop = asyncio.get_running_loop()
    pool = AgentThreads(max_workers=2)
    var = contextvars.ContextVar("var", default="unset")
    var.set("rollout")
    gate, ran = threading.Event(), []

    def raise_(exc):
        raise exc

    try:
        assert await pool.run(loop, var.get) == "rollout"
        with pytest.raises(ValueError, match="bad"):
            await pool.run(loop, raise_, ValueError("bad"))
        with pytest.raises(SystemExit):
            await pool.run(loop, raise_, SystemExit(3))
        with pytest.raises(RuntimeError, match="StopIteration"):
            await pool.run(loop, raise_, StopIteration())
        blockers = [pool.run(loop, gate.wait, 10) for _ in range(2)]  # both threads busy
        queued = pool.run(loop, ran.append, "queued")
        queued.cancel()
        gate.set()
        assert await asyncio.gather(*blockers) == [True, True]
        assert await pool.run(loop, lambda: threading.current_thread().daemon) is True
        assert ran == [] and len(pool._threads) == 2
        assert await loop.run_in_executor(pool, sum, [1, 2]) == 3  # the Executor interface
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(loop, int)
