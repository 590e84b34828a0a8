"""The AgentBench bridge's HTTP side: one request to a task worker, every failure translated.

The errors the bridge raises (see environments/agentbench.py's docstring for the tree) are
declared here, next to the one place that tells them apart: HTTP statuses and bodies of
AgentBench's task worker (FastAPI puts an error in ``detail``). Every request carries the
current span's W3C ``traceparent`` (the worker continues the rollout's ``env.*`` span while it
serves a session request), so a traced task worker joins the rollout's trace.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from agentarium.broker import inject_headers


class AgentBenchError(Exception):
    """Root of the bridge's errors; ``code`` is the environment error code it stands for."""

    code = 500


class WorkerUnavailable(AgentBenchError):
    code = 503


class SessionLost(AgentBenchError):
    code = 404


class BadTask(AgentBenchError):
    code = 400


class TaskFailed(AgentBenchError):
    code = 500


class WorkerProtocolError(AgentBenchError):
    code = 500


class SessionIdTaken(WorkerProtocolError):
    """``/start_sample`` refused the session id (another controller chose it): draw again."""


def worker_api(url: str) -> str:
    """The worker's API base as AgentBench writes it (``--self http://host:5001/api``); a bare
    ``http://host:port`` gets AgentBench's ``/api`` prefix."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"AgentBench worker URL {url!r}: expected http(s)://host:port[/api], "
            "e.g. http://127.0.0.1:5001/api"
        )
    return url if parts.path else url + "/api"


async def request(
    http: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict | None,
    *,
    lost: bool,
    timeout: float | None = None,
) -> Any:
    """GET (no body) or POST ``url + path``; ``lost``: a failure to reach the worker means the
    session is gone (it had started), else the worker is unavailable."""
    kwargs: dict[str, Any] = {"headers": inject_headers()}
    if body is not None:
        kwargs["json"] = body
    if timeout is not None:
        kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
    try:
        async with http.request("GET" if body is None else "POST", url + path, **kwargs) as resp:
            status, text = resp.status, await resp.text(errors="replace")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        what = type(exc).__name__ if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
        if lost:
            raise SessionLost(
                f"the AgentBench worker at {url} stopped answering mid-session ({path}: {what})"
            ) from exc
        raise WorkerUnavailable(
            f"the AgentBench worker at {url} is unreachable ({path}: {what}); is it running "
            "and is the URL its API base (http://host:port/api)?"
        ) from exc
    return answer(url, path, status, text)


def request_sync(url: str, path: str, body: dict | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, headers=inject_headers({"Content-Type": "application/json"})
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return answer(url, path, resp.status, resp.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        return answer(url, path, exc.code, exc.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError) as exc:
        raise WorkerUnavailable(
            f"the AgentBench worker at {url} is unreachable ({path}: {exc}); is it running?"
        ) from exc


def answer(url: str, path: str, status: int, text: str) -> Any:
    """The JSON of a 200; the error for anything else (FastAPI puts it in ``detail``)."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
        if status == 200:
            raise WorkerProtocolError(
                f"{url}{path} answered a body that is not JSON: {text[:200]!r}"
            ) from None
    if status == 200:
        return data
    detail = data.get("detail", data) if isinstance(data, dict) else text[:300]
    if status == 406:
        raise WorkerUnavailable(
            f"the AgentBench worker at {url} is full ({detail}); serve the bridge with a "
            "--capacity no larger than the worker's concurrency"
        )
    if status == 400 and detail == "No such session":
        raise SessionLost(f"the AgentBench worker at {url} has no such session ({path})")
    if status == 400 and detail == "Session ID already exists":
        raise SessionIdTaken(str(detail))
    if status == 501 and isinstance(detail, dict):  # classic: the task raised during a turn
        output = detail.get("output") or {}
        raise TaskFailed(traceback_tail(output.get("result"), url))
    raise WorkerProtocolError(f"{url}{path} answered HTTP {status}: {str(detail)[:300]}")


def traceback_tail(result: Any, url: str) -> str:
    lines = [line for line in str(result or "").strip().splitlines() if line.strip()]
    tail = f": {lines[-1].strip()}" if lines else ""
    return f"the AgentBench task raised on the worker at {url}{tail}"
