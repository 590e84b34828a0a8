"""One run of a program under its supervisor (consumers/agents/program_supervisor.py): its output kept
bounded, its whole process tree ended when it exits, when the rollout is cancelled (its
deadline, a drain), or when the consumer dies.

``run_program`` returns a ``ProgramOutput`` however the program ended; a cancellation asks the
supervisor to stop (SIGTERM to every process of the program, SIGKILL after the grace), waits
for it, hands the output to ``on_end`` and goes on as a cancellation. The output kept is the last ``output_bytes`` of stdout
and of stderr each, decoded as UTF-8 (undecodable bytes replaced).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("agentarium.consumers")

SUPERVISOR = Path(__file__).with_name("program_supervisor.py")
# Past the grace, how long the supervisor may take to report before it is killed itself.
SUPERVISOR_SLACK_S = 5.0
CHUNK = 64 * 1024


class Tail:
    """The last ``cap`` bytes written to a stream, and how many were written in all."""

    def __init__(self, cap: int) -> None:
        self.cap, self.seen = cap, 0
        self._kept = bytearray()

    def add(self, data: bytes) -> None:
        self.seen += len(data)
        self._kept += data
        if len(self._kept) > 2 * self.cap:  # trimmed now and then, not on every write
            del self._kept[: len(self._kept) - self.cap]

    @property
    def data(self) -> bytes:
        return bytes(self._kept[-self.cap :]) if self.cap else b""

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclass(frozen=True, kw_only=True)
class ProgramOutput:
    """How a program's run ended. ``exit_code`` is negative when a signal killed it, None when
    it never started (``error`` says why); ``stopped``: the consumer stopped it (a deadline, a
    drain); ``stdout``/``stderr`` are tails, ``*_bytes`` what was written in all."""

    command: tuple[str, ...]
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int
    seconds: float
    stopped: bool = False
    error: str = ""
    workdir: str = ""
    user: tuple[int, int] | None = None  # (uid, gid) it ran as; None: the consumer's own

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.error

    @property
    def result(self) -> dict | None:
        """The last line of stdout that is a JSON object (``{"reward": 1.0, ...}``), if any."""
        for line in reversed(self.stdout.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    value = json.loads(line)
                except ValueError:
                    continue
                if isinstance(value, dict):
                    return value
        return None

    def without(self, secret: str) -> ProgramOutput:
        """This output with ``secret`` (the rollout's key, which a program may print) masked."""
        if not secret:
            return self
        return dataclasses.replace(
            self,
            stdout=self.stdout.replace(secret, "***"),
            stderr=self.stderr.replace(secret, "***"),
        )

    def failure(self) -> str:
        """Why the run failed, with the end of its stderr and of its stdout."""
        name = " ".join(self.command)
        if self.error:
            what = self.error
        elif self.exit_code is not None and self.exit_code < 0:
            try:
                sig = signal.Signals(-self.exit_code).name
            except ValueError:
                sig = f"signal {-self.exit_code}"
            what = f"was killed by {sig}"
        else:
            what = f"exited with status {self.exit_code}"
        parts = [f"program `{name}` {what} after {self.seconds:.1f}s"]
        for label, text, total, cap in (
            ("stderr", self.stderr, self.stderr_bytes, FAILURE_TAIL_CHARS),
            ("stdout", self.stdout, self.stdout_bytes, FAILURE_TAIL_CHARS // 4),
        ):
            if text.strip():
                tail = text[-cap:]
                parts.append(f"{label} (last {len(tail)} characters of {total} bytes):\n{tail}")
        return "\n".join(parts)

    def summary(self) -> dict[str, Any]:
        """What the trajectory's ``metadata["program"]`` holds."""
        return {
            "command": list(self.command),
            "exit_code": self.exit_code,
            "stopped": self.stopped,
            "error": self.error or None,
            "seconds": round(self.seconds, 3),
            "stdout": self.stdout,
            "stderr": self.stderr,
            "stdout_bytes": self.stdout_bytes,
            "stderr_bytes": self.stderr_bytes,
        }


# An agent error's reason holds this much of the program's stderr, and a quarter of it of its
# stdout (the trajectory's metadata, when there is one, holds the whole tails).
FAILURE_TAIL_CHARS = 4000


async def _pump(stream: asyncio.StreamReader, tail: Tail) -> None:
    while data := await stream.read(CHUNK):
        tail.add(data)


async def _reports(reader: asyncio.StreamReader, into: list[dict]) -> None:
    """The supervisor's reports until its end of the socket closes. One that ends without
    its final report (killed) leaves the program to us: its group is killed."""
    while line := await reader.readline():
        with contextlib.suppress(ValueError):
            into.append(json.loads(line))
    if _final(into) is None:
        _kill_program(into)


def _final(reports: list[dict]) -> dict | None:
    return next((r for r in reversed(reports) if "exit" in r or "error" in r), None)


def _kill_program(reports: list[dict]) -> None:
    for report in reports:
        pid = report.get("pid")
        if isinstance(pid, int) and pid > 1:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # the program's session, its group's id


async def run_program(
    command: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    stdin_path: str,
    user: tuple[int, int] | None,
    grace_s: float,
    output_bytes: int,
    on_end: Callable[[ProgramOutput], None] = lambda output: None,
    orphan_dir: str | None = None,
) -> ProgramOutput:
    """Run ``command`` under its supervisor and wait for its whole tree to be gone.
    ``on_end`` gets the output however the run ended, a cancellation included;
    ``orphan_dir`` is removed by the supervisor if this process dies meanwhile."""
    started = time.monotonic()
    ours, theirs = socket.socketpair()
    uid, gid = user if user is not None else (-1, -1)
    argv = [str(theirs.fileno()), repr(grace_s), str(uid), str(gid), orphan_dir or "-", "--"]
    try:
        with open(stdin_path, "rb") as stdin:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", str(SUPERVISOR), *argv, *command,
                stdin=stdin, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                cwd=cwd, env=dict(env), pass_fds=(theirs.fileno(),), start_new_session=True,
            )  # fmt: skip
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    out, err = Tail(output_bytes), Tail(output_bytes)
    assert proc.stdout is not None and proc.stderr is not None, "both are pipes"
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    reports: list[dict] = []
    ended = asyncio.ensure_future(
        asyncio.gather(_pump(proc.stdout, out), _pump(proc.stderr, err), _reports(reader, reports))
    )
    try:
        await asyncio.shield(ended)
        await proc.wait()
    except asyncio.CancelledError:
        await _stop(proc, writer, ended, grace_s, reports)
        output = _output(command, reports, out, err, time.monotonic() - started, cwd, user)
        on_end(dataclasses.replace(output, stopped=True))
        raise
    finally:
        writer.close()
    output = _output(command, reports, out, err, time.monotonic() - started, cwd, user)
    on_end(output)
    return output


async def _stop(
    proc: asyncio.subprocess.Process,
    writer: asyncio.StreamWriter,
    ended: asyncio.Future,
    grace_s: float,
    reports: list[dict],
) -> None:
    """Ask the supervisor to end the program's tree and wait until it has; a supervisor that
    does not report in time is killed, with the program's group."""
    with contextlib.suppress(OSError, RuntimeError):
        writer.write(b"stop\n")
    try:
        await asyncio.wait_for(asyncio.shield(ended), grace_s + SUPERVISOR_SLACK_S)
        await proc.wait()
        return
    except asyncio.CancelledError:
        # Cancelled again while stopping (the event loop closing): stop waiting. The
        # supervisor, told to stop (or seeing this end close), ends the tree by itself.
        raise
    except Exception:  # noqa: BLE001 - TimeoutError, or a pipe's error: kill it below
        pass
    log.warning("a program's supervisor did not stop in time: killing it", pid=proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the supervisor's own session
    _kill_program(reports)
    ended.cancel()
    await proc.wait()


def _output(
    command: Sequence[str],
    reports: list[dict],
    out: Tail,
    err: Tail,
    seconds: float,
    cwd: str,
    user: tuple[int, int] | None,
) -> ProgramOutput:
    final = _final(reports)
    if final is None:
        final = {"error": "its supervisor ended without a report (killed?)"}
    code = final.get("exit")
    return ProgramOutput(
        command=tuple(command),
        exit_code=code if isinstance(code, int) else None,
        stdout=out.text(),
        stderr=err.text(),
        stdout_bytes=out.seen,
        stderr_bytes=err.seen,
        seconds=seconds,
        stopped=bool(final.get("stopped")),
        error=str(final.get("error") or ""),
        workdir=cwd,
        user=user,
    )
