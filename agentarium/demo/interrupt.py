"""Ctrl-C and SIGTERM in the demo: one handler for both, wherever the demo is when they come.

The demo runs plain code (starting processes, waiting for the engine) between a few event
loops (provisioning, the feed, the evals). A stop signal

- while a coroutine runs (``StopSignals.run``) cancels it, as ``asyncio.run`` does with Ctrl-C,
  and ``run`` raises KeyboardInterrupt once its loop is closed, whatever the coroutine did with
  its cancellation (a library may swallow one: 3.11's wait_for, CPython gh-86296);
- in a plain wait marked ``interruptible`` (loading the model, waiting for the engine) raises
  KeyboardInterrupt there at once;
- anywhere else is recorded, and raised by the next ``check``, ``interruptible`` or ``run``.
  Raised asynchronously anywhere, a KeyboardInterrupt lands in places that only report it and
  go on ("Exception ignored in ..."): logging's at-fork hook while Popen forks (the Ctrl-C lost,
  the demo ran on), a half-made or half-closed event loop (``BaseEventLoop.__del__``, "Task was
  destroyed but it is pending!"), or Popen after its fork (a child nobody stops, which forked
  before the Ctrl-C and exec'd after it, never seeing it).

The handler is installed whatever the demo inherited: started with SIGINT ignored (a script's
background job, as ``ops/test.sh`` runs its tiers) the demo would otherwise go on while its
children, which install their own handlers, drained and exited on the same Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal, once one came
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._interruptible = 0

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
        elif self._interruptible:
            raise KeyboardInterrupt

    def check(self) -> None:
        """KeyboardInterrupt if a stop signal came."""
        if self.received is not None:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A plain wait that a stop signal interrupts at once (KeyboardInterrupt)."""
        self.check()
        self._interruptible += 1
        try:
            yield
        finally:
            self._interruptible -= 1

    def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``asyncio.run(make())``, the coroutine made inside the loop (one never started is
        not left un-awaited); KeyboardInterrupt once the loop is closed if a stop signal came
        meanwhile, whatever the coroutine did with its cancellation."""
        self.check()
        try:
            with asyncio.Runner() as runner:
                result = runner.run(self._cancellable(make))
        except BaseException:  # its cancellation, or what a cancelled step raised instead
            if self.received is None:
                raise
        self.check()  # a stop signal wins over the result
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
