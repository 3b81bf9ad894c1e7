"""The coordinator's TCP port: picked and held by `meshkit launch`, checked by `meshkit.init`.

JAX's coordination service (gRPC) binds its port with ``SO_REUSEPORT``, so a second coordinator
started by the same user on a port that one already serves does not fail: both listen, and the
kernel hands each new connection to either of them. Two runs that picked the same free port then
mix their ranks ("Unexpected task registered" from JAX, a SIGABRT). A port picked by binding to
port 0 and closing is free only for that instant; a second launcher can get it before the first
run's rank 0 binds it.

So the launcher *holds* the port for the whole run: `reserve_port` binds a socket with
``SO_REUSEPORT`` and never listens on it. The kernel then gives that port to no other bind
(port 0, or a plain bind of it) while rank 0's coordinator, also ``SO_REUSEPORT`` and of the
same user, binds it beside the reservation; a socket that does not listen receives no
connection. `coordinator_port_taken` is rank 0's check before it serves: it tells a
reservation (bound, not listening) from a port that something else holds or serves.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["coordinator_port_taken", "free_port", "port_in_use", "reserve_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it); `reserve_port` holds one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether anything on this machine holds TCP ``port``.

    A listener, a bound socket and a `reserve_port` reservation all count: a plain bind fails
    against each of them.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def reserve_port(port: int = 0) -> socket.socket:
    """Hold TCP ``port`` (0: one the OS picks) on all addresses for a coordinator to serve later.

    The returned socket is bound with ``SO_REUSEPORT`` and does not listen: no other bind gets
    the port while it is open, and JAX's coordinator (``SO_REUSEPORT``, same user) still binds
    it. Close it when the run ends.

    Raises:
        OSError: ``EADDRINUSE`` when the port is already held.

    Example:
        >>> held = reserve_port()
        >>> port = held.getsockname()[1]
        >>> port_in_use(port), coordinator_port_taken(port)
        (True, False)
        >>> held.close()
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("", port))
    except OSError:
        s.close()
        raise
    return s


def coordinator_port_taken(port: int) -> bool:
    """Whether a coordinator about to serve ``port`` here would share it with something else.

    True when a socket without ``SO_REUSEPORT`` holds it (a bind with ``SO_REUSEPORT`` fails)
    or when something already listens on it (a connection to this machine succeeds: a second
    coordinator would silently share the port). A `reserve_port` reservation alone is neither.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as c:
        c.settimeout(1.0)
        return c.connect_ex(("127.0.0.1", port)) == 0
