"""``agentarium demo``: the whole pipeline on one machine, on embedded defaults.

A local nats-server (JetStream store under --out), the local CPU engine with the tiny
model, rollout consumers running the toy agent; the task file is published as GRPO
groups and progress is shown until every trajectory is stored. The trainer joins here
(the ``--train`` seam) once it exists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from broker import NatsServer, NatsSettings, Topology, provision
from broker.telemetry import setup_logging
from producers import TaskProducer, TrajectoryReader

from .processes import start_child
from .tiny import ensure_tiny_model

DEFAULT_TASKS = Path(__file__).resolve().parent.parent / "examples" / "toy_tasks.jsonl"


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _read_tasks(path: Path) -> list[dict]:
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from None
    return tasks


async def _publish_and_watch(args: argparse.Namespace, url: str, out: Path) -> dict:
    settings = NatsSettings(url=url)
    nc = await settings.connect(name="agentarium-demo")
    js = nc.jetstream()
    topo = Topology()
    await provision(js, topo, agents=(args.agent_name,))
    tasks = _read_tasks(Path(args.tasks))
    producer = TaskProducer(js, topo)
    started = time.monotonic()
    result = await producer.submit(args.agent_name, tasks, run=args.run, group_size=args.group_size)
    total = len(result.job_ids)
    print(
        f"published run={result.run} batch={result.batch_id} jobs={total} "
        f"({len(tasks)} tasks x group size {args.group_size})",
        flush=True,
    )
    reader = TrajectoryReader(js, topo)
    wanted = set(result.job_ids)
    seen: dict[str, object] = {}
    tty = sys.stdout.isatty()
    last_print = 0.0
    async for traj in reader.follow(args.run, args.agent_name):
        if traj.job_id in wanted and traj.job_id not in seen:
            seen[traj.job_id] = traj
            now = time.monotonic()
            if tty or now - last_print > 2 or len(seen) == total:
                last_print = now
                ok = [t for t in seen.values() if t.status == "ok"]
                mean = sum(t.reward for t in ok) / len(ok) if ok else 0.0
                rate = len(seen) / max(now - started, 1e-9)
                line = (
                    f"{_bar(len(seen), total)} {len(seen)}/{total} trajectories  ok={len(ok)} "
                    f"reward_mean={mean:.3f}  {rate:.1f} rollouts/s"
                )
                print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
        if len(seen) == total:
            break
    if tty:
        print()
    elapsed = time.monotonic() - started
    with open(out / "trajectories.jsonl", "w") as f:
        for traj in seen.values():
            f.write(json.dumps(traj.to_wire(binary=False)) + "\n")
    await nc.close()
    ok = [t for t in seen.values() if t.status == "ok"]
    return {
        "trajectories": len(seen),
        "ok": len(ok),
        "seconds": round(elapsed, 2),
        "rollouts_per_s": round(len(seen) / elapsed, 2),
        "reward_mean": round(sum(t.reward for t in ok) / len(ok), 4) if ok else None,
        "groups": len({t.group_id for t in seen.values()}),
    }


def cmd_demo(args: argparse.Namespace) -> int:
    setup_logging("warning", json=True)  # the demo prints its own progress; children log to files
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    model_dir = ensure_tiny_model()
    print(f"tiny model: {model_dir}")
    logs.mkdir(exist_ok=True)
    server = NatsServer(store_dir=out / "nats", log_file=logs / "nats-server.log")
    server.start()
    print(f"nats-server (JetStream) at {server.url}, store {out / 'nats'}")
    children = []
    try:
        engine = start_child(
            "engine", ["engine", "--model", str(model_dir), "--port", "0"], logs, wait_ready=True
        )
        children.append(engine)
        print(f"local engine at {engine.url}")
        for i in range(args.consumers):
            children.append(
                start_child(
                    f"consumer-{i}",
                    [
                        "consumer",
                        "--agent",
                        f"{args.agent_name}={args.agent}",
                        "--llm",
                        engine.url,
                        "--model",
                        str(model_dir),
                        "--concurrency",
                        str(args.concurrency),
                        "--nats-url",
                        server.url,
                    ],
                    logs,
                )
            )
        print(f"{args.consumers} consumer(s) running {args.agent}; logs in {logs}")
        summary = asyncio.run(_publish_and_watch(args, server.url, out))
    finally:
        for child in reversed(children):
            child.terminate()
        server.stop()
    print(json.dumps(summary))
    print(f"trajectories written to {out / 'trajectories.jsonl'}")
    return 0 if summary["trajectories"] else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole pipeline locally on the CPU (embedded broker, engine, consumers)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        default="./agentarium-demo",
        help="output directory: broker store, logs, trajectories (default %(default)s)",
    )
    p.add_argument(
        "--tasks",
        default=str(DEFAULT_TASKS),
        help="task file, one JSON object per line (default: the toy tasks)",
    )
    p.add_argument(
        "--agent", default="examples.toy:rollout", help="agent function (default %(default)s)"
    )
    p.add_argument(
        "--agent-name", default="toy", help="agent name on the wire (default %(default)s)"
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=8,
        help="samples per task, one GRPO group (default %(default)s)",
    )
    p.add_argument(
        "--consumers", type=int, default=1, help="consumer processes (default %(default)s)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="rollouts at once per consumer (default %(default)s)",
    )
    p.add_argument(
        "--run", default=f"demo-{int(time.time())}", help="run id (default: demo-<unix time>)"
    )
    p.set_defaults(func=cmd_demo)
