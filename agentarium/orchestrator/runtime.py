"""The orchestrator's lifecycle: a private event loop driving the ``RolloutCore``.

Nothing runs until first use (or ``start()``): then a ``LoopThread`` starts and the core
connects (or starts an embedded nats-server). ``close()`` stops the core and the loop, once
and for good: a closed orchestrator refuses every call rather than quietly starting again.
"""

from __future__ import annotations

from collections.abc import Callable

from agentarium.broker import tune_gc

from .core import RolloutCore
from .loop_thread import LoopThread


class Runtime:
    """``loop`` starts everything on first use; ``close`` ends it."""

    def __init__(self, core: RolloutCore) -> None:
        self.core = core
        self._loop: LoopThread | None = None
        self.closed = False

    def start(self) -> bool:
        """Start the loop and the core; False when they were running already."""
        self.check_open()
        if self._loop is not None:
            return False
        self._loop = LoopThread()
        try:
            self._loop.call(self.core.start())
        except BaseException:
            self.close()
            raise
        # The young generation's threshold only (broker/gc_tuning.py): with torch imported, a
        # full collection every ~70,000 allocations was a sixth of the rollout layer's CPU.
        tune_gc(freeze=False)
        return True

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the orchestrator is closed: create a new AgentOrchestrator")

    @property
    def loop(self) -> LoopThread:
        """The running loop, started if it was not."""
        self.start()
        assert self._loop is not None
        return self._loop

    def soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop if it runs (no start for it: nothing to do then)."""
        if self._loop is not None and self._loop.running:
            self._loop.loop.call_soon_threadsafe(callback)

    def close(self) -> None:
        self.closed = True
        if self._loop is not None and self._loop.running:
            try:
                self._loop.call(self.core.close(), timeout=60)
            finally:
                self._loop.stop()
