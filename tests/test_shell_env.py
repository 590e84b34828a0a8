"""The shell environment and its sandbox, used directly (no broker): every shipped task solved by
its reference commands, wrong answers scored 0, and each bad action the issue names (malformed
calls, a fork bomb, a 2 GB allocation, an infinite loop, 100 MB of output) answered with an
observation while other sessions keep running. Limits that the host cannot enforce (not root,
no namespaces) are skipped with the reason ``isolation()`` gives; such a host runs the rest with
``allow_weaker_sandbox``. The probes a cheating or escaping policy would try, through
``EnvClient``: tests/test_sandbox_redteam.py."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from agentarium.environments import ShellEnvironment
from agentarium.environments.sandbox import Sandbox, SandboxError, SandboxLimits, isolation
from agentarium.environments.shell_tasks import TaskError
from agentarium.schemas import SessionOutcome, StepResult

ISO = isolation()
WEAKER = bool(ISO.missing)  # this host's sandbox lacks something: tests allow it explicitly
needs_uid = pytest.mark.skipif(
    ISO.mode not in ("namespaces", "uid"), reason=f"sandbox mode {ISO.mode} (not root)"
)
# the session's CPU time is watched as a whole (a cgroup's CPU accounting)
SESSION_CPU = "cpuacct" in ISO.cgroup.places and ISO.mode in ("namespaces", "uid")
needs_nproc = pytest.mark.skipif(not ISO.nproc, reason="no process limit on this host")
needs_net = pytest.mark.skipif(not ISO.network, reason="no network namespaces on this host")


def call(name: str, arguments: str | dict, call_id: str = "c1") -> dict:
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def message(*calls: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


def bash(command: str) -> dict:
    return message(call("bash", {"command": command}))


def live_pids(uid: int) -> list[int]:
    """Processes of ``uid`` that are not zombies, from /proc."""
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            state = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z":
            out.append(int(name))
    return out


@pytest.fixture
async def open_env(tmp_path):
    """``await open_env(task, **options)`` -> a reset ShellEnvironment, closed at the end."""
    envs: list[ShellEnvironment] = []

    async def make(task: dict | None = None, **options) -> ShellEnvironment:
        options.setdefault("base_dir", tmp_path / "sessions")
        options.setdefault("allow_weaker_sandbox", WEAKER)
        env = ShellEnvironment(**options)
        envs.append(env)
        await env.reset(task or {"description": "free play", "evaluation": {"answer": "x"}})
        return env

    yield make
    for env in envs:
        await env.close()


async def run_reference(
    env: ShellEnvironment, *, honest: bool = True
) -> tuple[StepResult, SessionOutcome]:
    """Play a task's reference solution (or a wrong answer) through step()."""
    assert env.task is not None
    ref, output, result = env.task.reference, "", None
    if honest:
        for command in ref.get("commands", []):
            result = await env.step(bash(command))
            assert result.done is False
            output = result.messages[0]["content"].rsplit("\n[", 1)[0]
    if not honest:
        finish = env.task.kind == "check"
        step = message(
            call("finish", "{}") if finish else call("commit_final_answer", {"answer": "-1 wrong"})
        )
    elif "answer" in ref:
        step = message(call("commit_final_answer", {"answer": ref["answer"]}))
    elif ref.get("answer_is_output"):
        step = message(call("commit_final_answer", {"answer": output.strip()}))
    else:
        step = message(call("finish", "{}"))
    result = await env.step(step)
    return result, await env.close()


async def test_a_scripted_policy_solves_every_shipped_task_and_wrong_answers_score_zero(tmp_path):
    ids = ShellEnvironment.indices()
    assert len(ids) >= 20 and len(set(ids)) == len(ids)

    async def play(task_id: str, honest: bool) -> tuple[str, float, float]:
        env = ShellEnvironment(base_dir=tmp_path / "sessions", allow_weaker_sandbox=WEAKER)
        observation = await env.reset({"index": task_id})
        assert [t["function"]["name"] for t in observation.tools] == [
            "bash",
            "commit_final_answer",
            "finish",
        ]
        assert observation.messages[-1]["content"] == env.task.description  # type: ignore[union-attr]
        result, outcome = await run_reference(env, honest=honest)
        assert result.done and outcome.info["finished"] and outcome.steps >= 1
        return task_id, result.reward, outcome.score  # type: ignore[return-value]

    solved = await asyncio.gather(*(play(i, True) for i in ids))
    assert [s for s in solved if s[1:] != (1.0, 1.0)] == []
    wrong = await asyncio.gather(*(play(i, False) for i in ids))
    assert [w for w in wrong if w[1:] != (0.0, 0.0)] == []
    assert list((tmp_path / "sessions").glob("s-*")) == []  # every session directory removed


