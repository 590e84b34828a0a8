"""The chaos harness: a batch of counted jobs runs through real processes while faults are
injected, then one row says what happened (the table in docs/reliability.md).

What a row counts, for one run id on a broker of its own:

- **jobs**: published (the producer's acks), **stored**: jobs with a trajectory;
- **lost**: published, yet neither stored nor dead-lettered;
- **duplicates**: trajectories stored beyond one per job (the server refuses them: 0);
- **rerun**: jobs whose agent *ran* more than once, from the agents' execution log
  (``chaos_agents``), and **extra runs** beyond one per job; both are checked against what was
  **in flight during the faults** (run before a fault ended, not stored before it began: for
  an instant fault, what was running at that instant; for one that lasts, also what started
  while it lasted): a job may run again only if a fault caught it so;
- **dead**: dead letters; **errors**: trajectories stored with a status other than ``ok``
  (``error``, ``timeout``): a fault that turns work into errors fails its row as surely as one
  that loses it;
- **stall**: the longest time with no trajectory stored, across a fault (while it lasts, the
  system may ride it out: a cluster electing new leaders without a lost node);
- **recovery**: per fault, from its end (a restart, a resume, a heal; for a SIGKILL with a
  restart at once, the kill) until every job it caught in flight is stored, and a job first
  run since it began is stored (work flows again); 0 when that happened before its end; the
  row shows the longest.

Times are wall-clock (``time.time()``) on one machine: the agents' log, the fault records and
the server's store timestamps share that clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import nats.js.errors
from chaos_agents import LOG_ENV
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from agentarium.broker import Topology
from agentarium.demo.processes import Child, child_env, start_child
from agentarium.producers import TaskProducer
from agentarium.schemas import loads

CHAOS_DIR = Path(__file__).resolve().parent
TESTS = CHAOS_DIR.parent
ROOT = TESTS.parent
AGENT = "chaos"
AGENT_SPEC = f"{AGENT}=chaos_agents:counted"


@dataclass
class Fault:
    """One injected fault. ``pids``: the processes whose in-flight work it hits (a killed
    consumer); None when it hits every process's (the broker, the network)."""

    name: str
    start: float
    end: float = 0.0
    pids: frozenset[int] | None = None


