"""The coordinator's TCP port, checked by `meshkit.init` (`meshkit launch` picks and holds it).

JAX's coordinator binds with ``SO_REUSEPORT``, so two runs could share one port; the launcher
holds it for the run (`meshkit._src.launch.ports.reserve_port`: bound, never listening) and
rank 0 checks that nothing else holds or serves it (`coordinator_port_taken`).
"""

from __future__ import annotations

import errno
import socket
import time

from .errors import MeshkitError
from .events import ENV_INIT_TIMEOUT


def coordinator_port_taken(port: int) -> bool:
    """Whether a coordinator about to serve ``port`` here would share it with something else."""
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


_UNREACHABLE = f"""\
meshkit.init(): process {{pid}} of {{n}} could not reach the coordinator at {{address}}
within {{timeout:g}} s (source: {{source}}).
The coordinator is process 0; it must be running and its address reachable from this host.
Consider checking that process 0 started and printed no error, that host and port are right, and
that no firewall blocks the port; raise the wait with timeout= or {ENV_INIT_TIMEOUT}=SECONDS."""

_PORT_IN_USE = """\
meshkit.init(): process 0 must serve the coordinator at {address}, but port {port} is already in
use on this host (source: {source}).
Consider choosing another port, or ending the program that holds it (an earlier run that did not
exit, for example: `ss -ltnp 'sport = :{port}'` shows which)."""


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise MeshkitError(
            f"meshkit.init(): coordinator address {address!r} is not of the form 'host:port'."
        )
    return host.strip("[]"), int(port)


def check_coordinator(address: str, process_id: int, n: int, timeout: float, source: str) -> None:
    """Fail with a named address instead of letting JAX abort the process."""
    host, port = split_address(address)
    if process_id == 0:
        # `meshkit launch`'s reservation is fine; anything else would share the port.
        if coordinator_port_taken(port):
            raise MeshkitError(_PORT_IN_USE.format(address=address, port=port, source=source))
        return
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, remaining))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                what = dict(pid=process_id, n=n, address=address, timeout=timeout, source=source)
                raise MeshkitError(_UNREACHABLE.format(**what)) from None
            time.sleep(0.1)
