"""The generic function-call agent end to end: `agentarium produce` of an environment's task
file, `agentarium consumer --agent db --env sql`, an `sql` environment worker, a real
nats-server, and the trajectories read back.

The model is a fake SGLang server running a scripted policy that solves the sql tasks
(envlib.solve_sql), the real local engine with the tiny model, or a fake that never solves
anything (turn limit, full context). Environment workers run in-process where nothing is
killed, and as `agentarium env serve sql` processes where SIGKILL matters.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest
from clilib import cli, consume
from envlib import serve_process, solve_sql, sql_worker, tool_call_text
from fake_sglang import FakeSGLang, scripted

from agentarium.broker import collect_env_status
from agentarium.commands import consumer_cmd, produce_cmd
from agentarium.environments import SqlEnvironment
from agentarium.environments.sql import load_tasks
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.schemas import Sampling
from agentarium.trainer import rows_of

ROOT = Path(__file__).resolve().parents[1]
SQL_TASKS = ROOT / "examples" / "sql_tasks.jsonl"
SAMPLING = Sampling(max_new_tokens=128)
SQL = ("serve", "sql")  # `agentarium env serve sql`


@asynccontextmanager
async def fake_model(**kwargs):
    server = FakeSGLang(**kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def produce(nats_url: str, settings, *argv: str) -> int:
    return await produce_cmd.run_produce(cli("produce", *argv, "--nats-url", nats_url), settings)


def trained_spans(row) -> list[list[int]]:
    """The runs of tokens a row trains on (response_mask 1), in order."""
    spans, current = [], []
    for token, mask in zip(row.response_ids, row.response_mask, strict=True):
        if mask:
            current.append(token)
        elif current:
            spans, current = [*spans, current], []
    return spans + ([current] if current else [])


def environment_texts(traj) -> list[str]:
    """What the environment said after the model's first turn (tool results and notes)."""
    last = traj.calls[-1].messages
    first_reply = next(i for i, m in enumerate(last) if m["role"] == "assistant")
    return [m["content"] for m in last[first_reply:] if m["role"] != "assistant"]


# ---- a scripted policy solves every sql task -------------------------------------------------------


