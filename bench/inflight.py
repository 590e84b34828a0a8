"""Tens of thousands of rollouts in flight in one consumer process, and 1 vs 2 consumers.

    .venv/bin/python bench/inflight.py [--jobs 50000] [--latency 10] [--scaling-jobs 20000]

1. Throughput R: one consumer, agent ``agentarium.examples.toy:one_call`` (async, one LLM call) against an
   instant fake SGLang (bench/fake_fleet.py): ``--rate-jobs`` jobs, rollouts/s.
2. In flight: one consumer with ``--concurrency`` = ``--jobs``, the same agent against a fake
   that answers each request after ``--latency`` seconds; all jobs published at once. Printed:
   wall time from the first publish to the last stored trajectory against the goal
   1.5 x (latency + jobs / R), trajectories not ok, peak RSS (VmHWM), the most rollouts seen in
   flight at once, the consumer's event-loop lag (p50/p99/max from its
   ``agentarium_event_loop_lag_seconds`` histogram, interpolated as Prometheus'
   histogram_quantile does) and its CPU time.
3. Scaling: the instant backend again, ``--scaling-jobs`` jobs drained by 1 consumer process,
   then by 2 on the same queue (the same agent), alternated ``--repeats`` times: rollouts/s and
   the ratio.

A consumer process holds one socket per LLM request in flight; its HTTP client opens at most
(open-file limit - 512) connections and queues the rest (consumers/backends/http.py), so with
the limit below the job count the latency is paid in waves: printed beside the result.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import Consumer, _child_setup, median_range, stored, wait_registered  # noqa: E402

from agentarium.broker import Limits, NatsServer, NatsSettings, Topology, free_port, provision  # noqa: E402
from agentarium.broker.registry import live_workers  # noqa: E402
from agentarium.demo.processes import child_env  # noqa: E402
from agentarium.producers import TaskProducer, TrajectoryReader  # noqa: E402

AGENT_SPEC = "agentarium.examples.toy:one_call"


def start_fake(latency_s: float, servers: int = 1) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "fake_fleet.py"),
            "--latency",
            str(latency_s),
            "--servers",
            str(servers),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        preexec_fn=lambda: _child_setup(None),
    )
    return proc, proc.stdout.readline().split(" on ", 1)[1].strip()


def scrape(port: int, prefix: str = "agentarium_event_loop_lag_seconds") -> dict[str, float]:
    """The consumer's series starting with ``prefix`` (the lag histogram's cumulative buckets,
    sum and count by default)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def quantile(q: float, histogram: dict[str, float]) -> float:
    """histogram_quantile over cumulative ``_bucket{le=...}`` counts (linear in a bucket)."""
    buckets = sorted(
        (float(k.split('le="', 1)[1].split('"', 1)[0]), v)
        for k, v in histogram.items()
        if "_bucket{" in k
    )
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_le, prev_count = le, count
    return prev_le


