"""Free ports that stay free until their user binds them.

Asking the kernel for a free port (``bind(("", 0))``) and closing the socket hands back a port
from the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 on Linux by
default), and that is the range every outgoing connection on the machine draws its local port
from: between the close and the moment a nats-server (or an engine, a gateway, a rendezvous)
binds the port, any process's ``connect()`` can take it, and the server dies with "address
already in use". With dozens of test workers and servers connecting at once it happens.

``free_port`` picks below the ephemeral range instead, where only an explicit ``bind`` lands,
and reserves each port it hands out with an advisory lock (``flock``) on a file named after the
port, held by the calling process, so that no other caller of ``free_port`` on this machine
(another test worker, another suite, a child process) hands the same port out while this
process holds it. A port some process already listens on, or cannot be bound, is skipped.

A caller that binds the port itself gives nothing back: the lock goes with the process, or, as
a process keeps at most ``_MAX_HELD`` reservations, with the 64th newer one (by then its
server has bound it long since).
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from collections import OrderedDict
from pathlib import Path

# Below the ephemeral range, from here up to its start: above Ray's worker ports (10002-19999
# by default), which its raylets bind themselves
_LOWEST = 20000
# reservations one process keeps at most, the oldest released first (their servers have bound
# them long since): a few file descriptors, far under any fd limit
_MAX_HELD = 64
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_held: OrderedDict[int, int] = OrderedDict()  # port -> fd of its lock file
_cursor: int | None = None


def ephemeral_range(path: Path = _EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's ephemeral port range, inclusive; Linux's default where it cannot be read."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _candidates(low: int, high: int) -> range:
    """The ports ``free_port`` may hand out: from ``_LOWEST`` to just under the ephemeral
    range, or, when that leaves too few, from just above it to 65535."""
    if low - _LOWEST >= 1024:
        return range(_LOWEST, low)
    if 65535 - high >= 1024:
        return range(high + 1, 65536)
    return range(0)


def _lock_dir() -> Path:
    # one place for every process of the user, whatever its TMPDIR
    root = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
    path = root / f"agentarium-ports-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _reserve(port: int, lock_dir: Path) -> int | None:
    """The fd of ``port``'s lock file, now locked by this process; None when another holds it."""
    fd = os.open(lock_dir / str(port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _bindable(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` now (with SO_REUSEADDR, as servers do, so a
    port whose last connection lingers in TIME_WAIT still counts as free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _release_oldest() -> None:
    while len(_held) >= _MAX_HELD:
        _, fd = _held.popitem(last=False)
        os.close(fd)


def _kernel_pick(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port(host: str = "127.0.0.1", *, count: int = 1) -> int:
    """The first of ``count`` consecutive ports on ``host`` that nobody listens on, outside the
    ephemeral range, and reserved for this process against every other caller of this function
    on the machine (see the module's docstring). ``count`` > 1 is for a base port its user
    counts up from (an orchestrator's proxies)."""
    global _cursor
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    candidates = _candidates(*ephemeral_range())
    if len(candidates) < count:
        if count > 1:
            raise OSError("no room outside the ephemeral port range for consecutive ports")
        return _kernel_pick(host)  # nothing outside the ephemeral range: the kernel's pick
    lock_dir = _lock_dir()
    if _cursor is None:  # processes start at different places, so they rarely meet
        _cursor = random.SystemRandom().randrange(len(candidates))
    for _ in range(len(candidates)):
        first = candidates.start + _cursor % len(candidates)
        _cursor = (_cursor + count) % len(candidates)
        ports = range(first, first + count)
        if ports[-1] >= candidates.stop:
            continue
        fds: list[tuple[int, int]] = []
        for port in ports:
            fd = None if port in _held else _reserve(port, lock_dir)
            if fd is not None:
                fds.append((port, fd))
            if fd is None or not _bindable(host, port):
                break
        else:
            _release_oldest()
            _held.update(fds)
            return first
        for _, fd in fds:
            os.close(fd)
    raise OSError(f"no free port on {host} in {candidates.start}-{candidates.stop - 1}")
