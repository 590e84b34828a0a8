"""Shell sessions started per second through `agentarium env serve shell`, one code tree beside another.

The environment benchmark for the sandbox's cost: a session start is a reset (the sandbox
opened: a uid, a cgroup and bwrap's namespaces in mode namespaces, a folder in mode uid; then
the task's init script run in it), so starts/s is where the sandbox shows. Each run: one
`agentarium env serve shell --capacity N` worker from a code tree (``--tree LABEL=DIR``, its
``PYTHONPATH`` and working directory; the client, `EnvClient`, is this tree's: the wire is the
same), N sessions of a shipped task (``count-lines``: an init script) opened at once, then each
runs one command (``wc -l < notes.txt``) and closes. Trees alternate within every repeat
(rotating which goes first), one local nats-server for all.

Reported per tree, median (min..max) over repeats: starts/s (N over first start sent to last
answered), start p50/p99, step p50, closes/s, and the worker's sandbox mode.

    PYTHONPATH=. .venv/bin/python bench/shell_sessions.py --tree before=/tmp/before --tree after=. \\
        --sessions 32 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentarium.broker import NatsServer, NatsSettings, Topology  # noqa: E402
from agentarium.environments.stats import percentile  # noqa: E402

TASK = {"index": "count-lines"}
COMMAND = "wc -l < notes.txt"


def step(command: str) -> dict:
    arguments = json.dumps({"command": command})
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


async def serve(tree: Path, url: str, n: int, log: Path) -> asyncio.subprocess.Process:
    env = dict(os.environ, PYTHONPATH=str(tree), AGENTARIUM_LOG_FORMAT="json", OMP_NUM_THREADS="1")
    with open(log, "ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentarium", "env", "serve", "shell", "--nats-url", url,
            "--capacity", str(n), "--idle-timeout", "900",
            stdout=asyncio.subprocess.PIPE, stderr=err, env=env, cwd=tree,
        )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
    if "serving" not in line:
        raise RuntimeError(f"the worker of {tree} did not start: {line!r} (log {log})")
    return proc


async def one_run(tree: Path, url: str, n: int, log: Path) -> dict:
    from agentarium.consumers import EnvClient

    worker = await serve(tree, url, n, log)
    nc = await NatsSettings(url=url).connect(name="bench-shell-sessions")
    try:
        envs = EnvClient(nc, Topology(), start_timeout_s=120, step_timeout_s=120)
        start_ms: list[float] = []

        async def start_one():
            began = time.perf_counter()
            session = await envs.start("shell", TASK)
            start_ms.append((time.perf_counter() - began) * 1000)
            return session

        first = time.perf_counter()
        sessions = await asyncio.gather(*(start_one() for _ in range(n)))
        starts_s = time.perf_counter() - first
        mode = sessions[0].observation.info["sandbox"]["mode"]
        step_ms: list[float] = []

        async def step_one(session) -> None:
            began = time.perf_counter()
            result = await session.step(step(COMMAND))
            step_ms.append((time.perf_counter() - began) * 1000)
            assert result.messages[0]["content"].endswith("[exit code 0]"), result.messages

        await asyncio.gather(*(step_one(s) for s in sessions))
        began = time.perf_counter()
        await asyncio.gather(*(s.close() for s in sessions))
        closes_s = time.perf_counter() - began
    finally:
        await nc.close()
        worker.terminate()
        await worker.wait()
    return {
        "mode": mode,
        "starts_per_s": n / starts_s,
        "start_p50_ms": percentile(sorted(start_ms), 50),
        "start_p99_ms": percentile(sorted(start_ms), 99),
        "step_p50_ms": percentile(sorted(step_ms), 50),
        "closes_per_s": n / closes_s,
    }


ROWS = (
    ("starts/s", "starts_per_s", ",.1f"),
    ("start p50 ms", "start_p50_ms", ",.0f"),
    ("start p99 ms", "start_p99_ms", ",.0f"),
    ("step p50 ms", "step_p50_ms", ",.0f"),
    ("closes/s", "closes_per_s", ",.1f"),
)


async def main(opts: argparse.Namespace) -> None:
    trees = []
    for item in opts.tree:
        label, _, where = item.partition("=")
        trees.append((label, Path(where).resolve()))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-shell-sessions-"))
    server = NatsServer(store_dir=log_dir / "nats").start()
    results: dict[str, list[dict]] = {label: [] for label, _ in trees}
    try:
        for r in range(opts.repeats):
            order = trees[r % len(trees) :] + trees[: r % len(trees)]
            for label, tree in order:
                run = await one_run(tree, server.url, opts.sessions, log_dir / f"{label}.log")
                results[label].append(run)
                print(json.dumps({"repeat": r, "tree": label, **run}), flush=True)
    finally:
        server.stop()
    labels = [label for label, _ in trees]
    print(f"\n{opts.sessions} sessions at once, {opts.repeats} repeats, trees alternated; "
          f"logs {log_dir}")  # fmt: skip
    print("\n| | " + " | ".join(f"{x} (mode {results[x][0]['mode']})" for x in labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for name, key, fmt in ROWS:
        cells = []
        for label in labels:
            values = [run[key] for run in results[label]]
            med = statistics.median(values)
            cells.append(f"{med:{fmt}} ({min(values):{fmt}}..{max(values):{fmt}})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        action="append",
        metavar="LABEL=DIR",
        help="a code tree to serve the worker from (repeatable; default: this one)",
    )
    parser.add_argument("--sessions", type=int, default=32, help="opened at once, per run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="", help="write every run's figures here")
    args = parser.parse_args()
    args.tree = args.tree or [f"this={ROOT}"]
    asyncio.run(main(args))