async def drain(js, topo, agent: str, jobs: int, run: str, consumers: list[Consumer], watch=None):
    """Publish ``jobs`` one-call jobs, wait until all are stored; returns (seconds, not ok)."""
    stream = topo.trajectories_stream
    before = await stored(js, stream)
    tasks = [{"task_id": f"t{i}", "prompt": f"repeat {i}"} for i in range(jobs)]
    start = time.perf_counter()
    await TaskProducer(js, topo, max_in_flight=4096).submit(agent, tasks, run=run)
    while await stored(js, stream) < before + jobs:
        for consumer in consumers:
            if not consumer.alive():
                raise RuntimeError(f"consumer exited:\n{consumer.log_tail()}")
        if watch is not None:
            await watch()
        await asyncio.sleep(0.05)  # polling a count: no event exists for "all stored"
    elapsed = time.perf_counter() - start
    trajectories = await TrajectoryReader(js, topo).read(run)
    bad = sum(1 for t in trajectories if t.status != "ok")
    return elapsed, bad + (jobs - len(trajectories))


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="agentarium-inflight-"))
    logs = tmp / "logs"
    server = NatsServer(store_dir=tmp / "nats").start()
    instant, instant_url = start_fake(0.0)
    slow, slow_url = start_fake(args.latency, args.servers)
    nc = await NatsSettings(url=server.url).connect()
    js = nc.jetstream()
    topo = Topology()
    # The agent's durable allows every job in flight at once (default 20,000 per agent).
    limits = Limits(max_ack_pending=max(args.jobs, args.scaling_jobs) + 1000)
    consumers: list[Consumer] = []

    def consumer(agent: str, url: str, concurrency: int, extra_args=(), **kw) -> Consumer:
        urls = url.split(",")
        c = Consumer(
            tree=ROOT,
            agent=agent,
            spec=AGENT_SPEC,
            llm=urls[0],
            extra_args=(*(a for u in urls[1:] for a in ("--llm", u)), *extra_args),
            nats_url=server.url,
            concurrency=concurrency,
            log_path=logs / f"{agent}-{len(consumers)}.log",
            **kw,
        ).start()
        consumers.append(c)
        return c

    results: dict[str, object] = {}
    try:
        # 1. throughput R
        await provision(js, topo, limits, agents=("rate", "inflight", "scale"))
        rate_consumer = consumer("rate", instant_url, 256)
        await wait_registered(js, topo, 1, [rate_consumer])
        await drain(js, topo, "rate", min(2000, args.rate_jobs), "rate-warm", [rate_consumer])
        rates = []
        for r in range(args.repeats):
            seconds, bad = await drain(
                js, topo, "rate", args.rate_jobs, f"rate-{r}", [rate_consumer]
            )
            assert bad == 0, f"{bad} rollouts not ok"
            rates.append(args.rate_jobs / seconds)
        rate = statistics.median(rates)
        results["rates"] = rates
        rate_consumer.terminate()
        while await live_workers(js, topo):
            await asyncio.sleep(0.1)  # a stopped worker deletes its registry entry

        # 2. in flight
        metrics_port = free_port()
        inflight = consumer(
            "inflight",
            slow_url,
            args.jobs,
            extra_args=("--metrics-port", str(metrics_port), "--ack-wait", "120"),
        )
        while not any(w["agent"] == "inflight" for w in await live_workers(js, topo)):
            await asyncio.sleep(0.1)  # the registry: no event says "registered"
        lag0 = scrape(metrics_port)
        cpu0 = inflight.cpu()
        peak_in_flight = 0

        last_look = 0.0

        async def watch() -> None:  # the consumer's in-flight gauge, twice a second
            nonlocal peak_in_flight, last_look
            if time.monotonic() - last_look < 0.5:
                return
            last_look = time.monotonic()
            gauge = await asyncio.to_thread(scrape, metrics_port, "agentarium_rollouts_in_flight{")
            peak_in_flight = max([peak_in_flight, *gauge.values()])

        seconds, bad = await drain(js, topo, "inflight", args.jobs, "inflight", [inflight], watch)
        lag1 = scrape(metrics_port)
        lag = {k: lag1[k] - lag0.get(k, 0.0) for k in lag1}
        results["inflight"] = {
            "seconds": seconds,
            "bad": bad,
            "rss": inflight.memory()["VmHWM"],
            "cpu_s": inflight.cpu() - cpu0,
            "peak_in_flight": peak_in_flight,
            "lag": lag,
        }
        inflight.terminate()

        # 3. scaling: 1 vs 2 processes on the same queue
        one, two = [], []
        for r in range(args.repeats):
            for n, out in ((1, one), (2, two)) if r % 2 == 0 else ((2, two), (1, one)):
                group = [consumer("scale", instant_url, 256) for _ in range(n)]
                await wait_registered(js, topo, n, group)
                await drain(js, topo, "scale", 1000, f"scale-warm-{n}-{r}", group)
                seconds, bad = await drain(
                    js, topo, "scale", args.scaling_jobs, f"scale-{n}-{r}", group
                )
                assert bad == 0, f"{bad} rollouts not ok"
                out.append(args.scaling_jobs / seconds)
                for c in group:
                    c.terminate()
                while await live_workers(js, topo):
                    await asyncio.sleep(0.1)  # stopped workers delete their registry entries
        results["scaling"] = (one, two)
    finally:
        await nc.close()
        for c in consumers:
            c.terminate()
        instant.terminate()
        slow.terminate()
        server.stop()

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    res = results["inflight"]
    goal = 1.5 * (args.latency + args.jobs / rate)
    lag = res["lag"]
    print(
        f"\n1. throughput R: one consumer, one-call agent, instant backend, {args.rate_jobs} jobs"
    )
    print(f"   {median_range(results['rates'])} rollouts/s (median (min..max) of {args.repeats})")
    print(
        f"\n2. {args.jobs} rollouts in flight in one consumer process (--concurrency {args.jobs}), "
        f"backend latency {args.latency:g} s ({args.servers} servers)"
    )
    print(
        f"   wall {res['seconds']:.1f} s (goal <= 1.5 x ({args.latency:g} + {args.jobs} / {rate:.0f})"
        f" = {goal:.1f} s: {'met' if res['seconds'] <= goal else 'NOT met'})"
    )
    print(f"   not ok: {res['bad']}; peak RSS {res['rss'] / 2**30:.2f} GiB (goal < 1.5 GiB)")
    print(
        f"   most rollouts in flight at once (its gauge, read twice a second): "
        f"{res['peak_in_flight']:.0f}; "
        f"LLM connections at most {soft - 512} (open-file limit {soft} - 512)"
    )
    print(
        f"   event-loop lag p50 {quantile(0.5, lag) * 1e3:.1f} ms, "
        f"p99 {quantile(0.99, lag) * 1e3:.1f} ms, "
        f"mean {lag['agentarium_event_loop_lag_seconds_sum'] / max(lag['agentarium_event_loop_lag_seconds_count'], 1) * 1e3:.1f} ms "
        f"over {lag['agentarium_event_loop_lag_seconds_count']:.0f} samples"
    )
    print(f"   consumer CPU {res['cpu_s']:.1f} s ({res['cpu_s'] / args.jobs * 1e6:.0f} us/rollout)")
    one, two = results["scaling"]
    print(
        f"\n3. scaling on {os.cpu_count()} cores: {args.scaling_jobs} jobs, instant backend, "
        f"median (min..max) of {args.repeats} alternated"
    )
    print(f"   1 consumer process:  {median_range(one)} rollouts/s")
    print(f"   2 consumer processes: {median_range(two)} rollouts/s")
    print(f"   ratio {statistics.median(two) / statistics.median(one):.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--latency", type=float, default=10.0)
    parser.add_argument("--rate-jobs", type=int, default=10_000)
    parser.add_argument("--scaling-jobs", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--servers",
        type=int,
        default=4,
        help="ports the slow fake listens on, a fleet the consumer balances over (one address "
        "for ~20,000 connections makes the kernel's search for a free local port costly)",
    )
    asyncio.run(main(parser.parse_args()))
