"""A 3-node cluster from ops/nats/cluster-{a,b,c}.conf whose every connection runs through
a ``TcpProxy``, so one node can be cut off (docs/reliability.md, "Chaos runs").

Each node gets two proxies: one in front of its route port, one in front of its client port.
Every route in the configs names a route proxy, and each node advertises its proxies
(``cluster.advertise``, ``client_advertise``), so gossip never hands out a direct address and
no connection bypasses them. Cutting node X black-holes its two proxies and, in the other
nodes' route proxies, the routes X dialed (told apart by the name in their CONNECT).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from blackhole import TcpProxy
from nats_configs import CLUSTER_NODES, OPS_NATS, Node, render

from agentarium.broker import NatsServer, free_port


@dataclass
class ProxiedNode:
    node: Node
    route_proxy: TcpProxy
    client_proxy: TcpProxy

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def url(self) -> str:
        """The client URL through the proxy."""
        return f"nats://127.0.0.1:{self.client_proxy.port}"


async def proxied_cluster(tmp: Path) -> dict[str, ProxiedNode]:
    """Proxies started, configs written; nodes not started (``node.server.start()``)."""
    ports = {
        n: (free_port(), free_port(), free_port()) for n in CLUSTER_NODES
    }  # client, http, route
    route_proxies, client_proxies = {}, {}
    for n in CLUSTER_NODES:
        client, _, route = ports[n]
        route_proxies[n] = TcpProxy(route, name=f"routes-{n}")
        client_proxies[n] = TcpProxy(client, name=f"clients-{n}")
        await route_proxies[n].start()
        await client_proxies[n].start()
    nodes = {}
    for n in CLUSTER_NODES:
        client, http, route = ports[n]
        store = tmp / f"nats-{n}"
        replace = {
            "listen: 0.0.0.0:4222": (
                f"listen: 127.0.0.1:{client}\n"
                f'client_advertise: "127.0.0.1:{client_proxies[n].port}"'
            ),
            "http: 0.0.0.0:8222": f"http: 127.0.0.1:{http}",
            "listen: 0.0.0.0:6222": (
                f'listen: 127.0.0.1:{route}\n  advertise: "127.0.0.1:{route_proxies[n].port}"'
            ),
            f'"/data/nats-{n}"': f'"{store}"',
        }
        for other in CLUSTER_NODES:
            replace[f"nats-route://nats-{other}:6222"] = (
                f"nats-route://127.0.0.1:{route_proxies[other].port}"
            )
        conf = render(OPS_NATS / f"cluster-{n}.conf", tmp / f"cluster-{n}.conf", replace)
        node = Node(f"nats-{n}", NatsServer(store_dir=store, port=client, config=conf), http)
        nodes[node.name] = ProxiedNode(node, route_proxies[n], client_proxies[n])
    return nodes


def cut(nodes: dict[str, ProxiedNode], name: str) -> None:
    """Partition node ``name`` from the others and from its clients."""
    for other in nodes.values():
        if other.name == name:
            other.route_proxy.cut()
            other.client_proxy.cut()
        else:
            other.route_proxy.cut(name)


def dropped(nodes: dict[str, ProxiedNode]) -> int:
    """Bytes the proxies black-holed so far."""
    return sum(n.route_proxy.dropped + n.client_proxy.dropped for n in nodes.values())


def heal(nodes: dict[str, ProxiedNode]) -> None:
    for node in nodes.values():
        node.route_proxy.heal()
        node.client_proxy.heal()


async def close(nodes: dict[str, ProxiedNode]) -> None:
    for node in nodes.values():
        node.node.server.stop()
    for node in nodes.values():
        await node.route_proxy.close()
        await node.client_proxy.close()
