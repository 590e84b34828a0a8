"""Misbehaving agents for the fuzzed worker corpus, run by `agentarium consumer` processes.

``task["do"]`` picks the behaviour and its arguments travel in the task, so one async agent
(``rollout``) and one sync agent (``rollout_sync``, run in the worker's thread pool) cover the
whole corpus. Each behaviour is what a buggy user agent does: return what is not a reward,
raise anything (``BaseException`` subclasses included), hang, swallow its cancellation, print
or return megabytes, or call the LLM with nonsense.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import numpy as np


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class CustomBase(BaseException):
    """A BaseException that is not an Exception, as some libraries define."""


class RewardExplodes:
    @property
    def reward(self) -> float:
        raise ValueError("the reward property exploded")


def _exception(name: str, size: int) -> BaseException:
    message = "x" * size if size else f"fuzz {name}"
    return {
        "ValueError": lambda: ValueError(message),
        "Unprintable": Unprintable,
        "MemoryError": lambda: MemoryError(message),
        "KeyboardInterrupt": KeyboardInterrupt,
        "SystemExit0": lambda: SystemExit(0),
        "SystemExit3": lambda: SystemExit(3),
        "SystemExitText": lambda: SystemExit(message),
        "GeneratorExit": GeneratorExit,
        "CustomBase": lambda: CustomBase(message),
        "CancelledError": asyncio.CancelledError,
        "StopAsyncIteration": StopAsyncIteration,
        "TimeoutError": lambda: TimeoutError(message),
    }[name]()


def _returned(kind: str) -> Any:
    return {
        "nan": lambda: float("nan"),
        "inf": lambda: float("inf"),
        "-inf": lambda: float("-inf"),
        "reward_nan": lambda: {"reward": float("nan")},
        "reward_inf": lambda: {"reward": float("inf"), "metrics": {"m": 1.0}},
        "object": object,
        "generator": lambda: (i for i in range(3)),
        "ndarray": lambda: np.ones(3),
        "huge_int": lambda: 10**400,
        "string": lambda: "1.0",
        "none": lambda: None,
        "list": lambda: [1.0],
        "set": lambda: {1.0},
        "bytes": lambda: b"\xff\x00",
        "complex": lambda: 1j,
        "reward_property_raises": RewardExplodes,
        "reward_string": lambda: {"reward": "0.5"},
    }[kind]()


def _chat_args(kind: str) -> tuple[Any, dict]:
    """llm.chat arguments an agent gets wrong."""
    hello = [{"role": "user", "content": "hi"}]
    return {
        "messages_str": ("not a list of messages", {}),
        "messages_ints": ([1, 2, 3], {}),
        "negative_tokens": (hello, {"max_new_tokens": -5}),
        "unknown_option": (hello, {"beam_width": 4}),
        "hot_temperature": (hello, {"temperature": "hot"}),
        "top_p_zero": (hello, {"top_p": 0.0}),
    }[kind]


def _print_megabytes(n: int) -> None:
    chunk = "p" * (1024 * 1024)
    for _ in range(n):  # 1 MiB lines: what a runaway debug print does
        sys.stdout.write(chunk + "\n")
    sys.stdout.flush()


def _plain(task: dict) -> Any:
    """The behaviours a sync and an async agent share (no awaiting)."""
    do = task["do"]
    if do == "return":
        return _returned(task["value"])
    if do == "raise":
        raise _exception(task["exc"], task.get("size", 0))
    if do == "recursion":
        return _recurse(0)
    if do == "print":
        _print_megabytes(task["mib"])
        return 1.0
    if do == "huge_metrics":
        return {"reward": 1.0, "metrics": {f"metric_{i}": float(i) for i in range(task["n"])}}
    if do == "huge_result":
        return {"reward": 1.0, "blob": "b" * (task["mib"] * 1024 * 1024)}
    if do == "junk_metrics":  # not numbers: dropped, the rollout is fine
        return {"reward": 0.5, "metrics": {"obj": object(), "nan": float("nan"), "s": "x"}}
    raise AssertionError(f"unknown behaviour {do!r}")


def _recurse(n: int) -> int:
    return _recurse(n + 1) + 1


async def rollout(task: dict, llm) -> Any:
    do = task["do"]
    if do == "ok":
        result = await llm.chat([{"role": "user", "content": str(task.get("prompt", "hi"))}])
        return {"reward": float(len(result.call.response_ids)), "metrics": {"calls": 1.0}}
    if do == "hang":
        await asyncio.sleep(3600)
    if do == "ignore_cancel":
        # Swallows every cancellation for a while (a cleanup that will not be interrupted),
        # then returns as if nothing happened.
        until = time.monotonic() + task["for_s"]
        while time.monotonic() < until:
            try:
                await asyncio.sleep(until - time.monotonic())
            except asyncio.CancelledError:
                continue
        return 1.0
    if do == "bad_chat":
        messages, options = _chat_args(task["call"])
        await llm.chat(messages, **options)
        return 1.0
    if do == "stop_iteration":
        raise StopIteration  # inside a coroutine: Python turns it into a RuntimeError
    if do == "forgot_await":
        return llm.chat([{"role": "user", "content": "hi"}])  # a coroutine, never awaited
    return _plain(task)


def rollout_sync(task: dict, llm) -> Any:
    do = task["do"]
    if do == "ok":
        result = llm.chat([{"role": "user", "content": "sync"}])
        return float(len(result.call.response_ids))
    if do == "hang":  # a thread cannot be cancelled: it runs on, the rollout ends
        time.sleep(task["for_s"])
        return 1.0
    return _plain(task)
