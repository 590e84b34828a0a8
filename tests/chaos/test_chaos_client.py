"""Chaos: a NATS server that goes silent without closing its connections (a partition, a host
gone): a client notices by its pings and moves to another server (docs/reliability.md)."""

from __future__ import annotations

import time

import pytest
from blackhole import TcpProxy
from chaoslib import until

from agentarium.broker import NatsServer, NatsSettings, free_port

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(60)
async def test_a_client_whose_server_goes_silent_moves_to_another(tmp_path):
    silent = NatsServer(store_dir=tmp_path / "silent").start()
    proxy = TcpProxy(silent.port, name="silent")
    await proxy.start()
    other = NatsServer(store_dir=tmp_path / "other", port=free_port())
    # pings every 0.5 s instead of the default 10 s, so that the test takes seconds
    settings = NatsSettings(url=f"nats://127.0.0.1:{proxy.port},{other.url}", ping_interval_s=0.5)
    nc = await settings.connect(name="chaos-client")  # `other` is down: through the proxy
    try:
        assert nc.connected_url.port == proxy.port
        other.start()
        proxy.cut()  # every byte dropped, no FIN: only the pings can tell
        cut = time.monotonic()

        async def moved() -> bool:
            return nc.is_connected and nc.connected_url.port == other.port

        await until(moved, 20, "the client on the other server")
        # The pings found it: (max_outstanding_pings + 1) intervals of 0.5 s and a reconnect,
        # seconds on a loaded machine, where the default ping interval alone is 10 s and the
        # kernel's TCP timeouts take minutes.
        assert time.monotonic() - cut < 10
        await nc.flush(timeout=2)
    finally:
        await nc.close()
        await proxy.close()
        other.stop()
        silent.stop()
