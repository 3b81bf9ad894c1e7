"""The coordinator port: held by the launcher for the run, told apart from a second server."""

from __future__ import annotations

import contextlib
import socket

import pytest

from meshkit._src.core.ports import coordinator_port_taken, free_port, port_in_use, reserve_port


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
        picked = {free_port() for _ in range(1000)}
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
    port = free_port()
    assert not coordinator_port_taken(port)
