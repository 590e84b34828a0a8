"""Publishing jobs: the SDK's pipelined publish vs one awaited ``js.publish`` at a time.

N jobs (default 20,000, a small arithmetic task each) go to a nats-server this script starts
on a free port with a temporary file store, three ways, in the same run:

- one ``await js.publish(...)`` at a time: the loop a user writes first;
- ``asyncio.gather`` of ``js.publish`` calls bounded by a semaphore: the usual next step;
- ``TaskProducer.publish_jobs``: the SDK (``--max-in-flight`` acks outstanding).

Every way sends the same msgpack payloads with ``Nats-Msg-Id`` headers, on fresh job ids,
and the TASKS stream is purged between rounds. Prints jobs/s side by side (the median of
``--repeat`` rounds). ``--tracing`` installs an OpenTelemetry SDK provider (spans recorded,
not exported) to show what the SDK's per-job ``publish tasks`` span costs.

    python bench/publish.py [--jobs 20000] [--max-in-flight 512] [--repeat 3] [--tracing]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import structlog

from agentarium.broker import NatsServer, NatsSettings, Topology, provision
from agentarium.producers import TaskProducer, expand_tasks
from agentarium.schemas import Job, encode


def make_jobs(n: int, run: str) -> list[Job]:
    tasks = [
        {"task_id": f"t{i}", "question": f"What is {i} + {2 * i}?", "answer": 3 * i}
        for i in range(n)
    ]
    return expand_tasks("bench", tasks, run=run)[1]


async def sequential(js, topology: Topology, jobs: list[Job], _: int) -> None:
    for job in jobs:
        await js.publish(
            topology.tasks_subject(job.agent), encode(job), headers={"Nats-Msg-Id": job.job_id}
        )


async def gathered(js, topology: Topology, jobs: list[Job], limit: int) -> None:
    slots = asyncio.Semaphore(limit)

    async def one(job: Job) -> None:
        async with slots:
            await js.publish(
                topology.tasks_subject(job.agent), encode(job), headers={"Nats-Msg-Id": job.job_id}
            )

    await asyncio.gather(*(one(job) for job in jobs))


async def sdk(js, topology: Topology, jobs: list[Job], limit: int) -> None:
    published, duplicates = await TaskProducer(js, topology, max_in_flight=limit).publish_jobs(jobs)
    assert (published, duplicates) == (len(jobs), 0), (published, duplicates)


METHODS = {
    "one awaited js.publish at a time": sequential,
    "gather + Semaphore(N) js.publish": gathered,
    "TaskProducer.publish_jobs (SDK)": sdk,
}


async def main(args: argparse.Namespace) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if args.tracing:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())
    with tempfile.TemporaryDirectory(prefix="agentarium-bench-") as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats").start()
        try:
            version = subprocess.run(
                [server.binary, "--version"], capture_output=True, text=True
            ).stdout.strip()
            nc = await NatsSettings(url=server.url).connect(name="bench-publish")
            js = nc.jetstream()
            topology = Topology()
            await provision(js, topology)
            rates: dict[str, list[float]] = {name: [] for name in METHODS}
            size = len(encode(make_jobs(1, "probe")[0]))
            print(
                f"{args.jobs} jobs of ~{size} bytes, Nats-Msg-Id dedup, file storage, {version}, "
                f"N = {args.max_in_flight}, tracing {'on' if args.tracing else 'off'}, median of {args.repeat}"
            )
            for round_ in range(args.repeat):
                for name, method in METHODS.items():
                    jobs = make_jobs(args.jobs, f"r{round_}-{method.__name__}")
                    await js.purge_stream(topology.tasks_stream)
                    started = time.perf_counter()
                    await method(js, topology, jobs, args.max_in_flight)
                    elapsed = time.perf_counter() - started
                    stored = (await js.stream_info(topology.tasks_stream)).state.messages
                    assert stored == args.jobs, f"{name}: {stored} stored of {args.jobs}"
                    rates[name].append(args.jobs / elapsed)
            await nc.close()
        finally:
            server.stop()
    base = statistics.median(rates["one awaited js.publish at a time"])
    print(f"{'method':<36} {'jobs/s':>9} {'seconds':>8} {'speed-up':>9}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:<36} {rate:>9,.0f} {args.jobs / rate:>8.2f} {rate / base:>8.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per round (default 20000)")
    parser.add_argument(
        "--max-in-flight", type=int, default=512, help="outstanding acks for the concurrent ways"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds; the median is printed (default 3)"
    )
    parser.add_argument(
        "--tracing", action="store_true", help="record a span per job (SDK provider, no exporter)"
    )
    asyncio.run(main(parser.parse_args()))
