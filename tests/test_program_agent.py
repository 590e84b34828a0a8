"""Program agents (``--agent NAME=exec:CMD``) end to end: `agentarium consumer` runs a Node.js
and a bash program per job against the real local engine through the rollout's gateway, and
the trajectories are read back from a real nats-server.

What a user relies on: the program's LLM call is in the trajectory token-exact; its reward
comes from its last JSON line or from a scorer; a hung program and every process it started
(children, grandchildren, one that left its session) are gone at the deadline, on a drain
and when the consumer is SIGKILLed, whose jobs another consumer then redoes, each stored
once; a failing program is an agent error with its stderr in
the reason, never a reward of 0; output is kept bounded; a bad spec is refused clearly.
"""

from __future__ import annotations

import asyncio
import atexit
import io
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
from clilib import cli, consume
from envlib import sql_worker
from worker_env import dead_letters

from agentarium.broker import NatsSettings
from agentarium.commands import consumer_cmd
from agentarium.consumers import (
    AgentLoadError,
    AgentSpec,
    ConsumerService,
    ConsumerSettings,
    ConsumerSpec,
    LLMTarget,
    ProgramAgent,
    ProgramOutput,
    ProgramSettings,
    load_agent,
    program_agent,
)
from agentarium.environments.sql import load_tasks
from agentarium.evaluation import EvalConfig, EvalRun
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.schemas import Sampling

ROOT = Path(__file__).resolve().parents[1]


def _readable_copy(src: Path) -> Path:
    """The test programs where every user can read them: as root the consumer runs a program
    as ``nobody``, which cannot enter a checkout under a private directory (a fresh clone in
    ``mktemp -d``, mode 0700)."""
    dest = Path(tempfile.mkdtemp(prefix="agentarium-programs-"))
    atexit.register(shutil.rmtree, dest, True)
    dest.chmod(0o755)
    for program in src.iterdir():
        shutil.copy2(program, dest / program.name)
        (dest / program.name).chmod(0o755)
    return dest


PROGRAMS = _readable_copy(Path(__file__).resolve().parent / "programs")
TASK = {"prompt": "repeat 7", "answer": "7"}
NODE = shutil.which("node")


def processes(marker: str) -> list[int]:
    """Live processes with ``marker`` among their arguments: programs/hang.sh's sleeps, the
    shell itself and its supervisor."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in argv and state != b"Z":
            found.append(int(name))
    return found


def processes_including(marker: str, pids: list[int], timeout: float) -> list[int]:
    """``processes(marker)`` once it holds every one of ``pids``. A program reports its
    children's pids as it forks them, and a child may still be in its ``execve`` when the test
    looks: /proc then shows its command line empty, for as long as the loaded machine takes to
    finish the exec. Polls: no event says an exec is done."""
    deadline = time.monotonic() + timeout
    while not set(pids) <= set(found := processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def await_exit(pids: list[int], timeout: float) -> list[int]:
    """Wait (on pidfds: an event per process, no polling) until ``pids`` have exited; the
    ones still alive after ``timeout``."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    try:
        ready, _, _ = select.select(list(fds), [], [], timeout) if fds else ([], [], [])
        while len(ready) < len(fds):
            more, _, _ = select.select([f for f in fds if f not in ready], [], [], timeout)
            if not more:
                break
            ready += more
        return [pid for fd, pid in fds.items() if fd not in ready]
    finally:
        for fd in fds:
            os.close(fd)


def fifo_line(path: Path, timeout: float) -> str:
    """The first line written into the FIFO ``path`` (what programs/hang.sh says once all its
    processes run)."""
    return fifo_lines(path, 1, timeout)[0]


def fifo_lines(path: Path, n: int, timeout: float) -> list[str]:
    """The first ``n`` lines written into the FIFO ``path``, by one writer or several. Opened
    for reading and writing: a writer that closes never makes it read as ended."""
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        data = b""
        while (lines := data.count(b"\n")) < n:
            ready, _, _ = select.select([fd], [], [], timeout)
            assert ready, f"{lines} of {n} lines came through {path} in {timeout}s"
            data += os.read(fd, 4096)
        return data.decode().splitlines()[:n]
    finally:
        os.close(fd)


