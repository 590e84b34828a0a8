"""10,000 concurrent environment sessions over NATS, beside the same sessions over HTTP.

One run of a side: W worker processes and C client processes on this machine, N sessions of
``bench/light_env.py``'s ``LightEnv`` (open, five steps, close; no I/O), in three phases:

1. every client opens its share of the sessions at once (asyncio, one task per session);
2. a barrier: the driver waits until every client holds all of its sessions, then reads what
   the workers hold and their RSS (so all N sessions are open together, none closed yet);
3. ``go``: every session runs its five steps, then closes and checks its outcome.

  nats  ``agentarium env serve light_env:LightEnv`` x W (``--capacity`` above N/W), one NATS
        connection per process; clients use ``consumers.EnvClient``: NATS spreads the starts
        over the workers with room and routes each session's steps to its worker.
  http  ``bench/light_env.py`` x W: AgentBench's task-worker pattern (aiohttp, sessions in a
        dict, start_sample / interact / cancel, JSON). AgentBench puts a controller in front
        of many workers; here there is none: the client hashes each session id to a worker
        (id mod W) and keeps it there. One aiohttp connection pool per client process.

Reported per side: sessions held at the barrier (the workers' count: ``$SRV.STATS`` for nats,
``/api/worker_status`` for http; and the clients'), starts/s (first start sent to last answered),
steps/s (``go`` to the last step answered; closes interleave), step latency p50/p99 as the
clients saw it (all 5N steps), RSS per worker, sessions lost (a session is kept when it got its
five steps, ``done`` on the fifth, and an outcome of score 1 and 5 steps). The sides alternate
within each repeat (rotating which goes first); printed: median (min..max) over repeats.

    PYTHONPATH=. .venv/bin/python bench/env_sessions.py --sessions 10000 --repeats 1
    PYTHONPATH=. .venv/bin/python bench/env_sessions.py --sessions 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentarium.broker import NatsServer, NatsSettings, Topology, collect_env_status  # noqa: E402
from agentarium.environments.stats import percentile  # noqa: E402

STEPS = 5
ENV_NAME = "light"
SIDES = ("nats", "http")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), str(ROOT), env.get("PYTHONPATH", "")])
    env["AGENTARIUM_LOG_FORMAT"] = "json"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def raise_fd_limit() -> int:
    """HTTP holds a socket per request in flight on both ends: lift the soft limit to the hard."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def memory_kib(pid: int | str = "self") -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def assistant(k: int) -> dict:
    arguments = json.dumps({"text": f"step {k}"})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"c{k}",
                "type": "function",
                "function": {"name": "echo", "arguments": arguments},
            }
        ],
    }


# ---- the client processes ------------------------------------------------------------------------


class NatsSide:
    def __init__(self, args: argparse.Namespace) -> None:
        self.url = args.nats_url
        self.timeout_s = args.request_timeout

    async def open(self) -> None:
        from agentarium.consumers import EnvClient

        self.nc = await NatsSettings(url=self.url).connect(name="bench-env-client")
        timeout = self.timeout_s
        self.envs = EnvClient(self.nc, Topology(), start_timeout_s=timeout, step_timeout_s=timeout)

    async def start(self, i: int) -> Any:
        return await self.envs.start(ENV_NAME, {"index": str(i)})

    async def step(self, session: Any, k: int) -> bool:
        return (await session.step(assistant(k))).done

    async def close(self, session: Any) -> tuple[float, int]:
        outcome = await session.close()
        return outcome.score, outcome.steps

    async def shut(self) -> None:
        await self.nc.close()