async def test_malformed_unknown_and_missing_tool_calls_get_clear_observations(open_env):
    env = await open_env()
    result = await env.step({"role": "assistant", "content": "I think the answer is 4."})
    assert result.messages[0]["role"] == "user" and "No tool call" in result.messages[0]["content"]
    result = await env.step(
        message(
            call("bash", '{"command": "ls', "a"),
            call("rm_rf", {"path": "/"}, "b"),
            call("bash", {"cmd": "ls"}, "c"),
            call("bash", "[1, 2]", "d"),
            {"id": "e", "type": "function"},
            call("bash", {"command": "echo a\u0000b"}, "g"),
            call("bash", {"command": "echo still here"}, "f"),
        )
    )
    contents = {m["tool_call_id"]: m["content"] for m in result.messages}
    assert "not valid JSON" in contents["a"]
    assert "unknown tool 'rm_rf'" in contents["b"] and "commit_final_answer" in contents["b"]
    assert 'bash needs {"command"' in contents["c"]
    assert "must be a JSON object" in contents["d"]
    assert "malformed tool call" in contents["e"]
    assert "could not start: embedded null byte" in contents["g"]
    assert contents["f"] == "still here\n[exit code 0]"
    assert not result.done
    outcome = await env.close()
    assert outcome.score == 0.0 and outcome.info["finished"] is False
    assert outcome.metrics["invalid_calls"] == 6.0 and outcome.metrics["commands"] == 2.0


async def test_the_step_limit_ends_an_episode_unscored(open_env):
    env = await open_env(max_steps=2)
    assert not (await env.step(bash("true"))).done
    last = await env.step(bash("true"))
    assert last.done and last.reward == 0.0 and "step limit" in last.info["reason"]
    late = await env.step(message(call("commit_final_answer", {"answer": "x"})))
    assert late.done and late.messages == []
    assert (await env.close()).score == 0.0


async def test_bad_tasks_are_refused_with_the_reason(open_env, tmp_path):
    with pytest.raises(TaskError, match="no shell task 'nope'"):
        await ShellEnvironment(base_dir=tmp_path, allow_weaker_sandbox=WEAKER).reset(
            {"index": "nope"}
        )
    with pytest.raises(TaskError, match="exactly one of"):
        await ShellEnvironment(base_dir=tmp_path, allow_weaker_sandbox=WEAKER).reset(
            {"description": "d", "evaluation": {}}
        )
    with pytest.raises(TaskError, match="init script of task 'broken' failed"):
        await open_env(
            {"id": "broken", "description": "d", "init": "exit 3", "evaluation": {"answer": "x"}}
        )
    assert list(tmp_path.glob("sessions/s-*")) == []  # the failed reset cleaned up


@needs_nproc
async def test_a_fork_bomb_is_contained_and_other_sessions_keep_running(open_env):
    limits = {"nproc": 24, "wall_s": 3.0, "cpu_s": 5}
    bomber, other = await open_env(limits=limits), await open_env(limits=limits)
    started = time.monotonic()
    bomb = asyncio.create_task(bomber.step(bash("bomb() { bomb | bomb & }; bomb; sleep 10")))
    await asyncio.sleep(0.5)
    alive = await other.step(bash("echo alive"))  # while the bomb runs
    assert alive.messages[0]["content"] == "alive\n[exit code 0]"
    result = await bomb
    assert time.monotonic() - started < 8
    assert "wall-time limit (3 s)" in result.messages[0]["content"]
    assert subprocess.run(["true"]).returncode == 0  # this machine can still fork
    after = await bomber.step(bash("echo recovered"))
    assert after.messages[0]["content"] == "recovered\n[exit code 0]"
    if ISO.mode == "uid":
        assert live_pids(bomber.box.uid) == []  # type: ignore[union-attr]


async def test_a_2gb_allocation_fails_inside_the_command(open_env):
    env = await open_env()
    result = await env.step(bash("head -c 2G /dev/zero | tail | wc -c"))
    assert "tail: memory exhausted" in result.messages[0]["content"]
    result = await env.step(bash("python3 -c 'b = bytearray(2 * 1024**3)' || echo failed"))
    content = result.messages[0]["content"]
    assert "MemoryError" in content or "python3: command not found" in content


async def test_an_infinite_loop_is_killed_at_the_cpu_limit(open_env):
    env = await open_env(limits={"cpu_s": 1, "wall_s": 30.0})
    started = time.monotonic()
    result = await env.step(bash("while :; do :; done"))
    assert time.monotonic() - started < 20
    if SESSION_CPU:  # the session's processes together, watched by the worker
        assert result.messages[0]["content"].endswith("[killed: session CPU time limit (1 s)]")
    else:  # each process's own RLIMIT_CPU
        assert result.messages[0]["content"].endswith(
            "[exit code -24; killed: CPU time limit (1 s)]"
        )


