"""The coordinator's address, checked before JAX is asked to join.

JAX aborts the whole process (a C++ fatal error, no Python exception) when the coordinator cannot
be reached; `check_coordinator` therefore checks the address first, within a bounded time, and
raises a `meshkit.MeshkitError` that names it. Process 0 checks instead that its port is free.
"""

from __future__ import annotations

import socket
import time

from ..core import ports as _ports
from ..core.contract import ENV_INIT_TIMEOUT
from ..core.errors import MeshkitError

__all__ = ["check_coordinator", "split_address"]

_UNREACHABLE = """\
meshkit.init(): process {pid} of {n} could not reach the coordinator at {address}
within {timeout:g} s (source: {source}).
The coordinator is process 0; it must be running and its address reachable from this host.
Consider checking that process 0 started and printed no error, that host and port are right, and
that no firewall blocks the port; raise the wait with timeout= or {env}=SECONDS."""

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
        # `meshkit launch` holds the port for the run (a bound socket that does not listen);
        # anything else there, a second coordinator included, would share it with ours.
        if _ports.coordinator_port_taken(port):
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
                raise MeshkitError(
                    _UNREACHABLE.format(
                        pid=process_id,
                        n=n,
                        address=address,
                        timeout=timeout,
                        source=source,
                        env=ENV_INIT_TIMEOUT,
                    )
                ) from None
            time.sleep(0.1)
