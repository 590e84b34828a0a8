"""The embedded nats-server: find the binary, run it with JetStream, wait until ready."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ServerLaunchError

_SEARCH = ("/usr/sbin/nats-server", "/usr/local/bin/nats-server", "/usr/bin/nats-server")


def find_nats_server(explicit: str | None = None) -> str:
    """Path of the nats-server binary: ``explicit``, $AGENTARIUM_NATS_SERVER, PATH, /usr/sbin."""
    for candidate in (explicit, os.environ.get("AGENTARIUM_NATS_SERVER")):
        if candidate:
            if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
                raise ServerLaunchError(
                    f"nats-server binary {candidate!r} does not exist or is not executable"
                )
            return candidate
    found = shutil.which("nats-server")
    if found:
        return found
    for path in _SEARCH:
        if os.access(path, os.X_OK):
            return path
    raise ServerLaunchError(
        "nats-server not found on PATH or in /usr/sbin: install it (apt-get install nats-server) "
        "or pass --nats-url to use a running server"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class NatsServer:
    """A nats-server child process with JetStream in ``store_dir``.

    Keeps its port and store across ``stop()``/``start()``, so tests and the demo can
    restart it on the same data. ``config`` runs it from a config file instead of flags.
    """

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    monitor_port: int | None = None
    binary: str | None = None
    config: Path | None = None
    log_file: Path | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.store_dir = Path(self.store_dir)
        self.binary = find_nats_server(self.binary)
        if not self.port:
            self.port = free_port(self.host)
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        if self.config is not None:
            cmd = [self.binary, "-c", str(self.config)]
        else:
            cmd = [
                self.binary,
                "-js",
                "-sd",
                str(self.store_dir),
                "-a",
                self.host,
                "-p",
                str(self.port),
            ]
            if self.monitor_port is not None:
                cmd += ["-m", str(self.monitor_port)]
        return [str(part) for part in cmd] + list(self.extra_args)

    def start(self, *, timeout_s: float = 15.0, foreground: bool = False) -> NatsServer:
        if self._proc and self._proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_file or self.store_dir / "nats-server.log"
        out = None if foreground else open(log_path, "ab")  # noqa: SIM115 - owned by the child
        self._proc = subprocess.Popen(
            self.command(), stdout=out, stderr=subprocess.STDOUT if out else None
        )
        if out is not None:
            out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
                raise ServerLaunchError(
                    f"nats-server exited with code {self._proc.returncode} on port {self.port}: {tail}"
                )
            if _port_open(self.host, self.port):
                return self
            time.sleep(0.02)  # polling a child's socket: there is no event to await
        self.kill()
        raise ServerLaunchError(
            f"nats-server did not listen on {self.host}:{self.port} within {timeout_s}s"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM); JetStream flushes its store."""
        if self._proc and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def wait(self) -> int:
        assert self._proc is not None
        return self._proc.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
