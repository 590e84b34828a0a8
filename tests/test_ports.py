"""free_port hands out ports that no outgoing connection can take and no other caller shares.

The suite's servers (nats-server clusters above all, whose route ports sit in a config file)
bind ports chosen before they start; a kernel-picked port comes from the ephemeral range, where
any connect() on the machine may take it first (CI saw "Error listening on router port: ...
address already in use").
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from agentarium.broker import free_port
from agentarium.broker.ports import ephemeral_range

REPO = Path(__file__).resolve().parents[1]


def test_ports_lie_outside_the_ephemeral_range_and_are_bindable():
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20  # one process never gets a port twice
    for port in ports:
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_skipped():
    port = free_port()
    with socket.socket() as other:  # another program takes the next port up
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port + 1))
        other.listen()
        base = free_port(count=2)
        assert port + 1 not in (base, base + 1)


def test_consecutive_ports_are_reserved_together():
    base = free_port(count=3)
    later = {free_port() for _ in range(50)}
    assert later.isdisjoint({base, base + 1, base + 2})


_HOLDER = textwrap.dedent(
    """
    import sys
    from agentarium.broker import free_port
    print(" ".join(str(free_port()) for _ in range(int(sys.argv[1]))), flush=True)
    sys.stdin.read()  # hold the reservations until told to go
    """
)


def test_processes_alive_at_once_never_share_a_port():
    """Four processes take 60 ports each and hold them (a process holds its latest 64): no
    port twice. Each starts at a random place in the 12,768 ports from 20000 up, so they seldom
    meet by chance: the test below forces the same start, where only the locks keep them
    apart."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLDER, "60"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        taken = [set(map(int, proc.stdout.readline().split())) for proc in procs]
    finally:
        for proc in procs:
            proc.communicate("")
    assert all(len(ports) == 60 for ports in taken)
    assert len(set().union(*taken)) == 240


_FORCED = textwrap.dedent(
    """
    import sys
    from agentarium.broker import ports
    ports._cursor = int(sys.argv[2])  # every process starts at the same place
    print(" ".join(str(ports.free_port()) for _ in range(int(sys.argv[1]))), flush=True)
    sys.stdin.read()
    """
)


def test_processes_starting_at_the_same_place_step_around_each_others_ports():
    procs = []
    taken = []
    try:
        for _ in range(3):  # one after another, each holding its ports while the next asks
            proc = subprocess.Popen(
                [sys.executable, "-c", _FORCED, "30", "7000"],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(proc)
            taken.append(set(map(int, proc.stdout.readline().split())))
    finally:
        for proc in procs:
            proc.communicate("")
    assert len(set().union(*taken)) == 90
    # once the holders are gone, their ports are free again for the next process
    again = subprocess.run(
        [sys.executable, "-c", _FORCED, "30", "7000"],
        cwd=REPO,
        input="",
        capture_output=True,
        text=True,
        check=True,
    )
    assert set(map(int, again.stdout.split())) & set().union(*taken)