async def test_the_generic_agent_solves_every_sql_task_through_the_pipeline(
    nats_url, settings, js, topology, template, span_exporter
):
    tasks = load_tasks()
    async with (
        fake_model(reply=scripted(template, solve_sql)) as model,
        sql_worker(settings, capacity=64) as worker,
    ):
        # the shipped task file as it is: each row is the environment's task
        assert await produce(nats_url, settings, "--agent", "db", "--file", str(SQL_TASKS),
                             "--run", "sql") == 0  # fmt: skip
        assert await consume(nats_url, "--agent", "db", "--env", "sql", "--llm", model.url,
                             "--concurrency", "16", "--max-turns", "4") == 0  # fmt: skip
    assert worker.counters.starts == worker.counters.closed == len(tasks)
    trajectories = await TrajectoryReader(js, topology).read("sql", "db")
    assert sorted(t.task_id for t in trajectories) == sorted(tasks)
    for traj in trajectories:
        assert (traj.status, traj.reward) == ("ok", 1.0), (traj.task_id, traj.error)
        metrics = traj.metrics
        assert (metrics["turns"], metrics["steps"], metrics["env_score"]) == (2, 2, 1.0)
        assert (metrics["done"], metrics["truncated"], metrics["tool_call_errors"]) == (1, 0, 0)
        assert metrics["env_committed"] == 1.0 and metrics["env_queries"] == 1.0
        [record] = traj.metadata["envs"]
        assert (record["env"], record["steps"], record["score"], record["done"]) == (
            "sql", 2, 1.0, True,
        )  # fmt: skip
        assert record["worker"] == worker.config.worker_id and record["error"] is None

    # every call saw the environment's tools, rendered by the chat template
    first = model.requests[0]["input_ids"]
    assert '"name": "execute_sql"' in template.decode(first)

    # the rollout's trace: env.start, two env.step, env.close and two chat spans under it
    traj = next(t for t in trajectories if t.task_id == "join-01")
    spans = [
        s
        for s in span_exporter.get_finished_spans()
        if f"{s.context.trace_id:032x}" == traj.trace_id
    ]
    names = sorted(s.name for s in spans if s.name.startswith(("env.", "chat")))
    assert names == ["chat tiny", "chat tiny", "env.close", "env.start", "env.step", "env.step"]
    steps = sorted(
        (s for s in spans if s.name == "env.step"), key=lambda s: s.attributes["agentarium.env.seq"]
    )
    assert [list(s.attributes["agentarium.env.tools"]) for s in steps] == [
        ["execute_sql"], ["commit_final_answer"],
    ]  # fmt: skip
    assert steps[-1].attributes["agentarium.env.reward"] == 1.0
    rollout = next(s for s in spans if s.name == "rollout")
    assert all(
        s.parent.span_id == rollout.context.span_id for s in spans if s.name.startswith("env.")
    )

    # environment tokens are context: in the next prompt, never in a trained span
    first_call, second_call = traj.calls
    [row], how = rows_of(traj, "concat")
    assert how == "concat"  # the scripted replies re-render token for token
    assert trained_spans(row) == [first_call.response_ids, second_call.response_ids]
    gap = row.response_ids[
        len(first_call.response_ids) : len(second_call.prompt_ids) - len(first_call.prompt_ids)
    ]
    assert set(
        row.response_mask[len(first_call.response_ids) : len(first_call.response_ids) + len(gap)]
    ) == {0}
    [tool_result] = environment_texts(traj)
    assert tool_result.startswith(
        "[("
    ) and f"<tool_response>\n{tool_result}\n</tool_response>" in template.decode(gap)
    for row in rows_of(traj, "per-call")[0]:
        assert tool_result not in template.decode(row.response_ids) and set(row.response_mask) == {
            1
        }


async def test_eval_run_with_env_runs_the_generic_agent_in_process(
    nats_url, settings, template, tmp_path
):
    from agentarium.evaluation import EvalConfig, EvalRun

    file = tmp_path / "tasks.jsonl"
    file.write_text(
        "".join(
            json.dumps({"id": i, "index": i}) + "\n" for i in ("select-01", "update-01", "join-02")
        )
    )
    async with (
        fake_model(reply=scripted(template, solve_sql)) as model,
        sql_worker(settings),
    ):
        cfg = EvalConfig.of(agent="db", env="sql", tasks_file=str(file), k=2,
                            out_dir=str(tmp_path / "out"), llm=(model.url,))  # fmt: skip
        assert await EvalRun(cfg, settings, out=open(os.devnull, "w")).run() == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["reward_mean"] == 1.0 and summary["missing"] == 0
    with pytest.raises(ValueError, match="not both|one or the other"):
        EvalRun(EvalConfig.of(agent="db=agentarium.examples.toy:rollout", env="sql",
                              tasks_file=str(file), llm=(model.url,)), settings)  # fmt: skip


# ---- the turn limit and a full context ----------------------------------------------------------


