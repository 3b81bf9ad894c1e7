"""The coordinator's TCP port: picked and held by `meshkit launch`, checked by `meshkit.init`.

JAX's coordinator binds with ``SO_REUSEPORT``, so two runs could share one port; the launcher
holds it for the run (`reserve_port`: bound, never listening) and rank 0 checks that nothing
else holds or serves it (`coordinator_port_taken`).
"""

from __future__ import annotations

import errno
import random
import socket
import time
from pathlib import Path

from .errors import MeshkitError
from .events import ENV_INIT_TIMEOUT

# Where `free_ports` draws from when the kernel's ephemeral range cannot be read: Linux's default.
_EPHEMERAL_DEFAULT = (32768, 60999)
_LOWEST = 10000  # below: well-known and registered services' ports, often configured by hand


def ephemeral_range() -> tuple[int, int]:
    """Ports given to outgoing connections here (first, last); Linux's default if unknown."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_ports(count: int = 2, *, tries: int = 1000) -> int:
    """The first of ``count`` consecutive TCP ports that are all free now: ``--coordinator``'s PORT.

    Machine 0 of ``meshkit launch --nnodes N --coordinator HOST:PORT`` serves PORT and PORT+1.
    They are drawn at random from 10000 up to the kernel's ephemeral range, and each checked
    with a plain bind: a port the OS picks comes from that range, where outgoing connections
    (and their TIME_WAIT, a minute after a run) may hold PORT+1 without binding it.

    Raises:
        ValueError: ``count`` is not positive.
        OSError: no run of ``count`` free ports was found in ``tries`` draws.

    Examples:
        >>> port = free_ports(2)
        >>> port_in_use(port), port_in_use(port + 1)
        (False, False)
    """
    if count < 1:
        raise ValueError(f"free_ports: count must be at least 1, got {count}")
    low, high = _LOWEST, ephemeral_range()[0] - count  # high: the last run ends below the range
    if high < low:  # an ephemeral range that starts low: draw from below 65536 instead
        low, high = 1024, 65535 - count + 1
    draw = random.Random()
    for _ in range(tries):
        first = draw.randint(low, high)
        if not any(port_in_use(p) for p in range(first, first + count)):
            return first
    raise OSError(
        errno.EADDRINUSE,
        f"no {count} consecutive free TCP ports in {tries} draws from {low}-{high}",
    )


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def reserve_port(port: int = 0) -> socket.socket:
    """Hold TCP ``port`` (0: one the OS picks) on all addresses for a coordinator to serve later."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("", port))
    except OSError:
        s.close()
        raise
    return s


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
