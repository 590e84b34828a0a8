"""The requests in flight on each server, so that a server found dead can have them cut off.

A server that accepts a connection and never answers holds a request until the request
timeout (600 s by default). When its health probe fails (consumers/fleet.py) the backend's
breaker for it opens and ``cut(url)`` ends every request waiting on it at once: each one
raises ``TimeoutError`` where it waits, as a timeout of its own would, and is retried on
another server or waits for the fleet.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager


class Cutoffs:
    """``async with cutoffs.guard(url): <one request>``; ``cutoffs.cut(url)`` ends them all."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._open: dict[str, set[asyncio.Timeout]] = {url: set() for url in urls}

    @asynccontextmanager
    async def guard(self, url: str) -> AsyncIterator[None]:
        # asyncio.timeout(None) never fires by itself; reschedule() makes it fire now, and it
        # turns only its own cancellation into TimeoutError (an outer cancel stays a cancel).
        async with asyncio.timeout(None) as cutoff:
            self._open[url].add(cutoff)
            try:
                yield
            finally:
                self._open[url].discard(cutoff)

    def cut(self, url: str) -> int:
        """End every request in flight on ``url``; returns how many there were."""
        pending = list(self._open[url])
        now = asyncio.get_running_loop().time()
        for cutoff in pending:
            try:
                cutoff.reschedule(now)
            except RuntimeError:  # firing already (cut twice): it ends anyway
                pass
        return len(pending)

    def in_flight(self, url: str) -> int:
        return len(self._open[url])
