"""A TCP proxy on loopback that can cut what passes through it, to partition a node.

``TcpProxy`` listens on 127.0.0.1 and forwards each connection to one target. ``cut(peer)``
black-holes connections: from then on they drop every byte both ways (read and discarded,
never forwarded; nothing is closed, so neither end sees a FIN or a reset, only silence, as
in a network partition), and new connections are accepted and drained the same way.
``heal()`` aborts the cut connections (the bytes they dropped left their protocol streams
broken, as a partition's dead connections are) and forwards new ones again.

A connection is the peer's when ``peer`` is None (everything through this proxy) or when the
dialer names itself in its first bytes: a NATS route opens with CONNECT and INFO, whose
``"server_name"`` is the dialing server's, so a proxy in front of node A can cut just node C's
routes into A.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

CHUNK = 64 * 1024
SNIFF_BYTES = 4096  # a NATS route's CONNECT and INFO lines come first, shorter than this


@dataclass(eq=False)
class _Pipe:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    head: bytes = b""  # the dialer's first bytes, for ``names``
    cut: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)

    def names(self, peer: str) -> bool:
        """Whether the dialer is ``peer``: the server_name of the INFO that follows its
        CONNECT. Only that first INFO: later ones forward gossip about other servers."""
        for line in self.head.split(b"\r\n")[:4]:
            if line.startswith(b"INFO "):
                return f'"server_name":"{peer}"'.encode() in line
        return False

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class TcpProxy:
    def __init__(self, target_port: int, *, name: str = "", target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.name = name
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[_Pipe] = set()
        self._cut_peers: set[str | None] = set()  # None: every connection
        self.dropped = 0  # bytes black-holed

    def __repr__(self) -> str:
        return (
            f"<TcpProxy {self.name} :{self.port} -> {self.target[1]} pipes={len(self._pipes)} "
            f"cut={sorted(map(str, self._cut_peers))} dropped={self.dropped}>"
        )

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pipe in list(self._pipes):
            pipe.abort()
        self._pipes.clear()

    def cut(self, peer: str | None = None) -> None:
        """Black-hole every connection (``peer`` None) or those the named peer dialed."""
        self._cut_peers.add(peer)
        for pipe in self._pipes:
            if self._is_cut(pipe):
                pipe.cut = True

    def heal(self) -> None:
        self._cut_peers.clear()
        for pipe in [p for p in self._pipes if p.cut]:
            pipe.abort()
            self._pipes.discard(pipe)

    @property
    def connections(self) -> int:
        return len(self._pipes)

    def _is_cut(self, pipe: _Pipe) -> bool:
        if None in self._cut_peers:
            return True
        return any(peer is not None and pipe.names(peer) for peer in self._cut_peers)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pipe = _Pipe(client=writer)
        self._pipes.add(pipe)
        try:
            if None in self._cut_peers:  # the node is cut off: accept, answer nothing
                pipe.cut = True
                pipe.tasks = [asyncio.create_task(self._pump(reader, None, pipe, sniff=False))]
                await asyncio.gather(*pipe.tasks, return_exceptions=True)
                return
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            pipe.upstream = up_writer
            pipe.tasks = [
                asyncio.create_task(self._pump(reader, up_writer, pipe, sniff=True)),
                asyncio.create_task(self._pump(up_reader, writer, pipe, sniff=False)),
            ]
            await asyncio.gather(*pipe.tasks, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._pipes.discard(pipe)
            pipe.abort()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter | None,
        pipe: _Pipe,
        *,
        sniff: bool,
    ) -> None:
        while data := await reader.read(CHUNK):
            if sniff and len(pipe.head) < SNIFF_BYTES:
                pipe.head += data[: SNIFF_BYTES - len(pipe.head)]
                if not pipe.cut and self._is_cut(pipe):
                    pipe.cut = True
            if pipe.cut or writer is None:
                self.dropped += len(data)
                continue
            writer.write(data)
            await writer.drain()
        if pipe.cut:  # a partition passes no FIN either: wait for heal() to abort
            await asyncio.Event().wait()
        if writer is not None:
            with contextlib.suppress(OSError):
                writer.write_eof()
