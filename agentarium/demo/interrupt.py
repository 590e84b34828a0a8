"""Ctrl-C and SIGTERM in the demo: one handler for both, wherever the demo is when they come.

The demo runs plain code (starting processes, waiting for the engine) between a few event
loops (provisioning, the feed, the evals). A stop signal

- in plain code raises KeyboardInterrupt there, which ``run_demo`` turns into the stop;
- while a coroutine runs (``StopSignals.run``) cancels it, as ``asyncio.run`` does with Ctrl-C,
  and ``run`` raises KeyboardInterrupt once its loop is closed;
- while an event loop is being made or closed is held and raised by ``run`` once it is closed:
  a KeyboardInterrupt inside asyncio's own set-up or clean-up leaves a half-made loop or
  pending tasks behind ("Exception ignored in ... BaseEventLoop.__del__", "Task was destroyed
  but it is pending!").

The handler is installed whatever the demo inherited: started with SIGINT ignored (a script's
background job, as ``ops/test.sh`` runs its tiers) the demo would otherwise go on while its
children, which install their own handlers, drained and exited on the same Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal, once one came
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._holding = 0

    def install(self) -> None:
        self.received = None
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def ignore(self) -> None:
        """Once stopping: a second Ctrl-C or SIGTERM must not cut the stop short (children left
        running, no report)."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum
        if self._task is not None and self._loop is not None:
            self._task.cancel()  # what asyncio.Runner does with Ctrl-C
            self._loop.call_soon_threadsafe(lambda: None)  # wake a loop blocked in select()
        elif not self._holding:
            raise KeyboardInterrupt

    def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``asyncio.run(make())``, the coroutine made inside the loop (one never started is
        not left un-awaited); KeyboardInterrupt once the loop is closed if a stop signal came
        meanwhile, whatever the coroutine did with its cancellation."""
        if self.received is not None:
            raise KeyboardInterrupt
        self._holding += 1
        try:
            with asyncio.Runner() as runner:
                result = runner.run(self._cancellable(make))
        except BaseException:  # its cancellation, or what a cancelled step raised instead
            if self.received is None:
                raise
        finally:
            self._holding -= 1
        if self.received is not None:  # a stop signal wins over the result
            raise KeyboardInterrupt
        return result

    async def _cancellable(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self.received is not None:  # came while the loop was being made
            raise asyncio.CancelledError
        self._task, self._loop = asyncio.current_task(), asyncio.get_running_loop()
        try:
            return await make()
        finally:
            self._task = self._loop = None


# The demo's one handler: run_demo installs it, its steps run their coroutines through it.
STOP = StopSignals()
