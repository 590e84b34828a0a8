"""A private asyncio event loop on a daemon thread, so synchronous code can drive async code.

The orchestrator's public methods are plain functions (an RL trainer's loop is synchronous),
while NATS, the consumers and the tracing proxy are asyncio. Every coroutine runs on this one
loop, so the connection, the workers and the proxy all live in one place for the object's
whole life; ``call`` blocks the caller until the coroutine is done and re-raises its error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from agentarium.broker import new_event_loop

T = TypeVar("T")


class LoopThread:
    """``call(coro)`` runs ``coro`` on the background loop and returns its result."""

    def __init__(self, name: str = "agentarium-loop") -> None:
        self.loop = new_event_loop()  # uvloop when installed (broker/eventloop.py)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def _check_caller(self) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                "a synchronous AgentOrchestrator method was called from its own event loop "
                "(inside an agent or a callback): call it from the training loop's thread"
            )
        if not self.running:
            raise RuntimeError("the orchestrator is closed: create a new AgentOrchestrator")

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` without waiting; the returned future holds its outcome."""
        try:
            self._check_caller()
        except RuntimeError:
            coro.close()  # never scheduled: no "coroutine was never awaited" warning
            raise
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` to completion. On ``timeout`` (or Ctrl-C) the coroutine is cancelled."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"gave up after {timeout}s") from None
        except KeyboardInterrupt:
            future.cancel()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is still scheduled, stop the loop and join the thread."""
        if not self.running:
            return

        async def _cancel_rest() -> None:
            current = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not current]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_cancel_rest(), self.loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
