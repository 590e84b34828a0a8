"""A real headless Chromium, driven over the Chrome DevTools Protocol (one page).

Debian's ``chromium`` package (ops/setup.sh --test installs it). Without it a test skips,
except under CI=true, where it fails: a browser test that silently never runs checks nothing.
The protocol is JSON over a websocket; aiohttp (a dependency already) speaks it.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

FLAGS = (  # what works here as root, without a display, a GPU or the network
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    message = (
        "chromium not found: install it (apt-get install -y --no-install-recommends chromium; "
        "ops/setup.sh --test does)"
    )
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


class Chromium:
    """``async with Chromium(profile_dir) as page``: ``goto``, ``evaluate``, ``screenshot``."""

    def __init__(self, profile_dir: Path, *, width: int = 1400, height: int = 1600) -> None:
        self.binary = chromium_binary()
        self.profile_dir = profile_dir
        self.width, self.height = width, height
        self._proc: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._events: dict[str, list[asyncio.Future]] = {}
        self._tasks: list[asyncio.Task] = []
        self.console: list[str] = []  # the page's exceptions and console errors

    async def __aenter__(self) -> Chromium:
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        self._proc = await asyncio.create_subprocess_exec(
            self.binary,
            *FLAGS,
            f"--user-data-dir={self.profile_dir}",
            f"--window-size={self.width},{self.height}",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert self._proc.stderr is not None
        port = await asyncio.wait_for(self._devtools_port(self._proc.stderr), 30)
        self._tasks.append(asyncio.create_task(self._drain(self._proc.stderr)))
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._tasks.append(asyncio.create_task(self._receive()))
        await self.send("Runtime.enable")
        await self.send("Page.enable")
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=self.height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()
            try:
                await asyncio.wait_for(self._proc.wait(), 10)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()

    @staticmethod
    async def _devtools_port(stderr: asyncio.StreamReader) -> int:
        while True:
            line = (await stderr.readline()).decode(errors="replace")
            if not line:
                raise RuntimeError("chromium exited before opening its DevTools port")
            found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if found:
                return int(found.group(1))

    @staticmethod
    async def _drain(stderr: asyncio.StreamReader) -> None:
        while await stderr.readline():  # a full pipe would stall the browser
            pass

    async def _receive(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            data = json.loads(message.data)
            future = self._waiting.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
            for waiter in self._events.pop(data.get("method", ""), []):
                if not waiter.done():
                    waiter.set_result(data.get("params", {}))
            if data.get("method") == "Runtime.exceptionThrown":
                self.console.append(json.dumps(data["params"]["exceptionDetails"])[:2000])
            elif data.get("method") == "Runtime.consoleAPICalled" and data["params"].get(
                "type"
            ) in ("error", "assert"):
                self.console.append(json.dumps(data["params"]["args"])[:2000])

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None, "use Chromium as an async context manager"
        call_id = next(self._ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        reply = await future
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def goto(self, url: str) -> None:
        """Open ``url`` and return once its load event fired (scripts included)."""
        loaded: asyncio.Future = asyncio.get_running_loop().create_future()
        self._events.setdefault("Page.loadEventFired", []).append(loaded)
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise RuntimeError(f"cannot open {url}: {result['errorText']}")
        await asyncio.wait_for(loaded, 30)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JS expression; a promise is awaited (its rejection raises)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise RuntimeError(f"in the page: {text}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> Path:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path