async def test_a_sleeping_command_is_killed_at_the_wall_limit_with_its_group(open_env):
    env = await open_env(limits={"wall_s": 1.0})
    started = time.monotonic()
    result = await env.step(bash("sleep 60 & sleep 60; echo never"))
    assert time.monotonic() - started < 5
    assert (
        result.messages[0]["content"]
        == "(no output)\n[stopped: it ran past the wall-time limit (1 s)]"
    )
    # this session's uid only: other sessions (other tests, other runs) may sleep too
    left = await env.step(bash("ps -u $(id -u) -o args | grep -c '^sleep 60' || true"))
    assert left.messages[0]["content"].startswith("0\n")


async def test_100mb_of_output_is_cut_at_the_cap_and_the_command_stopped(open_env):
    env = await open_env()
    started = time.monotonic()
    result = await env.step(bash("yes | head -c 100000000; echo unreachable"))
    content = result.messages[0]["content"]
    assert time.monotonic() - started < 10
    assert result.truncated
    assert content.startswith("y\ny\n") and "unreachable" not in content
    assert content.endswith(
        "[output cut at 65536 bytes and the command stopped: print less (head, tail, grep, wc)]"
    )
    assert len(content.encode()) < 65536 + 200


async def test_the_file_size_limit(open_env):
    env = await open_env(limits={"file_size_bytes": 1024 * 1024})
    result = await env.step(bash("head -c 100M /dev/zero > big; stat -c %s big"))
    assert "File size limit exceeded" in result.messages[0]["content"]
    assert "\n1048576\n" in result.messages[0]["content"]


@needs_net
async def test_commands_have_no_network(open_env):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(2.0)
    probe = f"exec 3<>/dev/tcp/127.0.0.1/{listener.getsockname()[1]} && echo connected"
    try:
        env = await open_env()
        result = await env.step(bash(probe))
        content = result.messages[0]["content"]
        # uid mode: no network at all; namespaces: the session's own loopback, where nothing listens
        assert "Network is unreachable" in content or "Connection refused" in content
        assert "connected" not in content
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection is waiting to be accepted
            listener.accept()
        listener.setblocking(True)
        # the same probe outside the sandbox connects: the listener is reachable
        outside = await asyncio.create_subprocess_exec("bash", "-c", probe, stdout=subprocess.PIPE)
        conn, _ = await asyncio.to_thread(listener.accept)
        conn.close()
        assert (await outside.communicate())[0] == b"connected\n"
    finally:
        listener.close()


async def test_commands_see_an_empty_environment_and_not_the_workers(open_env, monkeypatch):
    secret = "hunter2-secret"
    monkeypatch.setenv("AGENTARIUM_NATS_PASSWORD", secret)
    env = await open_env()
    result = await env.step(bash("env | cut -d= -f1 | sort | tr '\\n' ' '"))
    names = set(result.messages[0]["content"].rsplit("\n[", 1)[0].split())
    assert "PATH" in names and "AGENTARIUM_NATS_PASSWORD" not in names
    assert names <= {"PATH", "HOME", "TMPDIR", "LANG", "TERM", "USER", "SHELL", "PWD", "SHLVL", "_"}
    if ISO.mode == "rlimits":
        return  # same uid, no namespace: /proc/<worker>/environ is readable (documented)
    # a process started with the secret in its environment, as the worker is
    worker = subprocess.Popen(["sleep", "30"], env={"AGENTARIUM_NATS_PASSWORD": secret})
    try:
        result = await env.step(bash(f"cat /proc/{worker.pid}/environ /proc/$PPID/environ"))
        content = result.messages[0]["content"]
        assert secret not in content
        # denied (uid mode), or not there at all (namespaces: the host's processes are not seen)
        assert content.count("Permission denied") + content.count("No such file") == 2, content
    finally:
        worker.kill()
        worker.wait()


@needs_uid
async def test_sessions_cannot_see_each_others_files(open_env):
    a, b = await open_env(), await open_env()
    await a.step(bash("echo private > mine.txt"))
    where = str(a.box.path)  # type: ignore[union-attr]
    result = await b.step(bash(f"ls {where}; cat {where}/mine.txt; echo hi > {where}/theirs"))
    content = result.messages[0]["content"]
    assert "private" not in content
    # denied (uid mode), or not there at all (namespaces: another session's root is not seen)
    assert content.count("Permission denied") + content.count("No such file") == 3, content
    ids = await asyncio.gather(*(e.step(bash("id -u")) for e in (a, b)))
    assert ids[0].messages[0]["content"] != ids[1].messages[0]["content"]


