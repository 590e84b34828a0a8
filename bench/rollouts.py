"""End-to-end rollouts/s and consumer CPU per rollout: producer -> JetStream -> one consumer
process -> backend -> trajectory stored.

Cases (one consumer process each, started once, warmed up, then measured batch after batch):
  noop       agent ``agentarium.examples.toy:noop`` (no LLM call; a sync function, so run in the
             consumer's thread pool): the ceiling for sync agents
  noop_async agent ``bench/agents.py:noop`` (no LLM call, async): the pipeline's own ceiling
  one_call   agent ``agentarium.examples.toy:one_call`` (one LLM call, 1 token) against an instant fake
             backend with SGLang's response shape (bench/fake_fleet.py, another process)
  engine     (--engine) the same agent against the local CPU engine with the tiny model

Per batch: jobs/s from the first publish to the last stored trajectory, and the consumer
process's CPU time (utime + stime from /proc) divided by the jobs, in microseconds: the figure
that survives a shared machine. Every trajectory is checked to be ``ok``.

``--tree NAME=PATH`` (repeatable) runs the consumer from other checkouts too, e.g. the code
before a change: every tree gets its own consumer, and the trees' batches alternate within each
repeat, so both see the same machine. With ``--pin`` consumers run on the first core and
everything else (nats-server, the fake backend, this script) on the rest.

``--profile DIR`` runs the consumers under bench/cpuprof.py (CPU-time sampling) and records
one more batch per consumer, then prints where the consumer's CPU goes per rollout
(bench/profile_summary.py); the stacks stay in DIR.

    .venv/bin/python bench/rollouts.py [--jobs 5000] [--repeats 5] [--tree before=/tmp/base]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import (  # noqa: E402
    Consumer,
    _child_setup,
    cpu_seconds,
    median_range,
    pin,
    split_cpus,
    stored,
    wait_registered,
)

from agentarium.broker import NatsServer, NatsSettings, Topology, provision  # noqa: E402
from agentarium.demo.processes import child_env, start_child  # noqa: E402
from agentarium.producers import TaskProducer, TrajectoryReader  # noqa: E402
from agentarium.tiny import ensure_tiny_model  # noqa: E402

CASES = {
    "noop": "agentarium.examples.toy:noop",
    "noop_async": "agents:noop",
    "one_call": "agentarium.examples.toy:one_call",
    "engine": "agentarium.examples.toy:one_call",
}


@dataclass
class Batch:
    rate: float  # rollouts/s
    cpu_us: float  # consumer CPU microseconds per rollout
    cpu_share: float  # consumer CPU seconds / wall seconds
    system: float  # the kernel's part of the CPU time (sockets)
    nats_us: float = 0.0  # nats-server CPU microseconds per rollout
    others_us: float = 0.0  # the fake backend's and this script's (producer, polling)


@dataclass
class Row:
    tree: str
    case: str
    consumer: Consumer
    batches: list[Batch] = field(default_factory=list)


def start_fake(cpus: set[int] | None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "fake_fleet.py")],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        preexec_fn=lambda: _child_setup(cpus),
    )
    line = proc.stdout.readline()
    return proc, line.split(" on ", 1)[1].strip()


SIDE: dict[str, int] = {}  # "nats", "fake": pids whose CPU is reported beside the consumer's


def side_cpu() -> tuple[float, float]:
    """CPU seconds so far of nats-server, and of the fake backend plus this process."""
    nats = cpu_seconds(SIDE["nats"]) if "nats" in SIDE else 0.0
    others = time.process_time() + (cpu_seconds(SIDE["fake"]) if "fake" in SIDE else 0.0)
    return nats, others


async def one_batch(
    js, topo, row: Row, jobs: int, run: str, check: bool, group_size: int = 1
) -> Batch:
    stream = topo.trajectories_stream
    before = await stored(js, stream)
    # Every task's prompt is new (the run names the batch); a task's group_size samples share it.
    tasks = [
        {"task_id": f"t{i}", "prompt": f"repeat {i} of {run}"} for i in range(jobs // group_size)
    ]
    jobs = len(tasks) * group_size
    user0, sys0 = row.consumer.cpu_split()
    nats0, others0 = side_cpu()
    start = time.perf_counter()
    await TaskProducer(js, topo).submit(row.consumer.agent, tasks, run=run, group_size=group_size)
    while await stored(js, stream) < before + jobs:
        if not row.consumer.alive():
            raise RuntimeError(f"consumer {row.consumer.agent} exited:\n{row.consumer.log_tail()}")
        await asyncio.sleep(0.02)  # polling a count: no event exists for "all stored"
    elapsed = time.perf_counter() - start
    user1, sys1 = row.consumer.cpu_split()
    nats1, others1 = side_cpu()
    cpu = user1 + sys1 - user0 - sys0
    if check:
        trajectories = await TrajectoryReader(js, topo).read(run)
        bad = [t for t in trajectories if t.status != "ok"]
        if len(trajectories) != jobs or bad:
            raise RuntimeError(
                f"{row.tree}/{row.case}: {len(trajectories)} trajectories for {jobs} jobs, "
                f"{len(bad)} not ok: {bad[:1]}"
            )
    return Batch(
        rate=jobs / elapsed,
        cpu_us=cpu / jobs * 1e6,
        cpu_share=cpu / elapsed,
        system=(sys1 - sys0) / max(cpu, 1e-9),
        nats_us=(nats1 - nats0) / jobs * 1e6,
        others_us=(others1 - others0) / jobs * 1e6,
    )


async def main(args: argparse.Namespace) -> None:
    consumer_cpus, other_cpus = split_cpus(args.pin)
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    tmp = Path(tempfile.mkdtemp(prefix="agentarium-bench-"))
    logs = tmp / "logs"
    server = NatsServer(store_dir=tmp / "nats").start()
    pin(server.pid, other_cpus)
    fake, fake_url = start_fake(other_cpus)
    SIDE.update(nats=server.pid, fake=fake.pid)
    engine = None
    cases = list(args.cases)
    if args.engine:
        engine = start_child(
            "engine",
            ["engine", "--model", str(ensure_tiny_model()), "--port", "0"],
            logs,
            wait_ready=True,
        )
        pin(engine.proc.pid, other_cpus)
        cases.append("engine")
    trees = {"this": ROOT, **dict(args.tree)}
    nc = await NatsSettings(url=server.url).connect()
    js = nc.jetstream()
    topo = Topology()
    rows: list[Row] = []
    try:
        for case in cases:
            for name, path in trees.items():
                agent = f"{name}-{case}".replace("_", "-")
                await provision(js, topo, agents=(agent,))
                consumer = Consumer(
                    tree=Path(path),
                    agent=agent,
                    spec=CASES[case],
                    llm=engine.url if case == "engine" else fake_url,
                    nats_url=server.url,
                    concurrency=args.concurrency,
                    log_path=logs / f"consumer-{agent}.log",
                    cpus=consumer_cpus,
                    profile_out=Path(args.profile) / f"{name}-{case}.txt" if args.profile else None,
                ).start()
                rows.append(Row(tree=name, case=case, consumer=consumer))
        await wait_registered(js, topo, len(rows), [r.consumer for r in rows])
        for row in rows:  # warm-up: imports, connections, JIT-free but cache-warm
            await one_batch(
                js,
                topo,
                row,
                min(args.jobs, 1000),
                f"w-{row.consumer.agent}",
                True,
                args.group_size,
            )
        for r in range(args.repeats):
            for row in rows:
                run = f"r{r}-{row.consumer.agent}"
                row.batches.append(
                    await one_batch(js, topo, row, args.jobs, run, r == 0, args.group_size)
                )
                print(
                    f"  repeat {r}: {row.tree:<8} {row.case:<9} "
                    f"{row.batches[-1].rate:7.0f} rollouts/s "
                    f"{row.batches[-1].cpu_us:7.0f} us CPU/rollout",
                    flush=True,
                )
        profiles = {}
        if args.profile:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            for row in rows:
                run = f"p-{row.consumer.agent}"
                profiles[(row.tree, row.case)] = await row.consumer.profile(
                    lambda row=row, run=run: one_batch(
                        js, topo, row, args.jobs, run, False, args.group_size
                    )
                )
        peaks = {(row.tree, row.case): row.consumer.memory()["VmHWM"] for row in rows}
    finally:
        await nc.close()
        for row in rows:
            row.consumer.terminate()
        fake.terminate()
        if engine is not None:
            engine.terminate()
        server.stop()

    pinned = f"consumer on CPU {sorted(consumer_cpus)}" if consumer_cpus else "not pinned"
    print(
        f"\n{args.jobs} jobs per batch ({args.jobs // args.group_size} prompts x group "
        f"{args.group_size}), consumer --concurrency {args.concurrency}, {pinned}; "
        f"median (min..max) of {args.repeats} alternated batches"
    )
    print(
        f"  {'tree':<8} {'case':<9} {'rollouts/s':>22} {'CPU us/rollout':>22} "
        f"{'consumer CPU share':>20} {'system':>7} {'peak RSS':>9}  nats-server, fake+bench us"
    )
    for row in rows:
        print(
            f"  {row.tree:<8} {row.case:<9} "
            f"{median_range([b.rate for b in row.batches]):>22} "
            f"{median_range([b.cpu_us for b in row.batches]):>22} "
            f"{median_range([b.cpu_share for b in row.batches], '{:.2f}'):>20} "
            f"{statistics.median(b.system for b in row.batches):7.0%} "
            f"{peaks[(row.tree, row.case)] / 2**20:7.0f} MiB"
            f"  {statistics.median(b.nats_us for b in row.batches):5.0f}, "
            f"{statistics.median(b.others_us for b in row.batches):.0f}"
        )
    if len(trees) > 1:
        base = next(iter(trees))
        for case in cases:
            this = next(r for r in rows if r.tree == base and r.case == case)
            for row in rows:
                if row.case == case and row is not this:
                    rate = statistics.median(b.rate for b in this.batches) / statistics.median(
                        b.rate for b in row.batches
                    )
                    cpu = statistics.median(b.cpu_us for b in row.batches) / statistics.median(
                        b.cpu_us for b in this.batches
                    )
                    print(
                        f"  {case}: {base} vs {row.tree}: {rate:.2f}x rollouts/s, "
                        f"{cpu:.2f}x less CPU per rollout"
                    )
    if profiles:
        from profile_summary import summarize

        for (tree, case), (batch, stacks) in profiles.items():
            print(f"\nprofile {tree}/{case} ({batch.cpu_us:.0f} us CPU/rollout while sampled)")
            print(summarize(stacks, batch.cpu_us))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="samples per task (GRPO's G), sharing its prompt; every task's prompt is new "
        "(default 1: every prompt new)",
    )
    parser.add_argument(
        "--cases",
        type=lambda s: [c for c in s.split(",") if c],
        default=["noop", "noop_async", "one_call"],
        help="comma-separated: noop, noop_async, one_call (default all three)",
    )
    parser.add_argument("--engine", action="store_true", help="also the local CPU engine case")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        type=lambda s: tuple(s.split("=", 1)),
        metavar="NAME=PATH",
        help="another checkout to run the consumer from, alternated with this one",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="consumers on the first core, the rest elsewhere (off by default: on a machine "
        "others share too, a pinned consumer waits for its one core)",
    )
    parser.add_argument("--profile", metavar="DIR", help="profile one more batch per consumer")
    asyncio.run(main(parser.parse_args()))
