"""The dashboard's Host check against DNS rebinding, on every bind (issue 40): a real HTTP server
on 0.0.0.0 and on 127.0.0.1, asked with the Host headers a browser would send. A page on
another site whose name rebinds to the dashboard's address sends that site's name: refused
(421) before anything is read. The local names, the bind address and each --allowed-host are
served. The broker side is a stub: nothing here reads NATS."""

from __future__ import annotations

import aiohttp
import pytest

from agentarium.cli import build_parser
from agentarium.commands.dashboard_cmd import config_from_args
from agentarium.dashboard import DashboardConfig, DashboardServer
from agentarium.dashboard.server import allowed_host_names


class StubView:
    """What DashboardServer reads of a LiveView: a snapshot, a refresh."""

    def snapshot(self) -> dict:
        return {"error": None, "agents": [], "dead_letters": [{"task": "secret preview"}]}

    async def refresh(self) -> None:
        return None

    def failed(self, message: str) -> None:
        raise AssertionError(message)


async def ask(
    port: int, host: str, path: str = "api/state", address: str = "127.0.0.1"
) -> tuple[int, str]:
    """GET from ``address`` with the given Host header, as a browser that resolved it there."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://{address}:{port}/{path}", headers={"Host": host}) as response,
    ):
        return response.status, await response.text()


@pytest.mark.parametrize("bind", ["0.0.0.0", "127.0.0.1"])
async def test_a_rebinding_host_is_refused_and_the_allowed_ones_are_served(bind):
    config = DashboardConfig(
        host=bind,
        port=0,
        refresh_s=60,
        allowed_hosts=("agentarium-dashboard", "dashboard.example.com"),
    )
    async with DashboardServer(StubView(), config) as server:  # type: ignore[arg-type]
        port = int(server.url.rsplit(":", 1)[1].strip("/"))
        for host in (
            "evil.test",
            f"evil.test:{port}",
            "attacker.example.com",
            "agentarium-dashboard.evil.test",
            "dashboard.example.com.evil.test",
            "localhost.evil.test",
            "10.1.2.3",  # a pod or node address nobody named
            "",
        ):
            status, text = await ask(port, host)
            assert status == 421, host
            assert "secret preview" not in text and "--allowed-host" in text
            status, _ = await ask(port, host, "")  # the page itself too
            assert status == 421, host
        for host in (
            f"localhost:{port}",
            f"127.0.0.1:{port}",
            f"[::1]:{port}",
            "LocalHost",
            "localhost.",
            f"agentarium-dashboard:{port}",
            "Dashboard.Example.com",
        ):
            status, text = await ask(port, host)
            assert status == 200, host
            assert "secret preview" in text


async def test_a_specific_bind_address_is_answered_by_its_own_name():
    config = DashboardConfig(host="127.0.0.2", port=0, refresh_s=60)
    assert allowed_host_names(config) == {"localhost", "127.0.0.1", "::1", "127.0.0.2"}
    async with DashboardServer(StubView(), config) as server:  # type: ignore[arg-type]
        port = int(server.url.rsplit(":", 1)[1].strip("/"))
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.2:{port}/api/state") as response,  # Host: 127.0.0.2:port
        ):
            assert response.status == 200
        assert (await ask(port, "evil.test", address="127.0.0.2"))[0] == 421


def test_a_wildcard_bind_adds_no_name():
    for bind in ("0.0.0.0", "::"):
        assert allowed_host_names(DashboardConfig(host=bind)) == {"localhost", "127.0.0.1", "::1"}
    config = DashboardConfig(allowed_hosts=("fd00::5", "[fd00::6]", "Box.Lan."))
    assert {"fd00::5", "fd00::6", "box.lan"} <= allowed_host_names(config)


def test_allowed_host_is_a_repeatable_flag_and_refuses_what_is_not_a_name():
    parser = build_parser()
    args = parser.parse_args(
        ["dashboard", "--allowed-host", "agentarium-dashboard", "--allowed-host", "a.example"]
    )
    assert config_from_args(args).allowed_hosts == ("agentarium-dashboard", "a.example")
    for bad in ("http://a.example", "a.example:8266", "a.example/x", "*", "a b"):
        with pytest.raises(ValueError, match="--allowed-host .* is not a host name or address"):
            DashboardConfig(allowed_hosts=(bad,))
    help_text = parser._subparsers._group_actions[0].choices["dashboard"].format_help()  # type: ignore[union-attr]
    assert "--allowed-host NAME" in help_text and "DNS rebinding" in help_text
