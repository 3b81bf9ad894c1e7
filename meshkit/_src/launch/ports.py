"""The coordinator's TCP port on the launcher's side: picked free, then held for the run.

JAX's coordinator binds with ``SO_REUSEPORT``, so two runs could share one port: the launcher
holds it (`reserve_port`: bound, never listening) and rank 0 checks it
(`meshkit._src.core.ports.coordinator_port_taken`).
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

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
