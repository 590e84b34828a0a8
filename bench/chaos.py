"""Chaos runs, long: every scenario of tests/chaos/ at bench size, one broker (or cluster) of
its own each, then the results table of docs/reliability.md ("Chaos runs").

    .venv/bin/python bench/chaos.py                      # every scenario (about 20 minutes)
    .venv/bin/python bench/chaos.py --only kill-storm fleet-down
    .venv/bin/python bench/chaos.py --list

Each row counts jobs published, trajectories stored, lost (neither stored nor dead-lettered),
duplicate trajectories, rollouts run more than once (agent executions, from the counted agent's
own log) against what the faults caught in flight, trajectories stored as error, dead letters,
the longest stall and the recovery after each fault (tests/chaos/chaoslib.py defines them).
``disk-full`` needs root (it mounts a tmpfs) and is skipped otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "chaos")]

import scenarios  # noqa: E402
from chaoslib import Row  # noqa: E402

from agentarium.broker import NatsServer  # noqa: E402

Scenario = Callable[[Path, str], Awaitable[list[Row]]]


def _stores(directory: str, names: list[str]) -> list[str]:
    """What --keep leaves behind: the brokers' stores (their logs are kept)."""
    return [n for n in names if n == "jetstream"]


def on_broker(run: Callable[..., Awaitable[Row]], **params) -> Scenario:
    """A scenario on a single-node broker of its own (file store in the run's directory)."""

    async def scenario(workdir: Path, command: str) -> list[Row]:
        server = NatsServer(store_dir=workdir / "nats").start()
        try:
            return [await run(server, workdir, command=command, **params)]
        finally:
            server.stop()

    return scenario


def on_cluster(fault: str, **params) -> Scenario:
    async def scenario(workdir: Path, command: str) -> list[Row]:
        return await scenarios.cluster_faults(
            workdir, faults=(fault,), commands={fault: command}, **params
        )

    return scenario


def on_tmpfs(**params) -> Scenario:
    async def scenario(workdir: Path, command: str) -> list[Row]:
        return [await scenarios.disk_full(workdir, command=command, **params)]

    return scenario


SCENARIOS: dict[str, Scenario] = {
    "kill-storm": on_broker(
        scenarios.consumer_kill_storm, jobs=6000, kills=12, every_s=3.0, sleep_s=0.3
    ),
    "broker-restart": on_broker(scenarios.broker_restart, jobs=3000, down_s=5.0),
    "broker-pause": on_broker(scenarios.broker_pause, jobs=3000, pause_s=15.0),
    "leader-kill": on_cluster("leader kill", jobs=2000, down_s=15.0),
    "follower-kill": on_cluster("follower kill", jobs=2000, down_s=15.0),
    "partition": on_cluster("partition", jobs=2000, down_s=30.0),
    "fleet-down": on_broker(scenarios.fleet_down, jobs=3000, outage_s=30.0),
    "fleet-hung": on_broker(scenarios.fleet_down, jobs=3000, outage_s=30.0, hang=True),
    "trainer-storm": on_broker(scenarios.trainer_kill_storm, groups=48, kills=5),
    "slow-rollouts": on_broker(scenarios.slow_rollouts, jobs=64, sleep_s=10.0),
    "crash-recovery": on_broker(scenarios.crash_recovery, held=1000, slow=16, rollout_s=300.0),
    "store-full": on_broker(scenarios.store_full, jobs=2000, room=200, full_s=20.0),
    "disk-full": on_tmpfs(size_mb=8, jobs=3000, full_s=20.0),
}


async def main(names: list[str], out: Path | None, json_out: Path | None, keep: Path | None) -> int:
    rows: list[Row] = []
    failed = []
    for name in names:
        if name == "disk-full" and os.geteuid() != 0:
            print(f"[chaos] {name}: skipped (mounting a tmpfs needs root)", flush=True)
            continue
        command = f".venv/bin/python bench/chaos.py --only {name}"
        with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-", dir=keep) as tmp:
            started = time.monotonic()
            try:
                got = await SCENARIOS[name](Path(tmp), command)
            except Exception as exc:  # noqa: BLE001 - report it and go on with the others
                failed.append(name)
                print(f"[chaos] {name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
                continue
            finally:
                if keep is not None:  # the logs of every process, for a closer look
                    shutil.copytree(tmp, keep / name, dirs_exist_ok=True, ignore=_stores)
        for row in got:
            print(f"{row} ({time.monotonic() - started:.0f} s)", flush=True)
            try:
                row.check()
            except AssertionError as exc:
                failed.append(name)
                print(f"[chaos] {name}: goal missed: {exc}", flush=True)
        rows += got
    table = "\n".join([Row.HEADER, *(row.markdown() for row in rows)])
    print(f"\n{table}")
    if out is not None:
        out.write_text(table + "\n")
    if json_out is not None:
        with json_out.open("a") as f:
            for row in rows:
                f.write(json.dumps({**asdict(row), "at": time.time()}) + "\n")
    if failed:
        print(f"\nfailed or missed a goal: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), metavar="NAME")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    parser.add_argument("--json", type=Path, help="append each row as a JSON line here")
    parser.add_argument("--keep", type=Path, help="keep each run's logs under this directory")
    args = parser.parse_args()
    if args.list:
        print("\n".join(SCENARIOS))
        sys.exit(0)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    sys.exit(asyncio.run(main(args.only or list(SCENARIOS), args.out, args.json, args.keep)))
