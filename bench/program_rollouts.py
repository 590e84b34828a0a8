"""Rollouts/s of a program agent that makes one LLM call, beside a Python function agent making
the same call, in one run: ``python bench/program_rollouts.py [--jobs 160] [--rounds 5]``.

One nats-server, one instant SGLang-shaped engine in its own process (bench/fake_fleet.py) and,
per mode, one ``agentarium consumer`` process (the command users run, bench/harness.py), all
with the same ``--concurrency``. Every mode's agent makes one call of one token with the
task's prompt:

  function        ``agentarium.examples.toy:one_call``: ``llm.chat`` inside the consumer, no HTTP
  function-http   ``bench/agents.py:one_http_call``: a chat completion through the rollout's
                  gateway over HTTP (aiohttp, a fresh connection), from inside the consumer
  program-python  ``exec:python3 bench/programs/one_call.py``: the same call from a program,
                  standard library only (urllib), run per rollout by the consumer
  program-sh      ``exec:bench/programs/one_call.sh``: the same with sh, sed and curl

Per round, in a rotated order, each mode gets one batch of ``--jobs`` jobs published at once
(rollouts/s from the first publish to the last stored trajectory, and the CPU of the consumer
with its children, the programs and their supervisors, per rollout, from /proc), then
``--alone`` jobs one at a time (a rollout's latency by itself: publish to trajectory received,
and the rollout's own wall time in the consumer). Every batch is checked: one trajectory per
job, status ok, no dead letter, exactly one call with token ids, its prompt the task's; for the
programs, exit 0 and the reply the program printed equal to the recorded one.

Where a program's extra time goes, timed here in the same rounds (one at a time, spawned and
awaited as the consumer does): the supervisor's interpreter (``python -I -S -c pass``), the
consumer's whole program machinery around a program that does nothing
(``consumers.program_run.run_program(["true"])``: supervisor, spawn, the tree's end), and the
programs' own starts (``python3 -c "import json, os, sys, urllib.request"``; sh running sed and
``curl --version``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from harness import TICKS, Consumer, median_range, wait_registered  # noqa: E402

from agentarium.broker import NatsServer, NatsSettings, Topology, provision  # noqa: E402
from agentarium.consumers.agents.program import run_as  # noqa: E402
from agentarium.consumers.agents.program_run import run_program  # noqa: E402
from agentarium.demo.processes import child_env  # noqa: E402
from agentarium.producers import TaskProducer, TrajectoryReader  # noqa: E402

PROGRAMS = ROOT / "bench" / "programs"


def program_python() -> str:
    """The program's interpreter: the system's python3 (a root consumer runs programs as
    nobody, who may not reach a venv under /root), else this one."""
    return "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def readable_programs() -> Path:
    """bench/programs where every user can read them (a program runs as nobody under root)."""
    dest = Path(tempfile.mkdtemp(prefix="agentarium-bench-programs-"))
    dest.chmod(0o755)
    for name in ("one_call.py", "one_call.sh"):
        shutil.copy2(PROGRAMS / name, dest / name)
        (dest / name).chmod(0o755)
    return dest


def modes(programs: Path) -> dict[str, str]:
    return {
        "function": "agentarium.examples.toy:one_call",
        "function-http": "agents:one_http_call",
        "program-python": f"exec:{program_python()} {programs / 'one_call.py'}",
        "program-sh": f"exec:{programs / 'one_call.sh'}",
    }


def cpu_with_children(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid``: its own CPU and its waited-for children's
    (the supervisors, whose own include their programs')."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICKS


@dataclass
class Row:
    mode: str
    consumer: Consumer
    rate: list[float] = field(default_factory=list)  # rollouts/s per batch
    cpu_ms: list[float] = field(default_factory=list)  # per rollout, consumer + children
    alone_ms: list[float] = field(default_factory=list)  # publish -> trajectory, one at a time
    wall_ms: list[float] = field(default_factory=list)  # finished_at - started_at, alone
    program_ms: list[float] = field(default_factory=list)  # metadata["program"]["seconds"]


def check(mode: str, trajectories: list, job_ids: set[str], prompts: dict[str, str]) -> None:
    """One ok trajectory per job, one call with token ids and the task's prompt, and for a
    program its exit 0 and the reply it printed equal to the recorded one."""
    problems = []
    if sorted(t.job_id for t in trajectories) != sorted(job_ids):
        problems.append(f"{len(trajectories)} trajectories for {len(job_ids)} jobs")
    for t in trajectories:
        if t.status != "ok":
            problems.append(f"{t.status}: {(t.error or '')[-800:]}")
            continue
        if len(t.calls) != 1 or not (t.calls[0].prompt_ids and t.calls[0].response_ids):
            problems.append(f"{len(t.calls)} calls, or one without token ids")
            continue
        messages = t.calls[0].messages or []
        if len(messages) != 2 or messages[0].get("content") != prompts[t.task_id]:
            problems.append(f"the call's messages {messages!r:.200} are not the task's prompt")
            continue
        if mode.startswith("program"):
            program = t.metadata.get("program", {})
            lines = program.get("stdout", "").splitlines()
            said = json.loads(lines[0])["choices"][0]["message"]["content"] if lines else None
            if program.get("exit_code") != 0 or said != messages[1].get("content"):
                problems.append(f"program {program!r:.400} is not the recorded call's")
    if problems:
        raise RuntimeError(f"{mode}: {len(problems)} problems, first: {problems[0]}")


async def dead(js, topo: Topology) -> int:
    return (await js.stream_info(topo.dead_stream)).state.messages


async def batch(js, topo, row: Row, jobs: int, run: str) -> None:
    """``jobs`` jobs published at once; rollouts/s and CPU per rollout; checked."""
    stream = topo.trajectories_stream
    before, dead_before = (await js.stream_info(stream)).state.messages, await dead(js, topo)
    tasks = [{"task_id": f"t{i}", "prompt": f"repeat {i} of {run}"} for i in range(jobs)]
    cpu0, start = cpu_with_children(row.consumer.pid), time.perf_counter()
    submitted = await TaskProducer(js, topo).submit(row.consumer.agent, tasks, run=run)
    while (await js.stream_info(stream)).state.messages < before + jobs:
        if not row.consumer.alive():
            raise RuntimeError(f"consumer {row.mode} exited:\n{row.consumer.log_tail()}")
        await asyncio.sleep(0.01)  # polling a count: no event exists for "all stored"
    elapsed = time.perf_counter() - start
    row.rate.append(jobs / elapsed)
    row.cpu_ms.append((cpu_with_children(row.consumer.pid) - cpu0) / jobs * 1e3)
    trajectories = await TrajectoryReader(js, topo).read(run, row.consumer.agent)
    check(
        row.mode, trajectories, set(submitted.job_ids), {t["task_id"]: t["prompt"] for t in tasks}
    )
    if await dead(js, topo) != dead_before:
        raise RuntimeError(f"{row.mode}: dead letters in run {run}")


async def alone(nc, js, topo, row: Row, jobs: int, run: str) -> None:
    """``jobs`` jobs one after another, each published once the last one's trajectory came."""
    sub = await nc.subscribe(topo.trajectories_filter(run, row.consumer.agent))
    tasks = [{"task_id": f"a{i}", "prompt": f"alone {i} of {run}"} for i in range(jobs)]
    ids: set[str] = set()
    try:
        for task in tasks:
            start = time.perf_counter()
            ids.update(
                (await TaskProducer(js, topo).submit(row.consumer.agent, [task], run=run)).job_ids
            )
            await sub.next_msg(timeout=60)
            row.alone_ms.append((time.perf_counter() - start) * 1e3)
    finally:
        await sub.unsubscribe()
    trajectories = await TrajectoryReader(js, topo).read(run, row.consumer.agent)
    check(row.mode, trajectories, ids, {t["task_id"]: t["prompt"] for t in tasks})
    for t in trajectories:
        row.wall_ms.append((t.finished_at - t.started_at) * 1e3)
        if "program" in t.metadata:
            row.program_ms.append(t.metadata["program"]["seconds"] * 1e3)