async def test_turn_limit_and_a_full_context_end_the_episode_truncated(
    nats_url, settings, js, topology, template
):
    """A policy that only ever looks (never commits) is cut by --max-turns, or when its
    conversation outgrows the model's context: stored ok, scored by the environment (0)."""

    def looks(prompt: str) -> str:
        return tool_call_text("execute_sql", {"query": "SELECT COUNT(*) FROM employees"})

    observation = await SqlEnvironment().reset({"index": "aggregate-01"})
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "execute_sql", "arguments": {"query": "SELECT COUNT(*) FROM employees"}}}]}  # fmt: skip
    turn = [call, {"role": "tool", "content": "[(10,)]"}]

    def prompt_len(turns: int) -> int:
        messages = [*observation.messages, *turn * turns]
        return len(template.encode_chat(messages, tools=observation.tools))

    # room for two calls: the third prompt, with its max_new_tokens, is over the context
    context = prompt_len(2) + SAMPLING.max_new_tokens - 1
    assert prompt_len(1) + SAMPLING.max_new_tokens <= context
    task = [{"index": "aggregate-01"}]
    async with (
        fake_model(reply=scripted(template, looks), context_len=context) as model,
        sql_worker(settings),
    ):
        await TaskProducer(js, topology).submit("looks", task, run="limit", sampling=SAMPLING)
        assert await consume(nats_url, "--agent", "looks", "--env", "sql", "--llm", model.url,
                             "--max-turns", "3") == 0  # fmt: skip
        model.context_len = None
        await TaskProducer(js, topology).submit("looks", task, run="turns", sampling=SAMPLING)
        assert await consume(nats_url, "--agent", "looks", "--env", "sql", "--llm", model.url,
                             "--max-turns", "3") == 0  # fmt: skip
    [full] = await TrajectoryReader(js, topology).read("limit", "looks")
    [turns] = await TrajectoryReader(js, topology).read("turns", "looks")
    for traj in (full, turns):
        assert (traj.status, traj.reward, traj.metrics["truncated"], traj.metrics["done"]) == (
            "ok", 0.0, 1.0, 0.0,
        )  # fmt: skip
        assert traj.metadata["envs"][0]["score"] == 0.0
    assert (full.metrics["turns"], full.metrics["context_full"], len(full.calls)) == (2, 1.0, 2)
    assert (turns.metrics["turns"], turns.metrics["context_full"], len(turns.calls)) == (3, 0.0, 3)
    assert turns.metrics["steps"] == 3 and turns.metrics["env_queries"] == 3


# ---- the tiny model: whatever it says, trajectories are stored and environment turns masked -----


async def test_the_tiny_model_plays_sql_and_environment_turns_are_masked(
    nats_url, settings, js, topology, template, engine_url
):
    tasks = [{"index": "select-01"}, {"index": "aggregate-01"}]
    async with sql_worker(settings) as worker:
        await TaskProducer(js, topology).submit(
            "tiny", tasks, run="tiny", group_size=2, sampling=Sampling(max_new_tokens=16)
        )
        assert await consume(nats_url, "--agent", "tiny", "--env", "sql", "--llm", engine_url,
                             "--max-turns", "2") == 0  # fmt: skip
    assert worker.counters.closed == 4 and worker.open_sessions == 0
    trajectories = await TrajectoryReader(js, topology).read("tiny", "tiny")
    assert len(trajectories) == 4
    for traj in trajectories:
        assert traj.status == "ok" and traj.reward in (0.0, 1.0)
        [record] = traj.metadata["envs"]
        assert record["steps"] == traj.metrics["steps"] == len(traj.calls) == traj.metrics["turns"]
        assert all(c.prompt_ids and c.response_ids for c in traj.calls)
        # what the environment said between calls: in the next prompt, never trained on
        said = []
        for before, call in zip(traj.calls, traj.calls[1:], strict=False):
            texts = [m["content"] for m in call.messages[len(before.messages) : -1]]
            assert texts and all(t in template.decode(call.prompt_ids) for t in texts)
            said += texts
        for mode in ("concat", "per-call"):
            rows, _ = rows_of(traj, mode)
            trained = [span for row in rows for span in trained_spans(row)]
            assert sum(map(len, trained)) == sum(len(c.response_ids) for c in traj.calls)
            assert not [t for t in said for span in trained if t in template.decode(span)]
        if len(traj.calls) == 2 and rows_of(traj, "concat")[1] == "concat":
            [row], _ = rows_of(traj, "concat")
            assert trained_spans(row) == [c.response_ids for c in traj.calls]
    assert any(len(t.calls) == 2 for t in trajectories)  # the model never solves one at once


