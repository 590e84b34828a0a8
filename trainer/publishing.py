"""Publishing: when and how the trainer hands a new policy version to the fleet.

``Publishing`` publishes every ``publish_every`` steps through a ``WeightPublisher``;
``NoPublishing`` (no publisher: ``--no-publish``) never does, so the loop asks ``due(step)``
and never whether publishing is on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import structlog
import torch

from .prometheus import PUBLISH_SECONDS

log = structlog.get_logger("agentarium.trainer")


@runtime_checkable
class WeightPublisher(Protocol):
    """Makes a new policy version available to the fleet (trainer/weights.py has the real one).

    ``publish`` must return only once the version is durable (object store, then KV). A
    publisher may also offer ``async latest_version() -> int | None``: a resumed trainer then
    numbers its next version above anything a killed predecessor published after its last
    checkpoint, so one version number never names two different sets of weights.
    """

    # Returns whatever it likes (RunPublisher: the WeightUpdate); the loop ignores it.
    async def publish(self, model: torch.nn.Module, version: int, step: int) -> object: ...


class Publishing:
    """Publishes the updater's model every ``every`` steps."""

    publishes = True

    def __init__(self, publisher: WeightPublisher, *, run: str, every: int) -> None:
        self.publisher = publisher
        self.run = run
        self.every = every

    def __repr__(self) -> str:
        return f"<Publishing {self.publisher!r} every={self.every}>"

    def due(self, step: int) -> bool:
        return step % self.every == 0

    async def latest_version(self) -> int:
        """The newest version already published for the run (0: none, or not known)."""
        latest = getattr(self.publisher, "latest_version", None)  # optional (see the Protocol)
        return int(await latest() or 0) if latest is not None else 0

    async def publish(self, model: Callable[[], Any], version: int, step: int) -> None:
        """Publish ``model()`` (fetched in a worker thread) as ``version``."""
        started = time.monotonic()
        await self.publisher.publish(await asyncio.to_thread(model), version, step)
        PUBLISH_SECONDS.labels(self.run).observe(time.monotonic() - started)
        log.info(
            "version published",
            version=version,
            step=step,
            publish_s=round(time.monotonic() - started, 3),
        )


class NoPublishing:
    """No publisher: the fleet keeps what it serves, and the version stays where it is."""

    publishes = False  # what --sync-rollouts, which waits on each new version, must refuse

    def __repr__(self) -> str:
        return "<NoPublishing>"

    def due(self, step: int) -> bool:
        return False

    async def latest_version(self) -> int:
        return 0

    async def publish(self, model: Callable[[], Any], version: int, step: int) -> None:
        raise AssertionError("NoPublishing is never due")


def publishing_for(
    publisher: WeightPublisher | None, *, run: str, every: int
) -> Publishing | NoPublishing:
    """The one place a missing publisher is looked at."""
    if publisher is None:
        return NoPublishing()
    return Publishing(publisher, run=run, every=every)