async def spawn_ms(argv: list[str]) -> float:
    """Milliseconds to start ``argv`` and wait for it (asyncio, pipes, as the consumer does)."""
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{argv}: exit {proc.returncode}: {err.decode()[-300:]}")
    return (time.perf_counter() - start) * 1e3


async def machinery_ms(work: Path) -> float:
    """Milliseconds of ``run_program(["true"])``: the consumer's supervisor around a program
    that does nothing, as the program's user (nobody under root), in ``work``."""
    stdin = work / "task.json"
    stdin.write_text("{}\n")
    start = time.perf_counter()
    output = await run_program(
        ["true"], cwd=str(work), env={"PATH": "/usr/bin:/bin"}, stdin_path=str(stdin),
        user=run_as("auto"), grace_s=0.5, output_bytes=65536,
    )  # fmt: skip
    if not output.ok:
        raise RuntimeError(output.failure())
    return (time.perf_counter() - start) * 1e3


def parts(programs: Path) -> dict[str, list[str] | None]:
    """What a program's run is made of, each timed alone; None: ``machinery_ms``."""
    py, sup = program_python(), [sys.executable, "-I", "-S", "-c"]
    sh = f"sed -n p </dev/null; curl --version >/dev/null; test -r {programs / 'one_call.sh'}"
    return {
        "`python -I -S -c pass`: the supervisor's interpreter": [*sup, "pass"],
        "the same importing what the supervisor imports": [
            *sup, "import ctypes, json, os, signal, socket, subprocess, sys, threading, time"
        ],
        "`run_program(['true'])`: the consumer's whole machinery, no program": None,
        "`python3 -c pass`: program-python's interpreter": [py, "-c", "pass"],
        "`python3 -c 'import json, os, sys, urllib.request'`: program-python's start": [
            py, "-c", "import json, os, sys, urllib.request"
        ],
        "`sh -c 'sed ...; curl --version'`: program-sh's processes": ["/bin/sh", "-c", sh],
    }  # fmt: skip


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="agentarium-bench-"))
    programs = readable_programs()
    server = NatsServer(store_dir=tmp / "nats").start()
    fake = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "fake_fleet.py")],
        stdout=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    fake_url = fake.stdout.readline().split(" on ", 1)[1].strip()  # type: ignore[union-attr]
    nc = await NatsSettings(url=server.url).connect(name="bench-program-rollouts")
    js, topo = nc.jetstream(), Topology()
    rows: list[Row] = []
    timings: dict[str, list[float]] = {name: [] for name in parts(programs)}
    started = time.monotonic()
    load = [os.getloadavg()[0]]
    try:
        for mode, spec in modes(programs).items():
            await provision(js, topo, agents=(mode,))
            consumer = Consumer(
                tree=ROOT, agent=mode, spec=spec, llm=fake_url, nats_url=server.url,
                concurrency=args.concurrency, log_path=tmp / "logs" / f"consumer-{mode}.log",
            ).start()  # fmt: skip
            rows.append(Row(mode=mode, consumer=consumer))
        await wait_registered(js, topo, len(rows), [r.consumer for r in rows])
        for row in rows:  # warm-up: imports, connections, the page cache for the programs
            scratch = Row(mode=row.mode, consumer=row.consumer)  # its figures are dropped
            await batch(js, topo, scratch, min(args.jobs, 50), f"w-{row.mode}")
            await alone(nc, js, topo, scratch, 3, f"wa-{row.mode}")
        for r in range(args.rounds):
            order = rows[r % len(rows) :] + rows[: r % len(rows)]
            for row in order:
                await batch(js, topo, row, args.jobs, f"r{r}-{row.mode}")
                await alone(nc, js, topo, row, args.alone, f"a{r}-{row.mode}")
                print(
                    f"  round {r}: {row.mode:<15} {row.rate[-1]:7.0f} rollouts/s "
                    f"{row.cpu_ms[-1]:6.2f} ms CPU/rollout, alone "
                    f"{statistics.median(row.alone_ms[-args.alone :]):6.1f} ms",
                    flush=True,
                )
            for name, argv in parts(programs).items():
                for _ in range(args.alone):
                    timings[name].append(
                        await (machinery_ms(programs) if argv is None else spawn_ms(argv))
                    )
            load.append(os.getloadavg()[0])
    finally:
        await nc.close()
        for row in rows:
            row.consumer.terminate()
        fake.terminate()
        server.stop()
        shutil.rmtree(programs, ignore_errors=True)
    print(
        f"\n{args.jobs} jobs per batch, consumer --concurrency {args.concurrency}, "
        f"{args.alone} jobs alone per round; median (min..max) of {args.rounds} rounds "
        f"(latencies: median over all rounds' jobs, 90th percentile); "
        f"{time.monotonic() - started:.0f} s, load average {load[0]:.1f} -> {load[-1]:.1f} "
        f"(max {max(load):.1f}); programs run as {run_as('auto') or 'the consumer user'}"
    )
    base = statistics.median(rows[0].rate)
    print(
        f"| mode | rollouts/s | vs {rows[0].mode} | CPU ms/rollout (consumer + children) "
        "| alone: publish to trajectory, p90 | alone: rollout wall in the consumer "
        "| alone: program run |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        program = f"{statistics.median(row.program_ms):.1f} ms" if row.program_ms else ""
        print(
            f"| {row.mode} | {median_range(row.rate)} | {statistics.median(row.rate) / base:.2f}x "
            f"| {median_range(row.cpu_ms, '{:.2f}')} "
            f"| {statistics.median(row.alone_ms):.1f} ms, {p90(row.alone_ms):.1f} ms "
            f"| {statistics.median(row.wall_ms):.1f} ms | {program} |"
        )
    print(f"\nwhat a program's run is made of, {args.alone} of each per round, one at a time:")
    print("| part | median | p90 |")
    print("|---|---|---|")
    for name, values in timings.items():
        print(f"| {name} | {statistics.median(values):.1f} ms | {p90(values):.1f} ms |")


def p90(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.9 * len(values)))]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=160, help="jobs per batch (every mode)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32, help="every consumer's")
    parser.add_argument("--alone", type=int, default=10, help="jobs one at a time per round")
    asyncio.run(main(parser.parse_args()))