# ---- a worker killed mid-session: the rollout runs again elsewhere ------------------------------


async def session_holder(nc, topology) -> str:
    """The worker holding the one open sql session, from the service API's stats (asked again
    while a busy machine's worker has not answered in time)."""
    for _ in range(50):
        found = [
            w["worker"]
            for env in await collect_env_status(nc, topology)
            for w in env.workers
            if w["sessions"] == 1
        ]
        if found:
            return found[0]
    raise AssertionError("no worker reports the open session")


async def test_a_killed_environment_worker_fails_the_rollout_over_to_another(
    nats_url, nc, js, topology, template
):
    async with (
        serve_process(nats_url, "--capacity", "4", command=SQL) as (one, one_id),
        serve_process(nats_url, "--capacity", "4", command=SQL) as (two, two_id),
        fake_model(reply=scripted(template, solve_sql)) as model,
    ):
        model.gate = asyncio.Event()  # the model's first call waits: the session is open
        await TaskProducer(js, topology).submit("db", [{"index": "join-01"}], run="kill")
        consumer = asyncio.create_task(
            consume(nats_url, "--agent", "db", "--env", "sql", "--llm", model.url)
        )
        await model.wait_for_requests(1)
        holder = await session_holder(nc, topology)
        victim, survivor = (one, two_id) if holder == one_id else (two, one_id)
        victim.send_signal(signal.SIGKILL)
        await victim.wait()
        model.gate.set()
        assert await asyncio.wait_for(consumer, 60) == 0
    [traj] = await TrajectoryReader(js, topology).read("kill", "db")  # stored once
    assert (traj.status, traj.reward, traj.attempts) == ("ok", 1.0, 2)
    [record] = traj.metadata["envs"]
    assert record["worker"] == survivor and record["score"] == 1.0
    assert len(model.requests) == 3  # the lost attempt's one call, then two


# ---- AgentOrchestrator ------------------------------------------------------------------------------


@contextmanager
def env_serve_sync(nats_url: str):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentarium", "env", "serve", "sql", "--nats-url", nats_url],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT, text=True,
    )  # fmt: skip
    try:
        assert "serving" in proc.stdout.readline()
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_the_orchestrator_registers_the_generic_agent_by_env(nats_url, template):
    from orchestrator_env import ThreadedFake

    from agentarium import AgentOrchestrator

    tasks = load_tasks()
    rows = [tasks[i] for i in ("select-03", "join-05", "update-02")]
    with (
        env_serve_sync(nats_url),
        ThreadedFake(reply=scripted(template, solve_sql)) as fake,
        AgentOrchestrator(
            [fake.url], nats_url=nats_url, group_size=2, concurrency=8, attempts=1, progress=False
        ) as orch,  # fmt: skip
    ):
        with pytest.raises(ValueError, match="not both"):
            orch.register_agent_type("db", solve_sql, env="sql")
        orch.register_agent_type("db", env="sql", max_turns=4)
        orch.initialize_batch_processing(data=rows, is_train=True)
        assert orch.wait_for_batch_completion(timeout=60) == {
            "jobs": 6, "ok": 6, "error": 0, "timeout": 0,
        }  # fmt: skip
        batch, metrics = orch.generate_training_batch(
            max_prompt_length=2048, max_response_length=512, device="cpu"
        )
        trajectories = orch.trajectories()
    assert metrics["db/reward_mean"] == 1.0 and metrics["batch/concatenated"] == 6
    assert metrics["batch/truncated_prompts"] == 0 and metrics["batch/truncated_responses"] == 0
    for i, traj in enumerate(trajectories):
        assert batch["job_id"][i] == traj.job_id and traj.metadata["envs"][0]["score"] == 1.0
        # trained: the two replies; the tool result between them is in the row, mask 0
        assert int(batch["response_mask"][i].sum()) == sum(len(c.response_ids) for c in traj.calls)


