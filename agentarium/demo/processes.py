"""Child processes of the demo and tests: the engine and consumers, started as the
``agentarium`` command would start them, with their readiness awaited, not slept on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

_READY = re.compile(r"engine ready on (http://\S+)")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    url: str = ""
    _threads: list[threading.Thread] = field(default_factory=list)
    _ready: threading.Event | None = None
    _holder: dict = field(default_factory=dict)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        """Block until the child printed its URL (started with ``watch_ready``); returns it."""
        if self._ready is None:
            raise ValueError(f"{self.name} was started without watch_ready")
        if not self._ready.wait(timeout_s) or "url" not in self._holder:
            self.kill()
            tail = (
                self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
            )
            raise RuntimeError(
                f"{self.name} did not become ready within {timeout_s}s; log tail:\n{tail}"
            )
        self.url = self._holder["url"]
        return self.url

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        return terminate(self.proc, timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ChildExited(RuntimeError):
    """A child of the demo exited while the demo still needed it."""

    def __init__(self, child: Child) -> None:
        code = child.proc.returncode
        how = f"signal {-code}" if code is not None and code < 0 else f"code {code}"
        tail = child.log_path.read_text(errors="replace") if child.log_path.exists() else ""
        last = "\n".join(tail.rstrip("\n").splitlines()[-10:])
        super().__init__(
            f"{child.name} exited ({how}) while the demo needed it; its log is {child.log_path}"
            + (f", last lines:\n{last}" if last else "")
        )
        self.child = child


def check_alive(children: list[Child], *, may_finish: str = "trainer") -> None:
    """Raise ChildExited for the first child that exited, except ``may_finish`` exiting 0
    (the trainer ends the run at its --steps)."""
    for child in children:
        code = child.proc.poll()
        if code is not None and not (child.name == may_finish and code == 0):
            raise ChildExited(child)


def consumer_argv(agent: str, llm: str, model: str | Path, nats_url: str, *extra: str) -> list[str]:
    """``agentarium consumer``'s arguments: ``agent`` (``NAME=module:function``) on the LLM
    server ``llm`` serving ``model``."""
    return [
        "consumer",
        "--agent",
        agent,
        "--llm",
        llm,
        "--model",
        str(model),
        "--nats-url",
        nats_url,
        *extra,
    ]


def terminate(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """SIGTERM (a service drains), then SIGKILL if it does not exit in time; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stop_all(children: Sequence[Child], timeout_s: float = 30.0) -> None:
    """SIGTERM every child still running, all at once, then wait for them with one deadline and
    SIGKILL whoever outlives it: the whole stop takes at most ``timeout_s`` (plus the kills),
    however many children there are and whatever each waits for while it drains."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # Five processes share two cores: one torch/BLAS thread each.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("AGENTARIUM_LOG_FORMAT", "json")
    env.update(extra)
    return env


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (Linux), so a killed
    demo or test never leaves engines and consumers behind."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's finally blocks still terminate children


def _pump(stream, log_file, ready: threading.Event | None, holder: dict) -> None:
    with open(log_file, "ab") as out:
        for raw in iter(stream.readline, b""):
            out.write(raw)
            out.flush()
            if ready is not None and not ready.is_set():
                match = _READY.search(raw.decode(errors="replace"))
                if match:
                    holder["url"] = match.group(1)
                    ready.set()
    if ready is not None:
        ready.set()  # exited before ready: the caller sees no url


def start_child(
    name: str,
    args: list[str],
    log_dir: Path,
    *,
    wait_ready: bool = False,
    watch_ready: bool = False,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> Child:
    """Run ``python -m agentarium ARGS``; with ``wait_ready``, block until it prints its URL;
    with ``watch_ready``, return at once and let ``Child.wait_ready()`` block later (so other
    processes start while this one loads)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentarium", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env or child_env(),
        preexec_fn=_die_with_parent,
    )
    ready = threading.Event() if wait_ready or watch_ready else None
    holder: dict = {}
    pump = threading.Thread(target=_pump, args=(proc.stdout, log_path, ready, holder), daemon=True)
    pump.start()
    child = Child(
        name=name, proc=proc, log_path=log_path, _threads=[pump], _ready=ready, _holder=holder
    )
    if wait_ready:
        child.wait_ready(timeout_s)
    return child
