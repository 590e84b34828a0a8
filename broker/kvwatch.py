"""Following a KV bucket for as long as a service runs: one watch, re-created after any
failure (a broker restart, a lost connection) with backoff, never given up.

``follow_key_value`` calls ``handle(kv, entry)`` for every update of the watched keys, and
``handle(kv, None)`` at the end of the initial values and after each ``idle_s`` without an
update (a chance to poll, or to look at the ages of what it holds). A bucket that does not
exist yet is waited for quietly (``backoff.max_s`` between looks): it is made when the broker
is provisioned.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from .backoff import Backoff

log = structlog.get_logger("agentarium.broker")

Handler = Callable[[KeyValue, "KeyValue.Entry | None"], Awaitable[None]]


async def follow_key_value(
    js: JetStreamContext,
    bucket: str,
    keys: str,
    handle: Handler,
    *,
    what: str,
    idle_s: float,
    backoff: Backoff,
) -> None:
    """Until cancelled (see the module docstring); ``what`` names the watch in its warnings."""
    failures = 0
    while True:
        watcher = None
        try:
            kv = await js.key_value(bucket)
            watcher = await kv.watch(keys)
            failures = 0
            while True:
                try:
                    entry = await watcher.updates(timeout=idle_s)
                except nats.errors.TimeoutError:
                    entry = None
                await handle(kv, entry)
        except asyncio.CancelledError:
            raise
        except nats.js.errors.BucketNotFoundError:
            await asyncio.sleep(backoff.max_s)  # not provisioned yet
        except Exception as exc:
            failures += 1
            wait = backoff.delay(failures)
            log.warning(
                f"{what} watch failed; retrying",
                error=str(exc) or type(exc).__name__,
                retry_in_s=round(wait, 3),
            )
            await asyncio.sleep(wait)
        finally:
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher.stop()