def alive(pgids: set[int], pids: set[int]) -> list[int]:
    """Live processes (zombies are dead) in one of the process groups ``pgids`` or among
    ``pids``."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state, _, pgrp = f.read().rsplit(b")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if state != b"Z" and (int(pgrp) in pgids or int(name) in pids):
            found.append(int(name))
    return found


async def gone(pgids: set[int], pids: set[int], timeout: float) -> list[int]:
    """Poll the process table (a process group has no event to await) until nothing of
    ``pgids`` and ``pids`` is alive; what still is after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (left := alive(pgids, pids)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    return left


@pytest.mark.skipif(NODE is None, reason="node is not installed")
async def test_a_node_program_chats_through_the_gateway_and_prints_its_reward(
    nats_url, js, topology, template, engine_url, monkeypatch
):
    monkeypatch.setenv("CONSUMER_ONLY_SECRET", "s3cr3t")  # must not reach the program
    monkeypatch.setenv("PASSED_ON", "yes")
    await TaskProducer(js, topology).submit(
        "node", [TASK], run="prog", group_size=2, sampling=Sampling(max_new_tokens=8)
    )
    assert await consume(
        nats_url, "--agent", f"node=exec:node {PROGRAMS / 'chat.mjs'}", "--llm", engine_url,
        "--program-env", "PASSED_ON", "--program-env", "SET_HERE=1",
    ) == 0  # fmt: skip
    trajectories = await TrajectoryReader(js, topology).read("prog", "node")
    assert len(trajectories) == 2
    for traj in trajectories:
        assert traj.status == "ok" and traj.reward in (0.0, 1.0)
        program = traj.metadata["program"]
        assert program["exit_code"] == 0 and program["stopped"] is False
        # split on "\n" only: splitlines() also splits on U+0085, U+2028 and U+2029, which a
        # sampled reply may hold and JSON.stringify writes as they are
        saw = json.loads(program["stdout"].split("\n")[0])
        assert traj.metrics["reply_chars"] == len(saw["reply"])
        # the one LLM call, token-exact: the engine's ids for exactly the prompt the program sent
        [call] = traj.calls
        assert call.messages[0] == {"role": "user", "content": TASK["prompt"]}
        assert call.prompt_ids == template.encode_chat(call.messages[:1])
        assert call.response_ids and len(call.response_logprobs) == len(call.response_ids)
        reply = template.decode(call.response_ids, skip_special_tokens=True)
        assert saw["reply"] == reply
        # its own directory, user and environment: the gateway's variables and ours only
        assert saw["same_task"] and saw["cwd"].endswith("/work") and saw["home"].endswith("/home")
        assert saw["uid"] == (65534 if os.geteuid() == 0 else os.geteuid())
        assert {"OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY",
                "AGENTARIUM_TASK_FILE", "PASSED_ON", "SET_HERE"} <= set(saw["env"])  # fmt: skip
        assert "CONSUMER_ONLY_SECRET" not in saw["env"]
        # the endpoint's secret, printed by the program, is masked in what is stored
        assert "/r/***/v1" in program["stderr"]
        assert not Path(saw["cwd"]).parent.exists()  # the working directory is gone


async def test_a_bash_program_with_a_setup_and_a_scorer(
    nats_url, js, topology, template, engine_url
):
    await TaskProducer(js, topology).submit(
        "ask", [TASK], run="prog", sampling=Sampling(max_new_tokens=4)
    )
    assert await consume(
        nats_url, "--agent", f"ask=exec:{PROGRAMS / 'ask.sh'}", "--llm", engine_url,
        "--program-setup", "programlib:setup", "--program-scorer", "programlib:score",
    ) == 0  # fmt: skip
    [traj] = await TrajectoryReader(js, topology).read("prog", "ask")
    assert traj.status == "ok" and traj.reward in (0.0, 1.0)
    [call] = traj.calls
    assert call.messages[0]["content"] == TASK["prompt"]  # from the setup's file
    reply = template.decode(call.response_ids, skip_special_tokens=True)
    assert traj.metrics == {"reply_chars": len(reply), "exit_code": 0}
    assert traj.reward == float(reply.strip() == TASK["answer"])


async def test_a_hung_program_and_all_it_started_die_at_the_deadline(
    nats_url, js, topology, engine_url
):
    marker = "3171"
    await TaskProducer(js, topology).submit("hang", [{}], run="prog", deadline_s=1.5)
    assert await consume(
        nats_url, "--agent", f"hang=exec:{PROGRAMS / 'hang.sh'} {marker}", "--llm", engine_url,
        "--program-kill-grace", "0.2",
    ) == 0  # fmt: skip
    [traj] = await TrajectoryReader(js, topology).read("prog", "hang")
    assert traj.status == "timeout" and traj.reward is None
    assert "deadline of 1.5s" in traj.error
    program = traj.metadata["program"]
    assert program["stopped"] is True and program["stdout"].startswith("pids ")
    assert len(program["stdout"].split()) == 4  # child, grandchild, escaped: all started
    assert processes(marker) == []


async def test_a_failing_program_is_an_agent_error_with_its_stderr(
    nats_url, js, topology, engine_url
):
    await TaskProducer(js, topology).submit("fails", [{}], run="prog")
    command = "exec:bash -c 'echo starting; echo the disk is full >&2; exit 3'"
    assert await consume(
        nats_url, "--agent", f"fails={command}", "--llm", engine_url, "--attempts", "2"
    ) == 1  # fmt: skip
    [traj] = await TrajectoryReader(js, topology).read("prog", "fails")
    assert traj.status == "error" and traj.reward is None and traj.attempts == 2
    assert "exited with status 3" in traj.error and "the disk is full" in traj.error
    [letter] = await dead_letters(js, topology)
    assert "the disk is full" in letter.error


async def test_output_is_kept_bounded_and_the_reward_line_still_counts(
    nats_url, js, topology, engine_url
):
    await TaskProducer(js, topology).submit("loud", [{}], run="prog")
    loud = (
        'exec:bash -c \'head -c 300000 /dev/zero | tr "\\0" x; echo; '
        'head -c 200000 /dev/zero | tr "\\0" y >&2; echo "{\\"reward\\": 0.25}"\''
    )
    assert await consume(
        nats_url, "--agent", f"loud={loud}", "--llm", engine_url, "--program-output-bytes", "1000"
    ) == 0  # fmt: skip
    [traj] = await TrajectoryReader(js, topology).read("prog", "loud")
    assert traj.status == "ok" and traj.reward == 0.25
    program = traj.metadata["program"]
    assert len(program["stdout"]) == 1000 and program["stdout"].endswith('{"reward": 0.25}\n')
    assert program["stdout_bytes"] == 300000 + 1 + len('{"reward": 0.25}\n')
    assert program["stderr"] == "y" * 1000 and program["stderr_bytes"] == 200000


async def test_a_program_without_a_reward_line_is_an_agent_error(
    nats_url, js, topology, engine_url
):
    await TaskProducer(js, topology).submit("quiet", [{}], run="prog")
    assert await consume(
        nats_url, "--agent", "quiet=exec:echo done", "--llm", engine_url, "--attempts", "1"
    ) == 1  # fmt: skip
    [traj] = await TrajectoryReader(js, topology).read("prog", "quiet")
    assert traj.status == "error" and "printed no reward" in traj.error


def test_bad_specs_are_refused_with_what_to_write(capsys):
    for spec, said in (
        ("exec:", "names no program"),
        ("exec:   ", "names no program"),
        ("exec:'node agent.js", "cannot split the command line"),
        ("exec:no-such-program-3171", "'no-such-program-3171' is not an executable file on PATH"),
        ("exec:./nowhere/run.sh", "is not an executable file"),
    ):
        with pytest.raises(AgentLoadError, match=said):
            load_agent(spec)
    with pytest.raises(ValueError, match="is set by the consumer"):
        ProgramSettings(env=("OPENAI_API_KEY=mine",))
    with pytest.raises(ValueError, match="NAME or NAME=VALUE"):
        ProgramSettings(env=("not a name",))
    with pytest.raises(ValueError, match="no such user"):
        ProgramAgent(("/bin/true",), ProgramSettings(user="no-such-user-3171"))
    # the command line: exit status 2 and the reason
    args = cli("consumer", "--agent", "x=exec:no-such-program-3171", "--llm", "http://127.0.0.1:9")
    config, source = consumer_cmd.config_from_args(args)
    assert asyncio.run(consumer_cmd.consume(args, config, source)) == 2
    assert "not an executable file on PATH" in capsys.readouterr().err


async def test_a_drain_ends_the_program_and_everything_it_started(
    js, topology, fake, tiny_dir, tmp_path
):
    marker, ready = "3172", tmp_path / "ready"
    os.mkfifo(ready)
    agent = ProgramAgent(
        (str(PROGRAMS / "hang.sh"), marker),
        ProgramSettings(user="self", env=(f"READY={ready}",), kill_grace_s=0.2),
    )
    settings = ConsumerSettings.of(drain_grace_s=0.0, worker_id="drain-test")
    spec = ConsumerSpec(
        agent="drain", fn=agent, target=LLMTarget(urls=(fake.url,)), model_dir=str(tiny_dir),
        model_name="tiny", settings=settings,
    )  # fmt: skip
    service = await ConsumerService(js, topology, spec).start()
    await TaskProducer(js, topology).submit("drain", [{}], run="prog")
    *pids, _ = (await asyncio.to_thread(fifo_line, ready, 30)).split()
    pids = [int(p) for p in pids]
    # the sleeps, the shell and its supervisor
    running = await asyncio.to_thread(processes_including, marker, pids, 10)
    assert set(pids) < set(running)
    service.drain()
    await service.wait()
    assert await asyncio.to_thread(await_exit, running, 10) == []


async def test_a_sigkilled_consumer_loses_no_job_and_leaves_no_process_of_its_program(
    nats_url, js, topology, engine_url, tmp_path
):
    """Three program rollouts hang in one consumer, which is SIGKILLed: every process of each
    program (its group, its supervisor, one that left its session) is gone, and a second
    consumer reruns the three jobs once their deliveries time out: one ``ok`` trajectory per
    job, none lost, none twice."""
    ready, runs = tmp_path / "ready", tmp_path / "runs"
    os.mkfifo(ready)
    runs.touch()
    jobs = (await TaskProducer(js, topology).submit(
        "redo", [{"task_id": f"t{i}"} for i in range(3)], run="prog",
        sampling=Sampling(max_new_tokens=2),
    )).job_ids  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [
        sys.executable, "-m", "agentarium", "consumer", "--nats-url", nats_url, "--llm", engine_url,
        "--agent", f"redo=exec:{PROGRAMS / 'hang_once.sh'}", "--program-user", "self",
        "--program-env", f"READY={ready}", "--program-env", f"RUNS={runs}",
        "--program-kill-grace", "0.2", "--ack-wait", "3", "--retry-delay", "0.05",
    ]  # fmt: skip

    async def start(name: str, *extra: str) -> asyncio.subprocess.Process:
        with open(tmp_path / f"{name}.log", "wb") as log:
            return await asyncio.create_subprocess_exec(
                *argv, *extra, stdout=log, stderr=log, env=env
            )

    first = await start("first")
    try:
        lines = asyncio.create_task(asyncio.to_thread(fifo_lines, ready, 3, 60))
        exited = asyncio.create_task(first.wait())
        await asyncio.wait([lines, exited], return_when=asyncio.FIRST_COMPLETED)
        log_tail = (tmp_path / "first.log").read_text()[-3000:]
        assert not exited.done(), f"the consumer exited ({first.returncode}):\n{log_tail}"
        exited.cancel()
        try:
            started = [line.split() for line in await lines]
        except AssertionError as exc:  # no program started: what the consumer said
            raise AssertionError(f"{exc}; the consumer's log:\n{log_tail}") from None
        assert sorted(job for job, *_ in started) == sorted(jobs)
        pgids = {int(pgid) for _, pid, pgid, *_ in started if pid == pgid}  # each leads its group
        assert len(pgids) == 3
        others = {int(p) for _, _, _, sup, escaped, _ in started for p in (sup, escaped)}
        # Read before the kill: once the consumer is dead its supervisors start killing.
        assert set(alive(pgids, others)) > others  # all running as the consumer dies
    finally:
        first.send_signal(signal.SIGKILL)
        await first.wait()
    assert await gone(pgids, others, 10) == []
    assert not any(Path(work).parent.exists() for *_, work in started)

    # Not --burst: a burst consumer started before the lost deliveries' ack wait ends could
    # find nothing pending and exit; this one runs until the three trajectories are stored.
    second = await start("second")
    reader = TrajectoryReader(js, topology)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while len(trajectories := await reader.read("prog", "redo")) < len(jobs):
            assert loop.time() < deadline, f"{len(trajectories)} of {len(jobs)} redone"
            assert second.returncode is None, "the second consumer exited"
            await asyncio.sleep(0.2)
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(second.wait(), 30)
        except TimeoutError:
            second.kill()
            await second.wait()
    trajectories = await reader.read("prog", "redo")
    assert sorted(t.job_id for t in trajectories) == sorted(jobs)  # none lost, none twice
    for traj in trajectories:
        assert traj.status == "ok" and traj.reward == 1.0 and len(traj.calls) == 1
        assert traj.attempts == 2  # the delivery after the one lost with its consumer
    ran = [line.split() for line in runs.read_text().splitlines()]
    assert sorted(job for job, *_ in ran) == sorted(jobs * 2)  # each killed once, redone once
    assert {int(pgid) for *_, pgid in ran} >= pgids and len({pgid for *_, pgid in ran}) == 6


def test_the_repo_task_recipe_scores_its_reference_fix(tmp_path):
    from agentarium.examples import repo_task

    for line in (ROOT / "examples" / "repo_tasks.jsonl").read_text().splitlines():
        task = json.loads(line)
        for fixed in (False, True):
            work = tmp_path / f"{task['id']}-{fixed}" / "work"
            work.mkdir(parents=True)
            repo_task.setup(task, work)
            for path, text in task["reference"].items() if fixed else ():
                (work / path).write_text(text)
            output = ProgramOutput(
                command=("agent",), exit_code=0, stdout="", stderr="", stdout_bytes=0,
                stderr_bytes=0, seconds=0.0,
            )  # fmt: skip
            result = repo_task.score(task, work, output)
            assert result["reward"] == float(fixed), task["id"]
            assert result["metrics"]["files_changed"] == float(fixed)


@pytest.mark.skipif(NODE is None, reason="node is not installed")
async def test_a_program_acts_in_an_environment_session_which_scores_it(
    nats_url, settings, js, topology, engine_url
):
    task = load_tasks()["select-01"]
    async with sql_worker(settings) as worker:
        await TaskProducer(js, topology).submit("sqlprog", [task], run="prog")
        assert await consume(
            nats_url, "--agent", f"sqlprog=exec:node {PROGRAMS / 'sql_env.mjs'}", "--env", "sql",
            "--llm", engine_url,
        ) == 0  # fmt: skip
    assert worker.counters.closed == 1 and worker.open_sessions == 0
    [traj] = await TrajectoryReader(js, topology).read("prog", "sqlprog")
    assert traj.status == "ok" and traj.reward == 1.0 and traj.calls == []
    [session] = traj.metadata["envs"]
    assert session["env"] == "sql" and session["steps"] == 2 and session["score"] == 1.0
    assert traj.metrics["steps"] == 2 and traj.metrics["env_score"] == 1.0
    saw = json.loads(traj.metadata["program"]["stdout"])
    assert saw["done"] and {"execute_sql", "commit_final_answer"} <= set(saw["tools"])


def test_config_files_eval_and_python_name_program_agents_alike(tmp_path):
    path = tmp_path / "consumer.yaml"
    path.write_text(
        "agent: swe=exec:bash -c 'exit 0'\nllm: http://a:1\nenv: sql\n"
        "program_user: self\nprogram_env: [A=1]\nprogram_kill_grace_s: 2\n"
    )
    config, _ = consumer_cmd.config_from_args(cli("consumer", "--config", str(path)))
    name, agent = consumer_cmd.build_agent(config)
    settings = ProgramSettings(user="self", env=("A=1",), kill_grace_s=2.0)
    bash = shutil.which("bash")
    assert (name, agent) == ("swe", ProgramAgent((bash, "-c", "exit 0"), settings, "sql"))
    spec = AgentSpec.of(agent, name)
    assert (spec.style, spec.kind, spec.envs) == ("endpoint", "async", True)
    # eval and register_agent_type take the same spec, and program_agent the settings
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "x"}\n')
    assert (
        EvalConfig.of(agent="swe=exec:bash", tasks_file=str(tasks), env="sql").agent_fn
        == "exec:bash"
    )
    assert load_agent("exec:bash -c 'exit 0'") == ProgramAgent((bash, "-c", "exit 0"))
    assert program_agent("bash -c 'exit 0'", env="sql", user="self") == ProgramAgent(
        (bash, "-c", "exit 0"), ProgramSettings(user="self"), "sql"
    )


@pytest.mark.skipif(NODE is None, reason="node is not installed")
async def test_eval_runs_a_program_agent(nats_url, js, topology, engine_url, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({**TASK, "task_id": f"t{i}"}) + "\n" for i in range(2)))
    cfg = EvalConfig.of(
        agent=f"js=exec:node {PROGRAMS / 'chat.mjs'}", tasks_file=str(tasks), k=2,
        out_dir=str(tmp_path / "out"), run="evalprog", llm=(engine_url,), max_new_tokens=8,
    )  # fmt: skip
    stdout = io.StringIO()
    assert await EvalRun(cfg, NatsSettings(url=nats_url), out=stdout, err=io.StringIO()).run() == 0
    stored = await TrajectoryReader(js, topology).read("evalprog")
    assert len(stored) == 4 and all(t.status == "ok" and len(t.calls) == 1 for t in stored)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["missing"] == 0
