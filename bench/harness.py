"""What the rollout benchmarks share: consumer processes from any checkout, pinned to cores,
with their CPU time and memory read from /proc, and a cheap "all stored" wait.

A consumer is started as ``python -m agentarium consumer`` from a source tree (this checkout,
or another one: ``--tree before=/path`` compares two versions in the same run), so what is
measured is the command users run. CPU seconds per rollout (utime + stime of the consumer
process, over a batch) are the figure that survives a noisy machine; rollouts/s is printed
beside it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentarium.demo.processes import terminate

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads started later inherit it)."""
    if not cpus:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that just exited


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads."""
    user, system = cpu_split(pid)
    return user + system


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a live process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024
    return out


def split_cpus(pin_enabled: bool) -> tuple[set[int] | None, set[int] | None]:
    """(the consumer's cores, everyone else's): the first core against the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin_enabled or len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


def _child_setup(cpus: set[int] | None) -> None:
    """In the child before exec: its cores, and SIGTERM when the benchmark dies (Linux)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Consumer:
    """One ``agentarium consumer`` process of one source tree."""

    tree: Path
    agent: str
    spec: str
    llm: str
    nats_url: str
    concurrency: int
    log_path: Path
    cpus: set[int] | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    profile_out: Path | None = None  # run under bench/cpuprof.py, writing here
    proc: subprocess.Popen | None = None

    def start(self) -> Consumer:
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            AGENTARIUM_LOG_FORMAT="json",
            PYTHONPATH=f"{self.tree}:{self.tree / 'tests'}:{ROOT / 'tests'}:{ROOT / 'bench'}",
        )
        env.update(self.env)
        launcher = [sys.executable]
        if self.profile_out is not None:
            launcher.append(str(ROOT / "bench" / "cpuprof.py"))
            env["CPUPROF_OUT"] = str(self.profile_out)
        cpus = self.cpus
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *launcher,
                    "-m",
                    "agentarium",
                    "consumer",
                    "--agent",
                    f"{self.agent}={self.spec}",
                    "--llm",
                    self.llm,
                    "--nats-url",
                    self.nats_url,
                    "--concurrency",
                    str(self.concurrency),
                    "--proxy-host",
                    "127.0.0.1",
                    *self.extra_args,
                ],
                cwd=self.tree,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: _child_setup(cpus),
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, "start() first"
        return self.proc.pid

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def cpu_split(self) -> tuple[float, float]:
        return cpu_split(self.pid)

    async def profile(self, body):
        """Sample this consumer's CPU (bench/cpuprof.py) while ``await body()`` runs; returns
        (the body's result, the collapsed stacks)."""
        assert self.profile_out is not None, "start the consumer with profile_out"
        self.profile_out.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        try:
            result = await body()
        finally:
            self.proc.send_signal(signal.SIGUSR2)
        for _ in range(600):
            if self.profile_out.exists():
                return result, self.profile_out.read_text()
            await asyncio.sleep(0.05)  # the consumer writes the file between two callbacks
        raise RuntimeError(f"no profile from {self.agent}:\n{self.log_tail()}")

    def memory(self) -> dict[str, int]:
        return memory(self.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout_s: float = 60.0) -> int | None:
        return None if self.proc is None else terminate(self.proc, timeout_s)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


async def wait_registered(js, topo, worker_count: int, consumers: list[Consumer]) -> None:
    """Until ``worker_count`` workers are in the registry (each registers once it pulls)."""
    from agentarium.broker.registry import live_workers

    deadline = time.monotonic() + 120
    while len(await live_workers(js, topo)) < worker_count:
        for consumer in consumers:
            if not consumer.alive():
                raise RuntimeError(f"consumer {consumer.agent} exited:\n{consumer.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError("consumers did not register within 120 s")
        await asyncio.sleep(0.1)  # polling the registry: no event says "registered"


async def stored(js, stream: str) -> int:
    """Messages in ``stream`` (one stream-info request: cheap enough to poll)."""
    return (await js.stream_info(stream)).state.messages


async def wait_stored(js, stream: str, target: int, *, every_s: float = 0.02, watch=None) -> None:
    """Until ``stream`` holds ``target`` messages; ``watch()`` may raise to give up early."""
    while await stored(js, stream) < target:
        if watch is not None:
            watch()
        await asyncio.sleep(every_s)  # polling a count: no event exists for "all stored"


def median_range(values: list[float], fmt: str = "{:.0f}") -> str:
    import statistics

    return (
        f"{fmt.format(statistics.median(values))} "
        f"({fmt.format(min(values))}..{fmt.format(max(values))})"
    )
