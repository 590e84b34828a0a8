"""DashboardConfig: where the dashboard listens and how much of the run it keeps in view."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from schemas import check_name

DEFAULT_PORT = 8266  # next to Ray's dashboard (8265)


@dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    host: str = "127.0.0.1"  # dead letters carry payloads: local only unless asked
    port: int = DEFAULT_PORT
    refresh_s: float = 1.0  # how often the broker is read (and the page polls)
    trace_url: str = ""  # e.g. http://localhost:16686/trace/{trace_id} (Jaeger)
    runs: tuple[str, ...] = ()  # count these runs' trajectories exactly (else every run's, to 200k)
    dead_letters: int = 20  # newest dead letters shown
    trajectories: int = 20  # newest trajectories listed
    sample: int = 200  # newest trajectories read per refresh, at most (rewards come from them)
    reward_window_s: float = 10.0  # reward per agent: mean over rollouts finished in a window
    history: int = 600  # points kept per time series (queue sizes, reward windows)
    steps: int = 2000  # trainer steps kept per run
    preview_chars: int = 240  # of any dead letter's error or task

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