# ---- the command line -------------------------------------------------------------------------------


def test_consumer_env_flags_config_keys_and_errors(tmp_path):
    from agentarium.consumers import AgentSpec, EnvAgent

    args = cli(
        "consumer", "--agent", "db", "--env", "sql", "--llm", "http://a:1", "--max-turns", "5"
    )
    config, _ = consumer_cmd.config_from_args(args)
    name, fn = consumer_cmd.build_agent(config)
    assert (name, fn) == ("db", EnvAgent("sql", 5))
    spec = AgentSpec.of(fn, name)
    assert (spec.style, spec.kind, spec.envs) == ("llm", "async", True)

    path = tmp_path / "c.yaml"
    path.write_text("agent: db\nenv: shell\nmax_turns: 3\nllm: http://a:1\n")
    config, source = consumer_cmd.config_from_args(cli("consumer", "--config", str(path)))
    assert (config.rollout.env, config.rollout.max_turns) == ("shell", 3)
    assert source["set_by"]["env"] == "file"

    def refused(*argv: str) -> str:
        with pytest.raises(ValueError) as err:
            consumer_cmd.config_from_args(cli("consumer", "--llm", "http://a:1", *argv))
        return str(err.value)

    assert "names its own rollout function" in refused(
        "--agent", "db=agentarium.examples.toy:rollout", "--env", "sql"
    )
    assert "or NAME with --env ENV" in refused("--agent", "db")
    assert "env 'a.b' is not a valid name" in refused("--agent", "db", "--env", "a.b")
    assert "--max-turns must be >= 1" in refused(
        "--agent", "db", "--env", "sql", "--max-turns", "0"
    )


def test_eval_run_refuses_env_with_an_agent_function(capsys):
    from agentarium.commands import eval_cmd

    args = cli("eval", "run", "--agent", "db=agentarium.examples.toy:rollout", "--env", "sql",
               "--file", str(SQL_TASKS), "--llm", "http://a:1")  # fmt: skip
    assert eval_cmd.cmd_eval_run(args) == 2
    assert "names its own rollout function" in capsys.readouterr().err


async def test_a_step_lost_with_its_worker_is_found_by_the_next_resend(nc, topology):
    """The race behind a killed worker: the server delivers a step to the worker's
    subscription before it sees the connection close, and the request is lost with it. A
    stand-in worker takes the step and unsubscribes without answering; the client must learn by
    its next resend (no responders) that the worker is gone, within RESEND_S plus scheduling,
    not after the step's whole 60 s timeout."""
    from agentarium.consumers.agents.envclient import RESEND_S, EnvClient
    from agentarium.consumers.errors import EnvironmentUnavailable
    from agentarium.schemas import EnvStart, EnvStarted, Observation, decode, encode

    subject = f"{topology.prefix}.env.lost.s.w1.session"
    took_step = asyncio.Event()

    async def on_start(msg) -> None:
        start = decode(EnvStart, msg.data, (msg.headers or {}).get("Content-Type"))
        started = EnvStarted(
            session_id=start.session_id, worker="w1", subject=subject, observation=Observation()
        )
        await msg.respond(encode(started))

    async def on_step(msg) -> None:  # delivered, never answered: the worker is gone
        took_step.set()
        await worker.unsubscribe()

    starts = await nc.subscribe(topology.env_start_subject("lost"), cb=on_start)
    worker = await nc.subscribe(subject, cb=on_step)
    loop = asyncio.get_running_loop()
    try:
        async with EnvClient(nc, topology, step_timeout_s=60.0).session("lost", {}) as env:
            began = loop.time()
            with pytest.raises(EnvironmentUnavailable, match="is gone"):
                await env.step({"role": "assistant", "content": "ls"})
            waited = loop.time() - began
    finally:
        await starts.unsubscribe()
    assert took_step.is_set()
    assert waited < RESEND_S + 5.0, waited  # one resend period, not the 60 s timeout
