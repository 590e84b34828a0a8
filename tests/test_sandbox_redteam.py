"""Red team: what a policy under RL tries against the shell sandbox, through ``EnvClient``.

Each test runs ``agentarium env serve shell`` as a child (as root, as deployed) and plays the
policy: its commands are ``bash`` tool calls, what it learns is the tool messages. The probes
are issue 39's: reading the project's task files and another process's arguments, connecting a
host Unix socket, reading a previous session's /tmp, /dev/shm and crashed working directory,
exceeding the session's memory with many processes, filling the disk, a fork bomb, CPU spread
over background processes; each must fail, and a limit that fires must be named in the step's
result. They need the full sandbox (mode ``namespaces``: root, bubblewrap, cgroups), else they
are skipped with what the host lacks; the refusal of a weaker host needs root only.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from envlib import ROOT, serve_process

from agentarium.consumers import EnvClient
from agentarium.environments.sandbox import isolation
from agentarium.environments.sandbox.uids import default_uid_lock_dir, hold_if_free

ISO = isolation()
needs_full = pytest.mark.skipif(
    ISO.mode != "namespaces" or bool(ISO.missing),
    reason=f"the full sandbox is not available here: {'; '.join(ISO.missing) or ISO.mode}",
)
MIB = 2**20
# Small enough that each probe runs past it in a second or two.
LIMITS = {
    "session_memory_bytes": 256 * MIB,
    "disk_bytes": 64 * MIB,
    "tmp_bytes": 16 * MIB,
    "nproc": 32,
    "cpu_s": 3,
    "wall_s": 20.0,
}
FREE_PLAY = {"description": "free play", "evaluation": {"answer": "x"}}


def bash(command: str) -> dict:
    arguments = json.dumps({"command": command})
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


async def run(env, command: str) -> str:
    """The tool message the policy reads for one command."""
    return (await env.step(bash(command))).messages[0]["content"]


def shell_worker(nats_url: str, *args: str, **kwargs):
    option = "limits=" + json.dumps(LIMITS)
    return serve_process(nats_url, "--option", option, *args, command=("serve", "shell"), **kwargs)


@needs_full
async def test_the_policy_sees_neither_the_task_files_nor_any_other_process(nats_url, nc):
    marker = f"answer-is-{secrets.token_hex(4)}"
    # a host process with an answer in its arguments, as a check script once had
    host = subprocess.Popen(["bash", "-c", "sleep 300", marker])
    tasks = ROOT / "examples" / "shell_tasks.jsonl"
    assert tasks.is_file() and os.stat(tasks).st_mode & 0o004  # world-readable on the host
    try:
        async with shell_worker(nats_url) as _, EnvClient(nc).session("shell", FREE_PLAY) as env:
            assert env.observation.info["sandbox"]["missing"] == []
            seen = await run(env, f"cat {tasks}; ls {ROOT}")
            assert seen.count("No such file or directory") == 2, seen
            found = await run(env, "find / -name 'shell_tasks*' -o -name 'agentarium*' 2>/dev/null")
            assert found.startswith("(no output)"), found
            tops = await run(env, "ls /; ls -A /home; ls /work /root /run /srv /opt 2>&1 | wc -l")
            listed = tops.rsplit("\n[", 1)[0].split()
            assert set(listed[:-2]) <= {
                "bin",
                "dev",
                "etc",
                "home",
                "lib",
                "lib32",
                "lib64",
                "libx32",
                "proc",
                "sbin",
                "tmp",
                "usr",
                "var",
            }, tops
            assert listed[-2:] == ["agent", "5"], tops  # /home/agent only; 5 "cannot access"
            # a watcher started in the background by one command ...
            await run(env, "(setsid bash -c 'while :; do ps -eo args; sleep 0.05; done' >w &)")
            # ... is gone at the next, which sees only the session's holder and itself
            ps = await run(env, "ps -eo args")
            lines = ps.rsplit("\n[", 1)[0].splitlines()
            assert lines[0].strip() == "COMMAND" and len(lines) == 4, ps
            assert lines[1].startswith("bwrap --args") and lines[2:] == [
                "sleep infinity",
                "ps -eo args",
            ], ps
            assert marker not in ps and "agentarium" not in ps
            assert marker not in await run(env, "cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' '")
    finally:
        host.kill()
        host.wait()


def greeter(path_or_name: str) -> socket.socket:
    """A Unix socket that greets whoever connects (a database's, docker's), served by a thread."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(path_or_name)
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"hello from the host\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return server


