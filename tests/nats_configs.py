"""Run nats-server from the config files in ops/nats/ themselves.

Only what a test must change is rewritten: listen addresses (0.0.0.0 becomes 127.0.0.1, so
nothing listens beyond loopback), ports (free ones, so tests run side by side) and store
directories (under the test's tmp_path). Each rewritten string must still be in the file, so a
test fails loudly, rather than testing something else, when the files change shape.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from agentarium.broker import NatsServer, free_port

ROOT = Path(__file__).resolve().parents[1]
OPS_NATS = ROOT / "ops" / "nats"
CLUSTER_NODES = ("a", "b", "c")
# The users of ops/nats/auth.conf, one per role
ROLES = (
    "admin",
    "producer",
    "consumer",
    "trainer",
    "sync",
    "orchestrator",
    "dashboard",
    "environment",
)


def agentarium_cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """``python -m agentarium ARGS`` from the checkout, with ``env`` added to a child's."""
    from agentarium.demo.processes import child_env

    return subprocess.run(
        [sys.executable, "-m", "agentarium", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=child_env(**env),
    )


def render(src: Path, dest: Path, replace: dict[str, str]) -> Path:
    text = src.read_text()
    for old, new in replace.items():
        if old not in text:
            raise AssertionError(
                f"{src} no longer contains {old!r}: update the substitutions in tests/nats_configs.py"
            )
        text = text.replace(old, new)
    dest.write_text(text)
    return dest


@dataclass
class Node:
    name: str  # the config's server_name
    server: NatsServer
    monitor_port: int

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.monitor_port}/healthz"


def single_node(tmp: Path, *, config: str = "single.conf") -> Node:
    """ops/nats/single.conf, or auth.conf (which includes single.conf), on free loopback ports.

    Not started: call ``node.server.start()``.
    """
    conf_dir = tmp / "conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    port, monitor = free_port(), free_port()
    store = tmp / "jetstream"
    render(
        OPS_NATS / "single.conf",
        conf_dir / "single.conf",
        {
            "listen: 0.0.0.0:4222": f"listen: 127.0.0.1:{port}",
            "http: 0.0.0.0:8222": f"http: 127.0.0.1:{monitor}",
            '"/data/jetstream"': f'"{store}"',
        },
    )
    if config != "single.conf":
        shutil.copy(OPS_NATS / config, conf_dir / config)
    server = NatsServer(store_dir=store, port=port, config=conf_dir / config)
    return Node("agentarium-nats", server, monitor)


def cluster(tmp: Path) -> dict[str, Node]:
    """ops/nats/cluster-{a,b,c}.conf on free loopback ports; routes rewritten to match.

    Not started: call ``start_cluster``.
    """
    ports = {
        n: (free_port(), free_port(), free_port()) for n in CLUSTER_NODES
    }  # client, http, route
    nodes = {}
    for n in CLUSTER_NODES:
        client, http, route = ports[n]
        store = tmp / f"nats-{n}"
        replace = {
            "listen: 0.0.0.0:4222": f"listen: 127.0.0.1:{client}",
            "http: 0.0.0.0:8222": f"http: 127.0.0.1:{http}",
            "listen: 0.0.0.0:6222": f"listen: 127.0.0.1:{route}",
            f'"/data/nats-{n}"': f'"{store}"',
        }
        for other in CLUSTER_NODES:
            replace[f"nats-route://nats-{other}:6222"] = f"nats-route://127.0.0.1:{ports[other][2]}"
        conf = render(OPS_NATS / f"cluster-{n}.conf", tmp / f"cluster-{n}.conf", replace)
        nodes[f"nats-{n}"] = Node(
            f"nats-{n}", NatsServer(store_dir=store, port=client, config=conf), http
        )
    return nodes


async def wait_healthy(nodes: list[Node], timeout_s: float = 30.0) -> None:
    """Until every node's /healthz says JetStream is ready (a cluster has elected its meta leader)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        for node in nodes:
            while True:
                try:
                    async with http.get(node.health_url) as resp:
                        if resp.status == 200:
                            break
                        detail = await resp.text()
                except aiohttp.ClientError as exc:
                    detail = str(exc)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{node.name} not healthy after {timeout_s}s: {detail}")
                await asyncio.sleep(0.1)  # a child's health endpoint: there is no event to await
