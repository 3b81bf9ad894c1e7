"""The coordinator port: held by the launcher for the run, told apart from a second server."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from meshkit._src.core.ports import coordinator_port_taken
from meshkit._src.launch.ports import free_ports, port_in_use, reserve_port


def _listener(*, reuseport: bool, listen: bool = True) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuseport:  # as JAX's coordinator (gRPC) binds its port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("", 0))
    if listen:
        s.listen()
    return s


def test_a_held_port_is_handed_to_no_other_bind():
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(reserve_port()) for _ in range(32)]
        ports = {s.getsockname()[1] for s in held}
        assert len(ports) == 32
        assert all(port_in_use(p) for p in ports)
        picked = set()
        for _ in range(1000):  # ports the OS picks for a bind to port 0
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                picked.add(s.getsockname()[1])
        with contextlib.ExitStack() as more:
            picked |= {more.enter_context(reserve_port()).getsockname()[1] for _ in range(200)}
        assert not picked & ports


def test_a_reservation_leaves_the_port_to_its_coordinator():
    with reserve_port() as held:
        port = held.getsockname()[1]
        assert not coordinator_port_taken(port)
        # The coordinator binds beside the reservation and receives every connection.
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with server:
            server.bind(("", port))
            server.listen()
            server.settimeout(5)
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                conn, _ = server.accept()
                conn.close()
            # Now that it serves, a second coordinator would share the port: taken.
            assert coordinator_port_taken(port)


@pytest.mark.parametrize(
    ("reuseport", "listen"),
    [(True, True), (False, True), (False, False)],
    ids=["second-coordinator", "plain-listener", "plain-bound"],
)
def test_a_port_held_by_anything_but_a_reservation_is_taken(reuseport, listen):
    with _listener(reuseport=reuseport, listen=listen) as s:
        assert coordinator_port_taken(s.getsockname()[1])


def test_a_free_port_is_not_taken():
    port = free_ports(1)
    assert not coordinator_port_taken(port)


def test_free_ports_are_consecutive_free_and_below_theephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for count in (1, 2, 5):
        first = free_ports(count)
        assert first >= 10000
        assert first + count - 1 < low
        assert not any(port_in_use(p) for p in range(first, first + count))


def test_free_ports_skip_a_run_with_one_port_held(monkeypatch):
    # The draws land on the same first port five times while its second port is held, then on
    # another free run: the run with a held port is never returned.
    import meshkit._src.launch.ports as ports

    first, other = free_ports(2), free_ports(2)
    with reserve_port(first + 1):
        draws = iter([first] * 5 + [other])
        monkeypatch.setattr(ports.random.Random, "randint", lambda self, a, b: next(draws))
        assert ports.free_ports(2) == other
        assert next(draws, None) is None  # every draw was made


def test_free_ports_end_after_a_bounded_number_of_draws(monkeypatch):
    import meshkit._src.launch.ports as ports

    monkeypatch.setattr(ports, "port_in_use", lambda p: True)
    with pytest.raises(OSError, match=r"no 2 consecutive free TCP ports in 7 draws from 10000-"):
        ports.free_ports(2, tries=7)
    with pytest.raises(ValueError, match="free_ports: count must be at least 1, got 0"):
        ports.free_ports(0)


def test_free_ports_draw_from_everywhere_when_theephemeral_range_starts_low(monkeypatch):
    import meshkit._src.launch.ports as ports

    monkeypatch.setattr(ports, "ephemeral_range", lambda: (5000, 60999))
    seen = {ports.free_ports(2) for _ in range(50)}
    assert all(1024 <= p <= 65534 for p in seen)
    assert max(seen) >= 5000