@needs_full
async def test_host_unix_sockets_and_the_broker_are_out_of_reach(nats_url, nc):
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    folder.chmod(0o777)
    path = str(folder / "db.sock")
    abstract = f"\0agentarium-redteam-{secrets.token_hex(4)}"
    servers = [greeter(path), greeter(abstract)]
    os.chmod(path, 0o777)
    port = int(nats_url.rsplit(":", 1)[1])
    probe = (
        "import socket, sys\n"
        "for where in sys.argv[1:]:\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    try:\n"
        "        s.connect(where.replace('@', '\\0')); print('connected', s.recv(64))\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
    )
    try:
        with socket.socket(socket.AF_UNIX) as outside:  # the socket works from the host
            outside.connect(path)
            assert outside.recv(64) == b"hello from the host\n"
        async with shell_worker(nats_url) as _, EnvClient(nc).session("shell", FREE_PLAY) as env:
            await run(env, f"cat > probe.py <<'EOF'\n{probe}EOF")
            result = await run(env, f"python3 probe.py {path} {abstract.replace(chr(0), '@')}")
            assert result.split("\n")[:2] == ["FileNotFoundError", "ConnectionRefusedError"], result
            assert "hello" not in result
            tcp = await run(env, f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected")
            assert "connected" not in tcp.replace("Connection refused", ""), tcp
            assert "No such file" in await run(env, "ls /run/mysqld /var/run/docker.sock")
    finally:
        for server in servers:
            server.close()
        os.unlink(path)
        folder.rmdir()


def sandbox_holders(worker_pid: int) -> list[int]:
    """The bwrap processes a worker holds its sessions' namespaces with."""
    out = []
    for task in os.listdir(f"/proc/{worker_pid}/task"):
        for pid in Path(f"/proc/{worker_pid}/task/{task}/children").read_text().split():
            if Path(f"/proc/{pid}/comm").read_text().strip() == "bwrap":
                out.append(int(pid))
    return out


async def gone(pid: int) -> None:
    """Returns when ``pid`` (any process) has exited: its pidfd becomes readable."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop, exited = asyncio.get_running_loop(), asyncio.Event()
    loop.add_reader(fd, exited.set)
    try:
        await asyncio.wait_for(exited.wait(), 10)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


@needs_full
async def test_nothing_carries_over_to_the_next_session_even_after_a_worker_crash(nats_url, nc):
    secret = f"secret-{secrets.token_hex(4)}"
    plant = (
        f"echo {secret} > mine; echo {secret} > /tmp/mine; head -c 8M /dev/zero > /dev/shm/big; "
        f"echo {secret} > /dev/shm/mine; chmod 600 mine /tmp/mine /dev/shm/mine; id -u"
    )
    look = "cat mine /tmp/mine /dev/shm/mine 2>&1; ls -A . /tmp /dev/shm; id -u"
    envs = EnvClient(nc)
    async with shell_worker(nats_url) as _:
        async with envs.session("shell", FREE_PLAY) as first:
            await run(first, plant)
        async with envs.session("shell", FREE_PLAY) as second:  # closed, then a fresh one
            seen = await run(second, look)
        # nothing in any of the three (ls -A lists none), whichever uid it got (often the last's)
        assert secret not in seen and seen.count("No such file or directory") == 3, seen

    async with shell_worker(nats_url) as (worker, _):
        crashed = envs.session("shell", FREE_PLAY)
        await crashed.__aenter__()
        uid = int((await run(crashed, plant)).split("\n")[0])
        holders = sandbox_holders(worker.pid)
        assert len(holders) == 1
        worker.kill()  # SIGKILL: no close, no cleanup of its own
        await worker.wait()
        await asyncio.gather(*(gone(pid) for pid in holders))  # the namespaces die with it
    async with shell_worker(nats_url) as _:  # a new worker sweeps at start
        for parent in ISO.cgroup.parents():
            with hold_if_free(default_uid_lock_dir(), uid) as free:
                assert not (free and (parent / f"u{uid}").exists()), parent
        async with envs.session("shell", FREE_PLAY) as fresh:
            seen = await run(fresh, look + "; grep -rl " + secret + " /tmp /dev/shm ~ 2>/dev/null")
        assert secret not in seen and seen.count("No such file or directory") == 3, seen


@needs_full
async def test_session_limits_fire_and_the_step_result_names_them(nats_url, nc):
    envs = EnvClient(nc)
    hog = "import time; b = bytearray(100 * 2**20); time.sleep(3)"
    async with shell_worker(nats_url) as _:
        async with envs.session("shell", FREE_PLAY) as env:
            memory = await run(env, f"for i in 1 2 3 4 5 6 7 8; do python3 -c '{hog}' & done; wait")
            assert "killed: session memory limit 256 MiB" in memory, memory
            assert (await run(env, "echo still serving")).startswith("still serving\n")
        async with envs.session("shell", FREE_PLAY) as env:
            fill = "for i in $(seq 20); do head -c 10M /dev/zero > f$i || break; done; df -h ."
            disk = await run(env, fill)
            assert "No space left on device" in disk and " 64M " in disk, disk
            assert "no space left: the working directory's disk limit is 64 MiB" in disk, disk
            tmp = await run(
                env, "head -c 20M /dev/zero > /tmp/x; head -c 20M /dev/zero > /dev/shm/x"
            )
            assert "/tmp is full (its limit is 16 MiB)" in tmp, tmp
            assert "/dev/shm is full (its limit is 16 MiB)" in tmp, tmp
        async with envs.session("shell", FREE_PLAY) as env:
            bomb = await run(env, "bomb() { bomb | bomb & }; bomb; sleep 2")
            assert "the session's process limit (32 processes) was reached: forks failed" in bomb
        async with envs.session("shell", FREE_PLAY) as env:
            started = time.monotonic()
            spin = await run(env, "for i in 1 2 3 4; do (while :; do :; done) & done; wait")
            assert spin.endswith("[killed: session CPU time limit (3 s)]"), spin
            assert time.monotonic() - started < LIMITS["wall_s"]


async def test_a_host_without_namespaces_is_refused_unless_the_operator_allows_it(
    nats_url, nc, tmp_path
):
    """Without bwrap on PATH the host gives only mode uid: the worker refuses to serve, with one
    line naming what is missing and the flag; with the flag it serves and says so."""
    if os.geteuid() != 0:
        pytest.skip("the weaker mode uid needs root")
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    refused = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentarium", "env", "serve", "shell", "--nats-url", nats_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=ROOT,
    )  # fmt: skip
    out, err = await asyncio.wait_for(refused.communicate(), 60)
    assert refused.returncode == 2 and out == b""
    error = [line for line in err.decode().splitlines() if line.startswith("error: ")]
    assert len(error) == 1, err.decode()
    assert "the shell sandbox on this host lacks a mount, PID, IPC and UTS namespace" in error[0]
    assert "bubblewrap is not installed (apt-get install bubblewrap)" in error[0]
    assert error[0].endswith("--option allow_weaker_sandbox=true")
    allow = ("--option", "allow_weaker_sandbox=true")
    async with shell_worker(nats_url, *allow, environ={"PATH": str(empty)}) as _:
        async with EnvClient(nc).session("shell", FREE_PLAY) as weak:
            sandbox = weak.observation.info["sandbox"]
            assert sandbox["mode"] == "uid" and sandbox["namespaces"] == []
            assert any("bubblewrap is not installed" in m for m in sandbox["missing"])


@needs_full
async def test_a_check_runs_after_every_process_of_the_agent_has_ended(tmp_path):
    """A watcher the policy leaves running to catch the check script and its arguments (the
    answer) is ended before the check; the check sees only itself in the session."""
    from agentarium.environments import ShellEnvironment

    marker = f"check-{secrets.token_hex(4)}"
    task = {
        "description": "answer 7",
        "evaluation": {"check": f'ps -eo args > check_saw; [ "$1" = 7 ] # {marker}'},
    }
    env = ShellEnvironment()
    await env.reset(task)
    try:
        watch = "(setsid bash -c 'while :; do ps -eo args >> seen; done' > /dev/null 2>&1 &)"
        await env.step(bash(watch + "; sleep 0.5; wc -l < seen"))
        answer = {"id": "c2", "type": "function",
                  "function": {"name": "commit_final_answer", "arguments": '{"answer": "7"}'}}  # fmt: skip
        result = await env.step({"role": "assistant", "content": None, "tool_calls": [answer]})
        assert result.done and result.reward == 1.0
        workdir = env.box.path  # the session's working directory, as root on the host sees it
        seen = (workdir / "seen").read_text()
        saw = (workdir / "check_saw").read_text().splitlines()
    finally:
        await env.close()
    assert seen.count("ps -eo args") > 1 and marker not in seen
    assert saw[0].strip() == "COMMAND" and saw[1].startswith("bwrap --args"), saw
    assert saw[2] == "sleep infinity" and marker in saw[3] and saw[4:] == ["ps -eo args"], saw