async def test_close_removes_the_directory_and_every_process(open_env):
    env = await open_env()
    path = env.box.path  # type: ignore[union-attr]
    uid = env.box.uid  # type: ignore[union-attr]
    await env.step(bash("mkdir -p d/e && touch d/e/f && chmod 000 d/e d && (setsid sleep 300 &)"))
    assert path.is_dir()
    outcome = await env.close()
    assert not path.exists()
    assert outcome.metrics["close_seconds"] < 5
    if uid is not None:
        assert live_pids(uid) == []


async def test_commands_of_two_sessions_run_concurrently(open_env):
    a, b = await open_env(), await open_env()
    timed = "date +%s.%N; sleep 1; date +%s.%N; echo {}"
    results = await asyncio.gather(a.step(bash(timed.format("a"))), b.step(bash(timed.format("b"))))
    lines = [r.messages[0]["content"].split("\n") for r in results]
    assert [x[2:] for x in lines] == [["a", "[exit code 0]"], ["b", "[exit code 0]"]]
    (a_start, a_end), (b_start, b_end) = ((float(x[0]), float(x[1])) for x in lines)
    # each began before the other ended, read from the commands' own clocks: one after the
    # other would not overlap however slowly a busy machine spawns them
    assert a_start < b_end and b_start < a_end, lines


async def test_check_scripts_get_the_answer_and_see_the_final_state(open_env):
    task = {
        "id": "answer-and-state",
        "description": "write 7 to n.txt and answer 7",
        "evaluation": {"check": '[ "$1" = 7 ] && [ "$(cat n.txt)" = 7 ]'},
    }
    env = await open_env(task)
    await env.step(bash("echo 7 > n.txt; (sleep 0.5; echo 8 > n.txt) &"))
    result = await env.step(message(call("commit_final_answer", {"answer": "7"})))
    assert result.done and result.reward == 1.0  # the background writer was stopped first


def test_limits_are_validated():
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="nproc"):
        SandboxLimits(nproc=1)


async def test_the_sandbox_reports_what_it_enforces(tmp_path):
    box = await Sandbox.open(base_dir=tmp_path, allow_weaker=WEAKER)
    try:
        assert box.isolation is ISO
        assert re.fullmatch(r"namespaces|uid|userns|rlimits", ISO.mode)
        assert ISO.as_dict()["missing"] == list(ISO.missing)
        if os.geteuid() == 0:
            assert ISO.mode in ("namespaces", "uid") and ISO.sessions_apart and box.uid is not None
            assert (box.path.stat().st_uid, box.path.stat().st_mode & 0o777) == (box.uid, 0o700)
    finally:
        await box.close()


@needs_uid
async def test_a_uid_leased_elsewhere_is_skipped(tmp_path):
    """Leases are flocks on one directory per machine: another process's lease is never reused."""
    base = 0x70000000 + 60_000
    other = os.open(tmp_path / f"{base}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as another worker would hold it
    options = {
        "base_dir": tmp_path / "s",
        "uid_base": base,
        "uid_count": 2,
        "uid_lock_dir": tmp_path,
        "allow_weaker": WEAKER,
    }
    try:
        box = await Sandbox.open(**options)
        assert box.uid == base + 1
        with pytest.raises(SandboxError, match="every uid in .* is in use"):
            await Sandbox.open(**options)
        await box.close()
        again = await Sandbox.open(**options)
        assert again.uid == base + 1
        await again.close()
    finally:
        os.close(other)


@pytest.mark.skipif(ISO.mode != "namespaces", reason=f"sandbox mode {ISO.mode}: no mount namespace")
async def test_hidden_paths_are_masked_even_under_a_system_folder(open_env, tmp_path):
    """A task file or the agentarium package installed under /usr would show through the
    read-only system folders: ``hide`` (and the tasks file, always) masks them."""
    folder, single = Path("/usr/share/doc/bash"), Path("/etc/hostname")
    assert any(folder.iterdir()) and single.read_text()  # on the host: not empty
    env = await open_env(hide=[str(folder)], tasks_file=single)
    result = await env.step(bash(f"ls -A {folder} | wc -l; cat {single}; ls /usr/share | wc -l"))
    lines = result.messages[0]["content"].split("\n")
    assert lines[0] == "0" and int(lines[2]) > 10, lines  # the rest of /usr is there
    # a file is masked by /dev/null on a nodev mount: it cannot even be opened
    assert lines[1] == f"cat: {single}: Permission denied", lines
