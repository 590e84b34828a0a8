"""Helpers for tests of the synchronous AgentOrchestrator: a FakeSGLang on its own event loop.

The orchestrator's methods block the calling thread, so an LLM fake served by the test's own
event loop would never answer; this one runs on a background loop thread instead.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from fake_sglang import FakeSGLang


class ThreadedFake:
    """``with ThreadedFake(output_ids=[...]) as fake: fake.url, fake.server.requests``."""

    def __init__(self, **fake_kwargs: Any) -> None:
        self._kwargs = fake_kwargs
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: FakeSGLang | None = None
        self.url = ""

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def __enter__(self) -> ThreadedFake:
        self._thread.start()

        async def start() -> str:
            self.server = FakeSGLang(**self._kwargs)
            return await self.server.start()

        self.url = self._call(start())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self._call(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
