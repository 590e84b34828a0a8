"""The asynchronous speed-up: the same GRPO training, fully asynchronous and synchronous.

Both modes train the tiny model on the demo's task (repeat the digit) through the real pipeline,
each run on its own fresh stack of processes: nats-server, the local engine, one consumer
(``--concurrency 1024``, so the rollouts' delays and not the consumer are the bottleneck), the
weight syncer and the trainer (``--torch-threads 1``, no checkpoint directory: groups are acked
right after their step). Every rollout is ``agentarium.examples.toy:delayed_rollout``: one LLM call, then a
lognormal wait (median 0.5 s, sigma 1.0: p99 about 10x the median) after the reply, the long
tail of agentic rollouts. Same steps, groups x group size, seeds, task stream and settings in
both modes (the demo's, but lr 2e-3, twice the demo's, so the reward leaves the floor within
100 steps); both train the same number of trajectories (steps x groups x group size).

- **async**: the trainer with ``--max-staleness 2``; the producer keeps (ahead + 1) x groups
  released but not yet consumed by the trainer (trained, or dropped as too stale: the count of
  trajectories its consumer acked), AReaL's bound on how far generation runs ahead of training,
  with ``ahead`` = the max staleness by default. Rollouts too stale when their group completes
  are dropped; the async run generates more rollouts than it trains, and the bench says how many.
- **sync**: the trainer with ``--sync-rollouts``; the producer releases batch k + 1 only once the
  engine serves version k (``inference.wait_served``), and the trainer waits for the same before it
  takes the next batch: generate a whole batch with the current weights, train, publish, wait
  until the engines serve the new version, repeat.

Wall time runs from the first release (every process ready: readiness probes) to the trainer's
last metrics row (``time``; the bench sees it live on ``<p>.metrics.<run>`` and then stops
every process). Runs alternate (async, sync, then sync, async, ...). Printed: each run's wall
time, trained and generated rollouts, drops, final reward (mean reward over the last
``--final-window`` steps); then per mode the median and range, the ratio of the medians, each
pair's ratio and the final rewards' gap.

    PYTHONPATH=. .venv/bin/python bench/async_vs_sync.py --steps 100 --repeats 1
    PYTHONPATH=. .venv/bin/python bench/async_vs_sync.py --steps 5   # a quick estimate
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentarium.broker import (  # noqa: E402
    NatsServer,
    NatsSettings,
    Topology,
    cancel_and_wait,
    count_messages,
    free_port,
    provision,
    setup_logging,
    wait_served,
)
from agentarium.demo.processes import Child, start_child  # noqa: E402
from agentarium.demo.run import DemoConfig, trainer_argv  # noqa: E402
from agentarium.demo.tasks import digit_tasks  # noqa: E402
from agentarium.producers import RunSession  # noqa: E402
from agentarium.tiny import ensure_tiny_model  # noqa: E402
from agentarium.trainer import read_metrics  # noqa: E402

AGENT = "toy"
MODES = ("async", "sync")


@dataclass
class RunResult:
    mode: str
    repeat: int
    steps: int
    wall_s: float
    trained: int  # trajectories trained
    generated: int  # trajectories stored (every rollout that finished)
    released_groups: int
    dropped_stale: int  # trajectories
    staleness_mean: float  # over the trained trajectories' steps
    final_reward: float
    first_reward: float
    curve: list[float]  # mean reward of each 10 steps


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (default 1)")
    p.add_argument("--groups-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--delay-median", type=float, default=0.5, help="seconds (default 0.5)")
    p.add_argument("--delay-sigma", type=float, default=1.0, help="lognormal shape (default 1.0)")
    p.add_argument("--max-staleness", type=int, default=2, help="async trainer (default 2)")
    p.add_argument(
        "--ahead",
        type=int,
        default=None,
        help="async: batches released beyond the one being trained (default: --max-staleness)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=2e-3,
        help="twice the demo's, so the reward leaves the floor within 100 steps (default 2e-3)",
    )
    p.add_argument("--entropy-coef", type=float, default=0.02, help="the demo's (default 0.02)")
    p.add_argument("--concurrency", type=int, default=1024, help="consumer (default 1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--final-window", type=int, default=10, help="steps averaged (default 10)")
    p.add_argument("--modes", default="async,sync", help="which modes, in the first pair's order")
    p.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write every run's figures to this file")
    args = p.parse_args()
    if args.ahead is None:
        args.ahead = args.max_staleness
    args.modes = tuple(m for m in args.modes.split(",") if m)
    if not args.modes or set(args.modes) - set(MODES):
        p.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    return args


async def wait_ready(port: int, child: Child, timeout_s: float = 180.0) -> None:
    """Until the process's /readyz answers 200 (its service is connected and running)."""
    url = f"http://127.0.0.1:{port}/readyz"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(
                f"{child.name} exited ({child.proc.returncode}); see {child.log_path}"
            )
        try:
            with await asyncio.to_thread(urllib.request.urlopen, url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        await asyncio.sleep(0.2)  # a probe poll: readiness has no event to await
    raise RuntimeError(f"{child.name} not ready within {timeout_s}s; see {child.log_path}")


class Tasks:
    """The task stream, identical in both modes: digits from one seed, the delay's parameters
    in every task (the agent draws the delay)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.released = 0  # groups

    def take(self, groups: int) -> list[dict]:
        tasks = digit_tasks(self.rng, groups, f"g{self.released}")
        for task in tasks:
            task["delay_median_s"] = self.args.delay_median
            task["delay_sigma"] = self.args.delay_sigma
        self.released += groups
        return tasks


async def feed_sync(session: RunSession, args: argparse.Namespace, run: str, tasks: Tasks) -> None:
    """Batch k + 1 only once the engine serves version k (the weights trained on batch k)."""
    assert session.producer is not None
    for k in range(args.steps):
        await wait_served(session.js, session.topology, run, k)
        await session.producer.submit(
            AGENT, tasks.take(args.groups_per_step), run=run, group_size=args.group_size
        )


async def feed_async(session: RunSession, args: argparse.Namespace, run: str, tasks: Tasks) -> None:
    """Keep (ahead + 1) x groups per step released and not yet consumed by the trainer."""
    assert session.producer is not None
    window = (args.ahead + 1) * args.groups_per_step
    stream = session.topology.trajectories_stream
    durable = session.topology.trainer_consumer(run, AGENT)
    while True:
        info = await session.js.consumer_info(stream, durable)
        consumed = (info.delivered.consumer_seq - info.num_ack_pending) // args.group_size
        room = window - (tasks.released - consumed)
        if room > 0:
            await session.producer.submit(
                AGENT, tasks.take(room), run=run, group_size=args.group_size
            )
        await asyncio.sleep(0.05)  # acks are not events a client can await: poll the consumer


async def one_run(args: argparse.Namespace, mode: str, repeat: int, base: Path) -> RunResult:
    out = base / f"{mode}-{repeat}"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run = f"{mode}{repeat}"
    model = str(ensure_tiny_model())
    server = NatsServer(store_dir=out / "nats", log_file=logs / "nats-server.log").start()
    nats = ["--nats-url", server.url]
    children: list[Child] = []
    try:
        nc = await NatsSettings(url=server.url).connect(name="bench-async-vs-sync")
        await provision(nc.jetstream(), Topology(), agents=(AGENT,))
        await nc.close()
        engine = start_child(
            "engine",
            ["engine", "--model", model, "--port", "0", "--max-batch", "256"],
            logs,
            wait_ready=True,
        )
        children.append(engine)
        ports = {name: free_port() for name in ("consumer", "sync", "trainer")}
        consumer = start_child(
            "consumer",
            [
                "consumer",
                "--agent",
                f"{AGENT}=agentarium.examples.toy:delayed_rollout",
                "--llm",
                engine.url,
                "--model",
                model,
                "--concurrency",
                str(args.concurrency),
                "--drain-grace",
                "1",
                "--metrics-port",
                str(ports["consumer"]),
                *nats,
            ],
            logs,
        )
        children.append(consumer)
        sync = start_child(
            "sync",
            [
                "sync",
                "--run",
                run,
                "--engine",
                engine.url,
                "--weights-dir",
                str(out / "weights"),
                "--metrics-port",
                str(ports["sync"]),
                *nats,
            ],
            logs,
        )
        children.append(sync)
        metrics = out / "metrics.csv"
        demo = DemoConfig(  # the demo's trainer, with this run's settings
            run=run,
            agent_name=AGENT,
            steps=args.steps,
            group_size=args.group_size,
            groups_per_step=args.groups_per_step,
            lr=args.lr,
            entropy_coef=args.entropy_coef,
            max_staleness=args.max_staleness,
            sync_rollouts=mode == "sync",
            seed=args.seed,
        )
        argv = trainer_argv(demo, Path(model), out, server.url, checkpoints=False)
        trainer = start_child("trainer", [*argv, "--metrics-port", str(ports["trainer"])], logs)
        children.append(trainer)
        for child in (consumer, sync, trainer):
            await wait_ready(ports[child.name], child)
        session = await RunSession(NatsSettings(url=server.url), run, name="bench-feed").start()
        last_row = asyncio.Event()  # the trainer's row of the last step, on <p>.metrics.<run>

        async def on_row(msg) -> None:
            if int(json.loads(msg.data)["step"]) >= args.steps:
                last_row.set()

        rows_sub = await session.nc.subscribe(session.topology.metrics_subject(run), cb=on_row)
        tasks = Tasks(args)
        started = time.time()
        feed = (
            feed_sync(session, args, run, tasks)
            if mode == "sync"
            else feed_async(session, args, run, tasks)
        )
        feeding = asyncio.create_task(feed)
        try:
            # The run ends with the last step's row; the trainer is then stopped like the
            # other processes (its own exit is not waited for).
            deadline = time.monotonic() + 60 * args.steps + 120  # a minute a step: stalled
            while not last_row.is_set():
                if trainer.proc.poll() is not None:
                    raise RuntimeError(
                        f"trainer exited {trainer.proc.returncode}; see {trainer.log_path}"
                    )
                if feeding.done() and feeding.exception() is not None:
                    raise RuntimeError("feeding failed") from feeding.exception()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no step {args.steps} within the time allowed; see {logs}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(last_row.wait(), 1.0)
            generated = await count_messages(
                session.js,
                session.topology.trajectories_stream,
                session.topology.trajectories_filter(run),
            )
        finally:
            await cancel_and_wait([feeding])
            await rows_sub.unsubscribe()
            await session.close()
            trainer.terminate(timeout_s=15)
        rows = read_metrics(metrics)
        if len(rows) != args.steps:
            raise RuntimeError(f"{len(rows)} metrics rows for {args.steps} steps in {metrics}")
    finally:
        for child in reversed(children):
            child.terminate(timeout_s=15)
        server.stop()
    window = max(1, min(args.final_window, args.steps // 2))
    rewards = [float(r["reward_mean_received"]) for r in rows if r["reward_mean_received"]]
    trained = sum(int(r.get(f"trajectories/{AGENT}") or 0) for r in rows)
    staleness = [float(r["staleness_mean"]) for r in rows]
    return RunResult(
        mode=mode,
        repeat=repeat,
        steps=len(rows),
        wall_s=float(rows[-1]["time"]) - started,
        trained=trained,
        generated=generated,
        released_groups=tasks.released,
        dropped_stale=int(rows[-1]["dropped_stale"]),
        staleness_mean=statistics.fmean(staleness),
        final_reward=statistics.fmean(rewards[-window:]),
        first_reward=statistics.fmean(rewards[:window]),
        curve=[round(statistics.fmean(rewards[i : i + 10]), 3) for i in range(0, len(rewards), 10)],
    )


def span(values: list[float], fmt: str = "{:.1f}") -> str:
    median = fmt.format(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def summarise(args: argparse.Namespace, results: list[RunResult]) -> None:
    window = max(1, min(args.final_window, args.steps // 2))
    print()
    print(
        f"{args.steps} steps x {args.groups_per_step} groups x {args.group_size}, delay lognormal "
        f"median {args.delay_median:g} s sigma {args.delay_sigma:g}, {len(results)} runs; "
        f"median (min..max)"
    )
    by_mode = {m: [r for r in results if r.mode == m] for m in args.modes}
    for mode, runs in by_mode.items():
        if not runs:
            continue
        print(
            f"  {mode:5}  wall {span([r.wall_s for r in runs])} s  "
            f"trained {span([float(r.trained) for r in runs], '{:.0f}')}  "
            f"generated {span([float(r.generated) for r in runs], '{:.0f}')}  "
            f"dropped stale {span([float(r.dropped_stale) for r in runs], '{:.0f}')}  "
            f"staleness {span([r.staleness_mean for r in runs], '{:.2f}')}  "
            f"reward first {window} {span([r.first_reward for r in runs], '{:.2f}')} -> "
            f"last {window} {span([r.final_reward for r in runs], '{:.2f}')}"
        )
    if not all(by_mode.get(m) for m in MODES):
        return
    walls = {m: statistics.median(r.wall_s for r in by_mode[m]) for m in MODES}
    ratio = walls["sync"] / walls["async"]
    pairs = [s.wall_s / a.wall_s for a, s in zip(by_mode["async"], by_mode["sync"], strict=False)]
    gaps = [
        a.final_reward - s.final_reward
        for a, s in zip(by_mode["async"], by_mode["sync"], strict=False)
    ]
    finals = {m: statistics.median(r.final_reward for r in by_mode[m]) for m in MODES}
    print(
        f"  speed-up (sync / async wall time): {ratio:.2f}x of the medians; per pair "
        f"{', '.join(f'{p:.2f}' for p in pairs)} (goal >= 2.5x)"
    )
    print(
        f"  final reward, async - sync: {finals['async'] - finals['sync']:+.3f} of the medians; "
        f"per pair {', '.join(f'{g:+.3f}' for g in gaps)} (goal within 0.1)"
    )


def main() -> int:
    args = parse_args()
    setup_logging("warning", json=True)
    base = Path(args.out or tempfile.mkdtemp(prefix="async-vs-sync-")).resolve()
    print(f"runs under {base}", flush=True)
    results: list[RunResult] = []
    for repeat in range(args.repeats):
        # alternate the order: async, sync, then sync, async, ...
        order = args.modes if repeat % 2 == 0 else tuple(reversed(args.modes))
        for mode in order:
            result = asyncio.run(one_run(args, mode, repeat, base))
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    summarise(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
