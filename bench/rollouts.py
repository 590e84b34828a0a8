"""End-to-end rollouts/s: producer -> JetStream -> consumer process -> backend -> trajectory.

Same run, same machine, side by side:
  - agent `examples.toy:one_call` (one LLM call, 1 token) against the local CPU engine (tiny model)
  - the same agent against an instant fake backend with SGLang's response shape
  - agent `examples.toy:noop` (no LLM call): the pipeline's own ceiling
and the peak RSS of a consumer process at --concurrency 1000 with 1,000 rollouts in flight.

    .venv/bin/python bench/rollouts.py [--jobs 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentarium.demo.processes import child_env, start_child  # noqa: E402
from agentarium.tiny import ensure_tiny_model  # noqa: E402
from broker import NatsServer, NatsSettings, Topology, provision  # noqa: E402
from broker.registry import live_workers, remove_worker  # noqa: E402
from broker.status import count_messages  # noqa: E402
from producers import TaskProducer  # noqa: E402


def start_fake(log_dir: Path):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "fake_fleet.py")],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    line = proc.stdout.readline()
    return proc, line.split(" on ", 1)[1].strip()


async def one_run(
    url: str,
    llm: str,
    agent: str,
    jobs: int,
    concurrency: int,
    log_dir: Path,
    run: str,
    extra_task: dict | None = None,
    measure_rss: bool = False,
) -> tuple[float, int]:
    """Jobs/s from the first publish to the last stored trajectory, with the consumer
    already running (its start-up is not counted)."""
    nc = await NatsSettings(url=url).connect()
    js = nc.jetstream()
    topo = Topology()
    await provision(js, topo, agents=("bench",))
    consumer = start_child(
        f"consumer-{run}",
        [
            "consumer",
            "--agent",
            f"bench={agent}",
            "--llm",
            llm,
            "--nats-url",
            url,
            "--concurrency",
            str(concurrency),
        ],
        log_dir,
        env=child_env(PYTHONPATH=f"{ROOT / 'tests'}:{ROOT}"),
    )
    while not await live_workers(js, topo):
        await asyncio.sleep(0.05)  # the worker registers itself once it is pulling
    tasks = [{"task_id": f"t{i}", "prompt": "repeat 1", **(extra_task or {})} for i in range(jobs)]
    start = time.perf_counter()
    await TaskProducer(js, topo).submit("bench", tasks, run=run)
    peak = 0
    while True:
        stored = await count_messages(js, topo.trajectories_stream, topo.trajectories_filter(run))
        if measure_rss:
            for line in Path(f"/proc/{consumer.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
        if stored >= jobs:
            break
        await asyncio.sleep(0.05)  # polling a count: cheap, and no event exists for "all stored"
    elapsed = time.perf_counter() - start
    consumer.terminate()
    await remove_all_workers(js, topo)
    await nc.close()
    return jobs / elapsed, peak


async def remove_all_workers(js, topo) -> None:
    for worker in await live_workers(js, topo):
        await remove_worker(js, topo, worker["worker_id"])


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="agentarium-bench-"))
    logs = tmp / "logs"
    server = NatsServer(store_dir=tmp / "nats").start()
    engine = start_child(
        "engine",
        ["engine", "--model", str(ensure_tiny_model()), "--port", "0"],
        logs,
        wait_ready=True,
    )
    fake, fake_url = start_fake(logs)
    cases = [
        ("one_call, local engine (tiny)", "examples.toy:one_call", engine.url),
        ("one_call, instant fake SGLang", "examples.toy:one_call", fake_url),
        ("noop agent (no LLM call)", "examples.toy:noop", fake_url),
    ]
    results = {}
    try:
        for label, agent, llm in cases:
            rates = []
            for r in range(args.repeats):
                rate, _ = await one_run(
                    server.url,
                    llm,
                    agent,
                    args.jobs,
                    args.concurrency,
                    logs,
                    f"b{len(results)}r{r}",
                )
                rates.append(rate)
            results[label] = rates
        _, peak = await one_run(
            server.url,
            fake_url,
            "agentlib:slow",
            2000,
            1000,
            logs,
            "mem",
            extra_task={"sleep": 2.0},
            measure_rss=True,
        )
    finally:
        fake.terminate()
        engine.terminate()
        server.stop()
    print(
        f"\nrollouts/s end to end, {args.jobs} jobs, consumer --concurrency {args.concurrency}, "
        f"median of {args.repeats} (min..max)"
    )
    for label, rates in results.items():
        print(
            f"  {label:<34} {statistics.median(rates):8.0f}   ({min(rates):.0f}..{max(rates):.0f})"
        )
    print(
        f"\npeak RSS of one consumer process at --concurrency 1000 (1,000 rollouts in flight): "
        f"{peak / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=256)
    asyncio.run(main(parser.parse_args()))
