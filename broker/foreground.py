"""``run_in_foreground``: a nats-server run until Ctrl-C or SIGTERM, provisioned once it listens.

What ``agentarium broker up`` does, and the one subtle part of it: a SIGTERM (a supervisor's
stop) must stop the server and end the process with 0 whenever it comes. While provisioning
runs, the signal cancels provisioning through its own event loop and is acted on once that
loop has closed: raised inside the loop's shutdown it would turn into "Cannot close a running
event loop" (exit 1, nats-server left running until the finally below); outside provisioning
it unwinds the main thread as Ctrl-C does.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Any

from .eventloop import run_loop
from .server import NatsServer

Body = Callable[[], Coroutine[Any, Any, int]]


class _Terminated(BaseException):
    """Raised by the SIGTERM handler so the foreground run unwinds as it does on Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    # Only raise: stopping the server here would wait on the child while the interrupted main
    # thread holds the same wait (Popen's waitpid lock), and the process would never exit.
    raise _Terminated


def _run_body(body: Body) -> int:
    return run_loop(body())


def run_in_foreground(
    server: NatsServer,
    provision: Body,
    *,
    run: Callable[[Body], int] = _run_body,
    on_started: Callable[[NatsServer], None] = lambda server: None,
) -> int:
    """Start ``server``, call ``on_started``, run ``provision`` in an event loop (``run``
    makes and closes the loop: the command's, with its logging and tracing), then wait for the
    server to exit. Ctrl-C or SIGTERM, at any point, stops the server and returns 0; a
    non-zero code from ``provision`` stops it and is returned; a server that exits by itself
    is an error (1, its status and log tail on stderr). The server is stopped in every
    case, and a second SIGTERM does not cut that stop short. Main thread only (signals)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        server.start()
        on_started(server)
        code = _provision_deferring_sigterm(provision, run)
        if code:
            return code
        return _died(server, server.wait())
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    return 0


def _died(server: NatsServer, returncode: int) -> int:
    """The server exited while nobody stopped it (a crash, a kill, the OOM killer): an error
    with its exit status and the last lines of its log, so a supervisor restarts it."""
    how = f"signal {-returncode}" if returncode < 0 else f"code {returncode}"
    if returncode < 0:
        with suppress(ValueError):
            how = f"{signal.Signals(-returncode).name}"
    tail = server.log_tail()
    print(
        f"error: nats-server (pid {server.pid}) exited on its own ({how})"
        + (f"; the last lines of {server.log_path}:\n{tail}" if tail else ""),
        file=sys.stderr,
        flush=True,
    )
    return 1


def _provision_deferring_sigterm(provision: Body, run: Callable[[Body], int]) -> int:
    """``run(provision)``; a SIGTERM meanwhile cancels it, then raises ``_Terminated`` once
    its loop has closed."""
    stop_requested: list[int] = []
    provisioning: list[asyncio.Task] = []

    def on_sigterm(signum: int, frame: object) -> None:
        stop_requested.append(signum)
        for task in provisioning:
            if not task.done():
                task.get_loop().call_soon_threadsafe(task.cancel)

    async def tracked() -> int:
        provisioning.append(asyncio.current_task())  # type: ignore[arg-type]
        return await provision()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code = run(tracked)
    except asyncio.CancelledError:
        if not stop_requested:
            raise
        code = 0
    finally:
        provisioning.clear()
        signal.signal(signal.SIGTERM, _raise_terminated)
    if stop_requested:
        raise _Terminated
    return code
