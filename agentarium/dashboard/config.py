"""DashboardConfig: where the dashboard listens and how much of the run it keeps in view."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import asdict, dataclass
from typing import Any

from agentarium.schemas import check_name, setting

DEFAULT_PORT = 8266  # next to Ray's dashboard (8265)
# A DNS name (letters, digits, '-', '.'), without scheme, port or path
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def valid_host_name(name: str) -> bool:
    """A DNS name or an IP address (an IPv6 one with or without brackets): what a ``Host``
    header names, less its port."""
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") and name.endswith("]") else name)
        return True
    except ValueError:
        return len(name) <= 253 and _HOST_NAME.fullmatch(name) is not None


@dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    # dead letters carry payloads: local only unless asked
    host: str = setting(
        "127.0.0.1",
        help="listen address (default %(default)s). WARNING: the page shows previews of dead "
        "letters' tasks and errors, which may hold user data, and has no login: bind another "
        "address (0.0.0.0) only on a network you trust, or put an authenticating proxy in front. "
        "Whatever the bind, requests whose Host is not localhost, 127.0.0.1, [::1], this "
        "address or an --allowed-host are refused (421), against DNS rebinding",
    )
    allowed_hosts: tuple[str, ...] = setting(
        (),
        flag="--allowed-host",
        metavar="NAME",
        help="also answer requests whose Host header names NAME (repeatable; no port): the "
        "names users reach the page by, e.g. a Kubernetes Service (agentarium-dashboard), an "
        "ingress host or the machine's name. localhost, 127.0.0.1, [::1] and the --host "
        "address are always answered",
    )
    port: int = setting(
        DEFAULT_PORT,
        metavar="PORT",
        help="HTTP port (default %(default)s, next to Ray's 8265; 0 picks a free one)",
    )
    refresh_s: float = setting(
        1.0, help="how often the broker is read and the page updates (default %(default)s)"
    )
    trace_url: str = setting(
        "",
        metavar="TEMPLATE",
        help="link each trajectory to its trace: a URL with {trace_id}, e.g. "
        "http://localhost:16686/trace/{trace_id} (Jaeger)",
    )
    runs: tuple[str, ...] = setting(
        (),
        flag="--run",
        metavar="RUN",
        help="count this run's trajectories exactly (repeatable); without it every run is "
        "counted while the store holds at most 200,000 trajectories, as in `broker status`",
    )
    dead_letters: int = setting(20, help="newest dead letters shown (default %(default)s)")
    trajectories: int = setting(20, help="newest trajectories listed (default %(default)s)")
    sample: int = setting(
        200,
        flagless="newest trajectories read per refresh, at most (rewards come from them); the "
        "command raises it to --trajectories",
    )
    reward_window_s: float = setting(
        10.0, flagless="reward per agent: mean over rollouts finished in a window this long"
    )
    history: int = setting(
        600, flagless="points kept per time series (queue sizes, reward windows)"
    )
    steps: int = setting(2000, flagless="trainer steps kept per run")
    preview_chars: int = setting(240, flagless="of any dead letter's error or task")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not in 0..65535")
        if self.refresh_s < 0.1:
            raise ValueError("--refresh must be at least 0.1 s")
        if self.trace_url:
            if not self.trace_url.startswith(("http://", "https://")):
                raise ValueError(
                    f"--trace-url {self.trace_url!r} must start with http:// or https://"
                )
            if "{trace_id}" not in self.trace_url:
                raise ValueError(
                    f"--trace-url {self.trace_url!r} has no {{trace_id}}: write where the id "
                    "goes, e.g. http://localhost:16686/trace/{trace_id}"
                )
        for run in self.runs:
            check_name(run, "run")
        for name in self.allowed_hosts:
            if not valid_host_name(name):
                raise ValueError(
                    f"--allowed-host {name!r} is not a host name or address: give the name "
                    "alone, without scheme, port or path (e.g. dashboard.example.com)"
                )
        for name in ("dead_letters", "trajectories", "sample", "history", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.sample < self.trajectories:
            raise ValueError("sample must be >= trajectories (the list comes from the sample)")
        if self.reward_window_s <= 0:
            raise ValueError("reward_window_s must be positive")
        if self.preview_chars < 16:
            raise ValueError("preview_chars must be >= 16")

    def describe(self) -> dict[str, Any]:
        return asdict(self)