@dataclass(frozen=True)
class Row:
    scenario: str
    jobs: int
    stored: int
    lost: int
    duplicates: int
    rerun: int  # jobs whose agent ran more than once
    extra_runs: int  # executions beyond one per job
    in_flight: int  # jobs in flight during the faults, summed over faults: what may be redone
    dead: int
    errors: int  # stored with a status other than ok
    recovery_s: float
    faults: int
    stall_s: float = 0.0  # the longest time with no trajectory stored, across a fault
    command: str = ""
    notes: str = ""

    HEADER = (
        "| scenario | jobs | stored | lost | duplicate trajectories | rollouts run more than once "
        "(extra runs / in flight during the faults) | stored as error | dead-lettered | "
        "longest stall | recovery after the fault | command |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )

    def markdown(self) -> str:
        recovery = f"{self.recovery_s:.1f} s" if self.faults else "n/a"
        stall = f"{self.stall_s:.1f} s" if self.faults else "n/a"
        return (
            f"| {self.scenario} | {self.jobs:,} | {self.stored:,} | {self.lost} | "
            f"{self.duplicates} | {self.rerun} ({self.extra_runs} / {self.in_flight}) | "
            f"{self.errors} | {self.dead} | {stall} | {recovery} | `{self.command}` |"
        )

    def __str__(self) -> str:
        return (
            f"[chaos] {self.scenario}: jobs={self.jobs} stored={self.stored} lost={self.lost} "
            f"duplicates={self.duplicates} rerun={self.rerun} extra_runs={self.extra_runs} "
            f"in_flight_during_faults={self.in_flight} errors={self.errors} dead={self.dead} faults={self.faults} "
            f"recovery={self.recovery_s:.2f}s stall={self.stall_s:.2f}s {self.notes}"
        )

    def check(self, *, dead: int = 0) -> None:
        """The goals: nothing lost, one trajectory per job, no dead letter from a fault,
        redone work within what the faults caught in flight."""
        assert self.lost == 0, f"{self.lost} jobs lost: {self}"
        assert self.stored + self.dead >= self.jobs, str(self)
        assert self.duplicates == 0, str(self)
        assert self.dead == dead, str(self)
        assert self.errors == 0, str(self)
        assert self.extra_runs <= self.in_flight, str(self)


async def until(predicate, timeout_s: float, what: str) -> None:
    """Poll an async predicate (process and server state have no event to await). A request
    that fails (a broker restarting, an election) counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await predicate():
                return
        except (nats.errors.Error, OSError):  # JetStream errors and timeouts included
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.1)


async def patiently(call, timeout_s: float = 60.0):
    """``await call()`` until it answers, through an election or a restart."""
    result = None

    async def answered() -> bool:
        nonlocal result
        result = await call()
        return True

    await until(answered, timeout_s, "an answer")
    return result


@dataclass
class Execution:
    key: int
    pid: int
    at: float


def read_executions(path: Path) -> list[Execution]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        key, pid, at = line.split()
        out.append(Execution(int(key), int(pid), float(at)))
    return out


async def read_stream(
    js: JetStreamContext, stream: str, subject: str, *, timeout_s: float = 60.0
) -> list[tuple[bytes, float]]:
    """Every message on ``subject`` with the time the server stored it (unix seconds).

    The count to read is the stream leader's (``subjects_filter``), not the reading consumer's
    ``num_pending``: in a cluster an ephemeral consumer may sit on a replica that is still
    catching up after its restart or partition, whose store, and so whose pending count, ends
    before the leader's. Reading stops only once the leader's count is in hand. (The server
    lists at most 100,000 subjects in one answer, nats-server's JSMaxSubjectDetails; a run
    here has one subject per job and at most 6,000 jobs.)"""
    info = await patiently(lambda: js.stream_info(stream, subjects_filter=subject))
    expected = sum((info.state.subjects or {}).values())
    if not expected:
        return []
    sub = await js.pull_subscribe(
        subject,
        durable=None,
        stream=stream,
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=30.0,
            mem_storage=True,
        ),
    )
    out: list[tuple[bytes, float]] = []
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    msgs = await sub.fetch(512, timeout=2)
                except nats.errors.TimeoutError:
                    continue  # a cluster still electing after its fault, or a replica behind
                for msg in msgs:
                    out.append((msg.data, msg.metadata.timestamp.timestamp()))
                if len(out) >= expected:
                    break
    except TimeoutError:
        raise AssertionError(
            f"read {len(out)} of the {expected} messages stored within {timeout_s:g}s"
        ) from None
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return out


def _task_key(payload: bytes) -> tuple[int, str]:
    """The ``key`` of the job inside a trajectory or dead letter (both carry the job's task),
    and the trajectory's status, read without the full decode."""
    data = loads(payload)
    task = data.get("task") or (data.get("job") or {}).get("task") or {}
    return int(task["key"]), str(data.get("status", ""))


class ChaosRun:
    """One scenario's batch: publish counted jobs, record faults, wait, count."""

    def __init__(
        self,
        js: JetStreamContext,
        log_dir: Path,
        *,
        run: str = "chaos",
        topology: Topology | None = None,
        producer: TaskProducer | None = None,
        exec_log: Path | None = None,
    ) -> None:
        self.js = js
        self.topo = topology or Topology()
        self.run = run
        self.log_dir = log_dir
        self.exec_log = exec_log or log_dir / f"executions-{run}.log"
        self.producer = producer or TaskProducer(js, self.topo)
        self.published: set[int] = set()
        self.faults: list[Fault] = []
        self.started = time.time()
        self._baseline: tuple[int, int] | None = None  # stored, dead before this run's jobs

    @property
    def env(self) -> dict[str, str]:
        """What a consumer process needs to find and log the counted agent."""
        return {
            "PYTHONPATH": os.pathsep.join([str(CHAOS_DIR), str(TESTS), str(ROOT)]),
            LOG_ENV: str(self.exec_log),
        }

    async def publish(
        self, keys: Sequence[int], *, sleep_s: float = 0.0, pad: int = 0, **submit
    ) -> None:
        """Counted jobs, one per key; ``pad`` bytes of filler make each job (and trajectory)
        that much bigger."""
        if self._baseline is None:  # runs may follow each other on one broker
            self._baseline = await patiently(self._counts)
        tasks = [{"task_id": f"k{k}", "key": k, "sleep": sleep_s} for k in keys]
        if pad:
            tasks = [{**task, "pad": "x" * pad} for task in tasks]
        result = await self.producer.submit(AGENT, tasks, run=self.run, **submit)
        assert result.published + result.duplicates == len(keys)
        self.published.update(keys)

    @contextlib.contextmanager
    def fault(self, name: str, pids: Sequence[int] | None = None) -> Iterator[Fault]:
        """Record a fault from entering the block to leaving it (its end: the heal)."""
        fault = Fault(name, time.time(), pids=frozenset(pids) if pids is not None else None)
        try:
            yield fault
        finally:
            fault.end = time.time()
            self.faults.append(fault)

    async def _counts(self) -> tuple[int, int]:
        stored = (await self.js.stream_info(self.topo.trajectories_stream)).state.messages
        dead = (await self.js.stream_info(self.topo.dead_stream)).state.messages
        return stored, dead

    async def settled(self) -> bool:
        """Every published job has its trajectory or dead letter, and nothing is in flight."""
        stored, dead = await self._counts()
        stored0, dead0 = self._baseline or (0, 0)
        if stored - stored0 + dead - dead0 < len(self.published):
            return False
        info = await self.js.consumer_info(
            self.topo.tasks_stream, self.topo.rollout_consumer(AGENT)
        )
        return not info.num_pending and not info.num_ack_pending

    async def wait_settled(self, timeout_s: float) -> float:
        """Until ``settled()``; returns the seconds it took. A request that fails (a broker
        restarting, an election) counts as not yet. Polls: server-side state has no event."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            try:
                if await self.settled():
                    return time.monotonic() - started
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {self.run} not settled within {timeout_s}s")
            await asyncio.sleep(0.25)

    async def tally(self, scenario: str, *, command: str = "", notes: str = "") -> Row:
        for attempt in range(20):  # a cluster may still be electing leaders after its fault
            try:
                return await self._tally(scenario, command=command, notes=notes)
            except (nats.errors.Error, OSError):
                if attempt == 19:
                    raise
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable")

    async def _tally(self, scenario: str, *, command: str, notes: str) -> Row:
        stored_msgs = await read_stream(
            self.js,
            self.topo.trajectories_stream,
            self.topo.trajectories_filter(self.run, AGENT),
        )
        stored_at: dict[int, float] = {}
        errors = set()
        for payload, at in stored_msgs:
            key, status = _task_key(payload)
            stored_at[key] = min(at, stored_at.get(key, at))
            if status != "ok":
                errors.add(key)
        dead_msgs = await read_stream(self.js, self.topo.dead_stream, self.topo.dead_subject(AGENT))
        dead = {_task_key(payload)[0] for payload, _ in dead_msgs} & self.published
        executions = [e for e in read_executions(self.exec_log) if e.key in self.published]
        runs = Counter(e.key for e in executions)
        first_run: dict[int, float] = {}
        for e in executions:
            first_run[e.key] = min(e.at, first_run.get(e.key, e.at))

        in_flight_sets = []
        recoveries = []
        for fault in self.faults:
            caught = {
                e.key
                for e in executions
                if e.at < fault.end
                and (fault.pids is None or e.pid in fault.pids)
                and stored_at.get(e.key, float("inf")) > fault.start
            }
            in_flight_sets.append(caught)
            # the work it caught is stored, and work begun since it began is stored again
            done = max((stored_at.get(k, float("inf")) for k in caught), default=fault.end)
            resumed = min(
                (
                    at
                    for key, at in stored_at.items()
                    if at > fault.end and first_run.get(key, 0.0) >= fault.start
                ),
                default=fault.end,
            )
            recoveries.append(max(0.0, done - fault.end, resumed - fault.end))
        caught_any = set().union(*in_flight_sets) if in_flight_sets else set()
        rerun = {k for k, n in runs.items() if n > 1}
        unexplained = rerun - caught_any
        assert not unexplained, (
            f"jobs run again though no fault caught them in flight: {sorted(unexplained)[:20]}"
        )
        times = sorted(stored_at.values())
        stall = max(
            (
                b - a
                for a, b in zip(times, times[1:], strict=False)
                if any(b > f.start and a < f.end for f in self.faults)
            ),
            default=0.0,
        )
        return Row(
            scenario=scenario,
            jobs=len(self.published),
            stored=len(stored_at.keys() & self.published),
            lost=len(self.published - stored_at.keys() - dead),
            duplicates=len(stored_msgs) - len(stored_at),
            rerun=len(rerun),
            extra_runs=sum(n - 1 for n in runs.values()),
            in_flight=sum(len(s) for s in in_flight_sets),
            dead=len(dead),
            errors=len(errors),
            recovery_s=max(recoveries, default=0.0),
            faults=len(self.faults),
            stall_s=stall,
            command=command,
            notes=notes,
        )


@dataclass
class ConsumerPool:
    """``agentarium consumer`` processes for the counted agent, killed and restarted by slot."""

    run: ChaosRun
    nats_url: str
    llm_urls: Sequence[str]
    extra: Sequence[str] = ()
    urls: dict[int, str] = field(default_factory=dict)  # a slot's own NATS URL(s)
    children: dict[int, Child] = field(default_factory=dict)
    worker_ids: dict[int, str] = field(default_factory=dict)
    restarts: int = 0

    def start(self, slot: int, extra: Sequence[str] = (), **env: str) -> Child:
        """Start the slot's consumer; ``extra`` flags and ``env`` variables for this process
        only (after the pool's own ``extra``: a flag given twice takes the last)."""
        worker_id = self.worker_ids[slot] = f"chaos-{slot}-{self.restarts}"
        url = self.urls.get(slot, self.nats_url)
        args = ["consumer", "--agent", AGENT_SPEC, "--nats-url", url]
        for url in self.llm_urls:
            args += ["--llm", url]
        args += ["--worker-id", worker_id, *self.extra, *extra]
        child = start_child(
            f"consumer-{worker_id}",
            args,
            self.run.log_dir,
            env=child_env(**self.run.env, **env),
        )
        self.children[slot] = child
        return child

    def kill(self, slot: int) -> int:
        """SIGKILL the slot's consumer (no drain: its jobs stay unacked); returns its pid."""
        child = self.children[slot]
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait()
        return child.proc.pid

    async def terminate(self, slot: int, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the slot's consumer (a scale-down: it drains) and wait for its exit code,
        in a thread, so the event loop keeps serving the fake fleet it finishes against."""
        child = self.children[slot]
        child.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.to_thread(child.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            return None

    def restart(self, slot: int) -> Child:
        self.restarts += 1
        return self.start(slot)

    async def stop(self) -> list[int | None]:
        """SIGTERM every consumer (they drain) and return their exit codes. Waits in a
        thread: the event loop keeps serving the fake fleet and proxies the consumers use."""
        return await asyncio.to_thread(self._stop)

    def _stop(self) -> list[int | None]:
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        codes = []
        for child in self.children.values():
            try:  # one SIGTERM only: a second one at its very exit would kill it
                codes.append(child.proc.wait(60))
            except subprocess.TimeoutExpired:
                child.kill()
                codes.append(child.proc.returncode)
        return codes
