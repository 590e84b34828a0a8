"""The event loop every command runs on: uvloop when installed, asyncio's when asked for."""

from __future__ import annotations

import asyncio

import pytest

from agentarium.broker import loop_name, new_event_loop, run_loop
from agentarium.broker.eventloop import ENV


async def _which() -> str:
    await asyncio.sleep(0)
    return loop_name()


def test_uvloop_by_default(monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.delenv(ENV, raising=False)
    assert run_loop(_which()) == "uvloop"


def test_asyncio_on_request(monkeypatch):
    monkeypatch.setenv(ENV, "asyncio")
    assert run_loop(_which()) == "asyncio"
    loop = new_event_loop()
    try:
        assert loop_name(loop) == "asyncio"
    finally:
        loop.close()


def test_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "trio")
    with pytest.raises(ValueError, match="auto, uvloop or asyncio"):
        new_event_loop()
