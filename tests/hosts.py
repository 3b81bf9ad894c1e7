"""Simulated hosts for tests: Linux network namespaces joined by veth pairs, each its own machine.

Each host is a network namespace with one address from 198.18.0.0/15 (the range reserved for
network tests) on a veth pair to a switch namespace (a bridge), and its own hostname (a UTS
namespace) and ``/etc/hosts`` naming every host (a mount namespace), so that gloo, which
resolves its own hostname, finds its address. Nothing is configured outside the namespaces this
module creates: no address, route or interface of the machine itself; every namespace is
deleted, and every process still in one is killed, when the `Hosts` context ends.

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); `unavailable` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

SUBNET = "198.18.0"  # host i is 198.18.0.(i+1)/24


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool!r}, which is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Hosts:
    """``n`` simulated hosts, ``host-0`` .. ``host-<n-1>`` at 198.18.0.1 onwards.

    Example:
        with Hosts(2) as hosts:
            proc = hosts.popen(1, ["python", "-c", "import socket; print(socket.gethostname())"])
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = uuid.uuid4().hex[:8]
        self.switch = f"mk{self.tag}-sw"
        self.names = [f"mk{self.tag}-h{i}" for i in range(n)]
        self.hostnames = [f"host-{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self._dir = Path(tempfile.mkdtemp(prefix="meshkit-hosts-"))
        self.hosts_file = self._dir / "hosts"

    def __enter__(self) -> Hosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        lines = ["127.0.0.1 localhost"]
        lines += [f"{a} {h}" for a, h in zip(self.addresses, self.hostnames, strict=True)]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            # Created inside the namespaces: no interface of the machine itself is touched.
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}",
                "netns", self.switch)  # fmt: skip
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run as host ``host``: in its network, with its hostname and /etc/hosts."""
        script = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return [
            "ip", "netns", "exec", self.names[host], "unshare", "--uts", "--mount", "sh", "-c",
            script, self.hostnames[host], str(self.hosts_file), *argv,
        ]  # fmt: skip

    def popen(self, host: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` on host ``host`` (`subprocess.Popen` keyword arguments pass through)."""
        return subprocess.Popen(self.command(host, argv), **kwargs)  # type: ignore[call-overload]

    def pids(self, host: int) -> list[int]:
        """The processes running in host ``host``'s network namespace."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.names[host]], capture_output=True, text=True, timeout=10
        )
        return [int(p) for p in out.stdout.split()]

    def kill(self, host: int) -> list[int]:
        """SIGKILL every process of host ``host``, as when the machine dies; their pids."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def unplug(self, host: int) -> None:
        """Set host ``host``'s link down: its processes run on, and nothing reaches them."""
        _ip("-n", self.names[host], "link", "set", "eth0", "down")

    def close(self) -> None:
        """Kill what still runs on the hosts, delete every namespace made, remove the files."""
        deadline = time.monotonic() + 10
        for i in range(self.n):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                while self.kill(i) and time.monotonic() < deadline:
                    time.sleep(0.05)
        for name in [*self.names, self.switch]:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _ip("netns", "delete", name)
        shutil.rmtree(self._dir, ignore_errors=True)
