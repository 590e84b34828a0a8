"""Loading user agents and adapting every supported shape to one async call.

Shapes (docs/design.md "Rollouts: agents and LLM calls"):
  async def rollout(task, llm)               llm = the tracing client
  def rollout(task, llm)                     run in a thread; llm.chat() blocks there
  async/def rollout(task, endpoint, model)   endpoint = this rollout's tracing proxy URL
  @ray.remote def rollout(task, endpoint, model)   called with .remote() on Ray

An async agent that also declares a parameter named ``envs`` (any of the shapes above) gets
the environment client (consumers/agents/envclient.py) bound to its rollout: ``envs.session(...)``.

Results: a number, ``{"reward": x, "metrics": {...}}``, or any object; a reward function
``fn(task, result, trajectory)`` may compute the reward from it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import importlib
import inspect
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("agentarium.consumers")


class AgentLoadError(ValueError):
    """An agent or reward spec could not be imported or has an unsupported shape."""


class RewardError(ValueError):
    """The agent (or reward function) produced no usable reward."""


def load_callable(spec: str, what: str = "agent") -> Callable[..., Any]:
    """Import ``module:attr`` (attr may be dotted). An agent spec ``verifiers:...`` is a
    verifiers environment wrapped as an agent (consumers/agents/verifiers_agent.py)."""
    if what == "agent" and spec.startswith("verifiers:"):
        from .verifiers_agent import load_verifiers_agent

        return load_verifiers_agent(spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AgentLoadError(f"{what} {spec!r} must look like module.path:function")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise AgentLoadError(f"cannot import {what} module {module_name!r}: {exc}") from exc
    except SyntaxError as exc:  # the user's file: where, not a traceback
        raise AgentLoadError(
            f"{what} module {module_name!r} has a syntax error: {exc.msg} "
            f"({exc.filename}, line {exc.lineno})"
        ) from exc
    except Exception as exc:  # its top level raised while importing
        raise AgentLoadError(
            f"importing {what} module {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AgentLoadError(
                f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj) and not hasattr(obj, "remote"):
        raise AgentLoadError(f"{what} {spec!r} is not callable")
    return obj


def _is_ray_remote(fn: Any) -> bool:
    return type(fn).__name__ == "RemoteFunction" and hasattr(fn, "remote")


def _ray_signature_target(fn: Any) -> Callable[..., Any]:
    return getattr(fn, "_function", fn)


@dataclass(frozen=True)
class AgentSpec:
    """An agent callable and how to call it."""

    fn: Any
    style: str  # "llm" | "endpoint"
    kind: str  # "async" | "sync" | "ray"
    name: str = ""
    envs: bool = False  # declares an ``envs`` parameter: gets the environment client

    @classmethod
    def of(cls, fn: Any, name: str = "") -> AgentSpec:
        kind = "ray" if _is_ray_remote(fn) else ("async" if _is_async(fn) else "sync")
        target = _ray_signature_target(fn) if kind == "ray" else fn
        try:
            params = list(inspect.signature(target).parameters.values())
        except (TypeError, ValueError) as exc:
            raise AgentLoadError(
                f"agent {name or fn!r}: cannot read its signature ({exc})"
            ) from exc
        wants_envs = any(p.name == "envs" for p in params)
        # Only parameters without defaults decide the shape: rollout(task, llm, max_turns=4) is
        # llm-style; ``envs`` is passed by name, whatever the shape.
        positional = [
            p
            for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is p.empty
            and p.name != "envs"
        ]
        names = [p.name for p in positional]
        if "endpoint" in names or len(positional) >= 3:
            style = "endpoint"
        elif len(positional) == 2:
            style = "llm"
        else:
            raise AgentLoadError(
                f"agent {name or getattr(fn, '__name__', fn)!r} takes {names}: write "
                "rollout(task, llm) or rollout(task, endpoint, model)"
            )
        if kind == "ray" and style == "llm":
            raise AgentLoadError(
                "a Ray remote agent runs in another process and cannot take the llm object: "
                "write rollout(task, endpoint, model) and call the endpoint (OpenAI-compatible)"
            )
        if wants_envs and kind != "async":
            raise AgentLoadError(
                f"agent {name or getattr(target, '__name__', fn)!r} takes envs, the environment "
                "client, which is async and lives on the worker's event loop: write it as "
                "`async def rollout(task, llm, envs)`"
            )
        return cls(
            fn=fn,
            style=style,
            kind=kind,
            name=name or getattr(target, "__name__", "agent"),
            envs=wants_envs,
        )


def _is_async(fn: Any) -> bool:
    target = fn.func if isinstance(fn, functools.partial) else fn
    if inspect.iscoroutinefunction(target):
        return True
    # a callable object whose __call__ is async
    return not inspect.isroutine(target) and inspect.iscoroutinefunction(type(target).__call__)


class SyncLLM:
    """A blocking view of the tracing client for sync agents running in a worker thread."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._llm = llm
        self._loop = loop

    def chat(self, messages: list[dict], tools: list[dict] | None = None, **sampling: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(
            self._llm.chat(messages, tools=tools, **sampling), self._loop
        )
        return future.result()

    @property
    def calls(self) -> list:
        return self._llm.calls


class AgentThreads(concurrent.futures.Executor):
    """The threads sync agents run in: at most ``max_workers``, started as work arrives, each
    handing its result straight to the event loop's future (``run``): one queue put, one
    ``call_soon_threadsafe``, where ``run_in_executor`` over a ``ThreadPoolExecutor`` adds a
    concurrent future, its condition and two chained callbacks (~20 us a call on a busy core).

    A call whose future is cancelled before a thread takes it never runs. Threads are daemons:
    a sync agent that never returns cannot hold the process at exit. ``submit`` (the
    ``Executor`` interface: ``run_in_executor`` with this pool) works too.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "agent") -> None:
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting on the queue
        self._queued = 0  # calls put and not yet taken
        self._closed = False

    def run(self, loop: asyncio.AbstractEventLoop, fn: Callable, /, *args: Any) -> asyncio.Future:
        """``fn(*args)`` on a thread, in a copy of the caller's context; an asyncio future."""
        future = loop.create_future()
        self._put((_LOOP_CALL, loop, future, contextvars.copy_context(), fn, args))
        return future

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put((_PLAIN_CALL, None, future, None, functools.partial(fn, **kwargs), args))
        return future

    def _put(self, item: tuple) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot run an agent after its runner is closed")
            self._queued += 1
            start = self._queued > self._idle and len(self._threads) < self._max
            if start:
                thread = threading.Thread(
                    target=self._work,
                    name=f"{self._prefix}_{len(self._threads)}",
                    daemon=True,
                )
                self._threads.append(thread)
        self._queue.put(item)
        if start:
            thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                if item is None:  # shutdown
                    return
                self._queued -= 1
            kind, loop, future, ctx, fn, args = item
            if kind is _PLAIN_CALL:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:  # noqa: BLE001 - the caller's to judge
                        future.set_exception(exc)
                continue
            if future.done():  # cancelled while queued (a deadline, a drain): never run
                continue
            try:
                result = ctx.run(fn, *args)
            except BaseException as exc:  # noqa: BLE001 - the rollout classifies it
                if isinstance(exc, StopIteration):  # an asyncio future refuses it as is
                    exc = RuntimeError(f"the agent raised StopIteration: {exc!r}")
                outcome: tuple = (future, None, exc)
            else:
                outcome = (future, result, None)
            try:
                loop.call_soon_threadsafe(_settle_call, *outcome)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    with self._lock:
                        self._queued -= 1
                    if item[0] is _PLAIN_CALL:
                        item[2].cancel()
                    else:
                        try:
                            item[1].call_soon_threadsafe(item[2].cancel)
                        except RuntimeError:
                            pass
        for _ in threads:
            self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()


_LOOP_CALL, _PLAIN_CALL = "loop", "plain"


def _settle_call(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # cancelled while the agent ran
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


class AgentRunner:
    """Runs one agent shape; sync agents share a bounded thread pool.

    A sync agent cannot be interrupted: past its deadline the rollout ends as ``timeout`` but
    the thread runs on. ``busy_threads`` counts threads still running, and a warning says when
    none is free (new sync rollouts then wait in the pool's queue).
    """

    def __init__(self, spec: AgentSpec, *, model_name: str, threads: int = 64) -> None:
        self.spec = spec
        self.model_name = model_name
        self.threads = threads
        self.busy_threads = 0
        self._lock = threading.Lock()
        self._warned = False
        self._pool = (
            AgentThreads(max_workers=threads, thread_name_prefix="agent")
            if spec.kind == "sync"
            else None
        )

    async def run(self, task: dict, *, llm: Any, endpoint: str, envs: Any = None) -> Any:
        spec = self.spec
        args = (task, llm) if spec.style == "llm" else (task, endpoint, self.model_name)
        if spec.kind == "async":
            if spec.envs:
                return await spec.fn(*args, envs=envs)
            return await spec.fn(*args)
        if spec.kind == "ray":
            return await spec.fn.remote(*args)
        loop = asyncio.get_running_loop()
        if spec.style == "llm":
            args = (task, SyncLLM(llm, loop))
        if self.busy_threads >= self.threads and not self._warned:
            self._warned = True
            log.warning(
                "every agent thread is busy: sync agents that outlive their deadline keep "
                "theirs, and new rollouts wait",
                threads=self.threads,
            )
        # in a copy of this context: the agent's own spans nest under the rollout span
        assert self._pool is not None, "a sync agent's runner has its threads"
        return await self._pool.run(loop, self._in_thread, *args)

    def _in_thread(self, *args: Any) -> Any:
        # counted here, not at submission: a rollout cancelled while queued never takes a thread
        with self._lock:
            self.busy_threads += 1
        try:
            return self.spec.fn(*args)
        finally:
            with self._lock:
                self.busy_threads -= 1
                if self.busy_threads < self.threads:
                    self._warned = False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return float(value)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return None


def extract_reward(result: Any) -> tuple[float | None, dict[str, float]]:
    """Reward and metrics from an agent or reward-function result (None if absent)."""
    number = None if type(result) is dict else _number(result)
    if number is not None:
        return number, {}
    if isinstance(result, dict):
        raw, metrics = result.get("reward", result.get("score")), result.get("metrics") or {}
    else:
        raw = getattr(result, "reward", getattr(result, "score", None))
        metrics = getattr(result, "metrics", None) or {}
    reward = _number(raw)
    clean = {}
    if isinstance(metrics, dict):
        for key, value in metrics.items():
            v = _number(value)
            if v is not None and math.isfinite(v):
                clean[str(key)] = v
    return reward, clean


def finite_reward(reward: float | None) -> float:
    if reward is None:
        raise RewardError(
            "the agent returned no reward: return a number, {'reward': x}, or pass --reward module:fn"
        )
    if not math.isfinite(reward):
        raise RewardError(f"the reward is {reward}: a reward must be a finite number")
    return reward