class HttpSide:
    def __init__(self, args: argparse.Namespace) -> None:
        self.urls = args.http_urls.split(",")
        self.pool = args.http_pool
        self.timeout_s = args.request_timeout

    async def open(self) -> None:
        import aiohttp

        self.aiohttp = aiohttp
        connector = aiohttp.TCPConnector(limit=self.pool, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        self.http = aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def _post(self, url: str, body: dict) -> dict:
        async with self.http.post(url, json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data}")
            return data

    async def start(self, i: int) -> tuple[str, int]:
        session_id = random.getrandbits(53)
        base = self.urls[session_id % len(self.urls)]  # the session's worker, for all its life
        await self._post(f"{base}/start_sample", {"index": i, "session_id": session_id})
        return base, session_id

    async def step(self, session: tuple[str, int], k: int) -> bool:
        base, session_id = session
        reply = await self._post(
            f"{base}/interact", {"session_id": session_id, "messages": [assistant(k)]}
        )
        return bool(reply["env_out"]["finish"])

    async def close(self, session: tuple[str, int]) -> tuple[float, int]:
        base, session_id = session
        reply = await self._post(f"{base}/cancel", {"session_id": session_id})
        return float(reply["outcome"]["score"]), int(reply["outcome"]["steps"])

    async def shut(self) -> None:
        await self.http.close()


@dataclass
class Tally:
    open_now: int = 0
    most_open: int = 0
    start_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    failures: Counter = field(default_factory=Counter)
    completed: int = 0
    last_start: float = 0.0
    last_step: float = 0.0


async def client_main(args: argparse.Namespace) -> None:
    side = NatsSide(args) if args.client == "nats" else HttpSide(args)
    await side.open()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tally = Tally()

    def emit(**data: Any) -> None:
        print(json.dumps(data), flush=True)

    async def open_one(i: int) -> Any:
        began = time.perf_counter()
        try:
            session = await side.start(i)
        except Exception as exc:  # noqa: BLE001 - counted: a lost session
            tally.failures[f"start: {type(exc).__name__}: {str(exc)[:120]}"] += 1
            return None
        tally.start_ms.append((time.perf_counter() - began) * 1000)
        tally.last_start = time.time()
        tally.open_now += 1
        tally.most_open = max(tally.most_open, tally.open_now)
        return session

    async def run_one(session: Any) -> None:
        try:
            for k in range(1, STEPS + 1):
                began = time.perf_counter()
                done = await side.step(session, k)
                tally.step_ms.append((time.perf_counter() - began) * 1000)
                tally.last_step = time.time()
                if done != (k == STEPS):
                    tally.failures[f"step {k}: done={done}"] += 1
                    return
            score, steps = await side.close(session)
            tally.open_now -= 1
            if (score, steps) != (1.0, STEPS):
                tally.failures[f"outcome: score={score} steps={steps}"] += 1
                return
            tally.completed += 1
        except Exception as exc:  # noqa: BLE001 - counted: a lost session
            tally.failures[f"step: {type(exc).__name__}: {str(exc)[:120]}"] += 1

    emit(ready=True)
    await reader.readline()  # "start"
    first = time.time()
    sessions = await asyncio.gather(*(open_one(args.offset + i) for i in range(args.sessions)))
    emit(held=tally.open_now, most_open=tally.most_open, first=first, last=tally.last_start)
    await reader.readline()  # "go"
    go = time.time()
    await asyncio.gather(*(run_one(s) for s in sessions if s is not None))
    await side.shut()
    emit(
        go=go,
        last_step=tally.last_step,
        completed=tally.completed,
        most_open=tally.most_open,
        failures=dict(tally.failures),
        start_ms=[round(x, 3) for x in tally.start_ms],
        step_ms=[round(x, 3) for x in tally.step_ms],
        memory_kib=memory_kib(),
    )


# ---- the driver ----------------------------------------------------------------------------------


class Proc:
    """A child process whose stdout speaks one JSON object per line (or a ready line)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, args: list[str], log: Path, stdin: bool = False) -> Proc:
        with open(log, "ab") as err:
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=child_env(),
                cwd=ROOT,
                limit=64 * 1024 * 1024,  # the clients' last line carries every latency
            )
        return cls(proc)

    async def line(self, timeout_s: float = 600.0) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not raw:
            raise RuntimeError(f"child {self.proc.pid} exited ({await self.proc.wait()})")
        return raw.decode()

    async def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def start_workers(
    side: str, opts: argparse.Namespace, n: int, log_dir: Path
) -> tuple[list[Proc], list[str]]:
    procs, where = [], []
    capacity = opts.capacity or int(n / opts.workers * 1.1) + 16
    for w in range(opts.workers):
        if side == "nats":
            args = [
                sys.executable, "-m", "agentarium", "env", "serve", "light_env:LightEnv",
                "--nats-url", opts.nats_url, "--capacity", str(capacity),
                "--max-starting", str(opts.max_starting), "--idle-timeout", "900",
            ]  # fmt: skip
        else:
            args = [sys.executable, str(ROOT / "bench" / "light_env.py"), "--concurrency", str(n)]
        procs.append(await Proc.spawn(args, log_dir / f"{side}-worker-{w}.log"))
    for proc in procs:
        line = await proc.line(120)
        where.append(
            line.split(" worker ")[1].split()[0] if side == "nats" else json.loads(line)["serving"]
        )
    return procs, where


async def held_by_workers(side: str, nc: Any, where: list[str]) -> list[int]:
    if side == "nats":
        [status] = [
            s for s in await collect_env_status(nc, Topology(), timeout_s=5) if s.env == ENV_NAME
        ]
        return [w["sessions"] for w in status.workers]
    import aiohttp

    async with aiohttp.ClientSession() as http:
        counts = []
        for base in where:
            async with http.get(f"{base}/worker_status") as resp:
                counts.append((await resp.json())["current"])
        return counts


async def one_run(side: str, opts: argparse.Namespace, n: int, nc: Any, log_dir: Path) -> dict:
    workers, where = await start_workers(side, opts, n, log_dir)
    clients: list[Proc] = []
    try:
        shares = [
            n // opts.clients + (1 if c < n % opts.clients else 0) for c in range(opts.clients)
        ]
        offset = 0
        for c, share in enumerate(shares):
            args = [
                sys.executable, str(Path(__file__).resolve()), "--client", side,
                "--sessions", str(share), "--offset", str(offset), "--nats-url", opts.nats_url,
                "--http-urls", ",".join(where), "--http-pool", str(opts.http_pool),
                "--request-timeout", str(opts.request_timeout),
            ]  # fmt: skip
            offset += share
            clients.append(await Proc.spawn(args, log_dir / f"{side}-client-{c}.log", stdin=True))
        for client in clients:
            assert json.loads(await client.line(120))["ready"]
        for client in clients:
            await client.send("start")
        held = [json.loads(await client.line()) for client in clients]
        # The barrier: every client holds its sessions; nothing is closed before "go".
        worker_held = await held_by_workers(side, nc, where)
        rss_held = [memory_kib(w.proc.pid)["VmRSS"] for w in workers]
        server_kib = (
            memory_kib(opts.server_pid)["VmRSS"] if side == "nats" and opts.server_pid else 0
        )
        for client in clients:
            await client.send("go")
        done = [json.loads(await client.line()) for client in clients]
        worker_peak = [memory_kib(w.proc.pid)["VmHWM"] for w in workers]
        worker_stats = None
        if side == "nats":
            [status] = await collect_env_status(nc, Topology(), timeout_s=5)
            worker_stats = {
                k: getattr(status, k)
                for k in (
                    "starts",
                    "steps",
                    "errors",
                    "rejected",
                    "expired",
                    "step_p50_ms",
                    "step_p99_ms",
                )
            }
    finally:
        for proc in clients + workers:
            await proc.stop()
    first = min(h["first"] for h in held)
    last_start = max(h["last"] for h in held)
    go = min(d["go"] for d in done)
    last_step = max(d["last_step"] for d in done)
    step_ms = sorted(x for d in done for x in d["step_ms"])
    start_ms = sorted(x for d in done for x in d["start_ms"])
    failures: Counter = Counter()
    for d in done:
        failures.update(d["failures"])
    return {
        "side": side,
        "sessions": n,
        "held_clients": sum(h["held"] for h in held),
        "held_workers": sum(worker_held),
        "worker_held": worker_held,
        "starts_per_s": n / max(1e-9, last_start - first),
        "start_p50_ms": percentile(start_ms, 50),
        "start_p99_ms": percentile(start_ms, 99),
        "steps_per_s": len(step_ms) / max(1e-9, last_step - go),
        "step_p50_ms": percentile(step_ms, 50),
        "step_p99_ms": percentile(step_ms, 99),
        "rss_mib": [round(kib / 1024, 1) for kib in rss_held],
        "nats_server_rss_mib": round(server_kib / 1024, 1),
        "peak_rss_mib": [round(kib / 1024, 1) for kib in worker_peak],
        "client_peak_rss_mib": [round(d["memory_kib"]["VmHWM"] / 1024, 1) for d in done],
        "completed": sum(d["completed"] for d in done),
        "lost": n - sum(d["completed"] for d in done),
        "failures": dict(failures),
        "worker_stats": worker_stats,
    }


def summary(rows: list[dict]) -> None:
    def cell(values: list[float], fmt: str) -> str:
        fmt = ",.0f" if fmt == "d" else fmt  # the median of an even count may be a float
        if len(values) == 1:
            return format(values[0], fmt)
        return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}..{format(max(values), fmt)})"

    metrics = [
        ("sessions held (workers / clients)", None, ""),
        ("starts/s", "starts_per_s", ",.0f"),
        ("start p50 / p99 ms", None, ""),
        ("steps/s", "steps_per_s", ",.0f"),
        ("step p50 ms", "step_p50_ms", ".1f"),
        ("step p99 ms", "step_p99_ms", ".1f"),
        ("RSS per worker, all held (MiB, mean)", None, ""),
        ("lost", "lost", "d"),
    ]
    sides = sorted({r["side"] for r in rows}, key=SIDES.index)
    print("\n| | " + " | ".join(sides) + " |\n|---|" + "---|" * len(sides))
    for label, key, fmt in metrics:
        cells = []
        for side in sides:
            mine = [r for r in rows if r["side"] == side]
            if label.startswith("sessions held"):
                cells.append(
                    cell([r["held_workers"] for r in mine], "d")
                    + " / "
                    + cell([r["held_clients"] for r in mine], "d")
                )
            elif label.startswith("start p50"):
                cells.append(
                    cell([r["start_p50_ms"] for r in mine], ".0f")
                    + " / "
                    + cell([r["start_p99_ms"] for r in mine], ".0f")
                )
            elif label.startswith("RSS"):
                cells.append(cell([statistics.mean(r["rss_mib"]) for r in mine], ".1f"))
            else:
                cells.append(cell([r[key] for r in mine], fmt))
        print(f"| {label} | " + " | ".join(cells) + " |")


async def driver(opts: argparse.Namespace) -> None:
    limit = raise_fd_limit()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-env-sessions-"))
    server, opts.server_pid = None, 0
    if not opts.nats_url:
        server = NatsServer(store_dir=log_dir / "nats").start()
        opts.nats_url, opts.server_pid = server.url, server.pid
    nc = await NatsSettings(url=opts.nats_url).connect(name="bench-env-driver")
    print(
        f"{opts.sessions} sessions x {opts.repeats} repeats; {opts.workers} worker and "
        f"{opts.clients} client processes per side; open files {limit}; logs {log_dir}; "
        f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus",
        flush=True,
    )
    rows = []
    try:
        for r in range(opts.repeats):
            order = opts.sides if r % 2 == 0 else opts.sides[::-1]
            for side in order:
                row = await one_run(side, opts, opts.sessions, nc, log_dir)
                row["repeat"], row["load"] = r, round(os.getloadavg()[0], 1)
                rows.append(row)
                brief = {k: v for k, v in row.items() if k not in ("failures",)}
                print(json.dumps(brief), flush=True)
                if row["failures"]:
                    print(f"  failures: {row['failures']}", flush=True)
    finally:
        await nc.close()
        if server is not None:
            server.stop()
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    summary(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workers", type=int, default=4, help="worker processes per side")
    parser.add_argument("--clients", type=int, default=4, help="client processes per side")
    parser.add_argument(
        "--capacity", type=int, default=0, help="per nats worker (default: 1.1 N/W + 16)"
    )
    parser.add_argument(
        "--max-starting", type=int, default=8, help="nats workers' --max-starting (the default's)"
    )
    parser.add_argument(
        "--http-pool", type=int, default=0, help="connections per http client process (0: no limit)"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="one request, both sides (nats: EnvClient's start and step timeouts; it retries a "
        "timed-out request twice, http does not)",
    )
    parser.add_argument("--nats-url", default="", help="a running server (default: start one)")
    parser.add_argument(
        "--sides", type=lambda text: tuple(text.split(",")), default=SIDES, help="nats,http"
    )
    parser.add_argument("--json", default="", help="write every run's figures here")
    parser.add_argument("--client", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--http-urls", default="", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.client:
        asyncio.run(client_main(opts))
    else:
        asyncio.run(driver(opts))


if __name__ == "__main__":
    main()
