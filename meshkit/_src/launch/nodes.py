"""Launchers on several machines: they join, agree on the run, stop together and report once.

``meshkit launch --nnodes N --node-rank R --coordinator HOST:PORT -n P program`` runs on each
machine. The launcher of machine 0 serves a `Hub` at ``PORT`` on ``HOST``: plain TCP, one JSON
object per line, no JAX. Every launcher, machine 0's included, joins it through a `Link`:

1. **join**: each sends its `Hello` (machine, hostname, ``-n``, ``-d``, platform, a digest of
   the program, meshkit's version). The hub checks them against each other; a bad one is an
   ``error`` sent to every machine that joined, naming both machines and both values. Once all
   ``N`` have joined, ``go`` gives each the run: JAX's coordinator (``HOST:PORT+1``, served by
   process 0 on machine 0) and the process count. Until then, every few seconds, ``waiting``
   names the machines not yet joined; after the join timeout, the hub fails the join naming them.
2. **run**: each launcher runs its ``P`` ranks, process ids ``R*P .. R*P+P-1`` (node-major). The
   first failure, signal or timeout a launcher sees goes to the hub (``failed``), which tells
   every other machine to ``stop``. A machine whose connection closes, or that says nothing for
   `LOST_S` seconds (heartbeats every `BEAT_S`), is *lost*: the hub stops the others too.
3. **report**: each launcher sends what its ranks did (``ended``: exits, the events they
   recorded, the output of the ranks that failed); the hub makes one report over all ranks
   (`meshkit._src.launch.report.root_cause`, with each rank's machine named) and sends it, with
   the run's exit status, to every machine (``over``). A launcher that loses the hub reports
   what it saw itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core import events as _events
from ..core.errors import LaunchError
from .report import RankResult

BEAT_S = 1.0  # how often each side says it is alive
LOST_S = 10.0  # silence after which the other side is lost (a link down sends no FIN)
_LINE_LIMIT = 64 << 20  # no message is longer (a machine's report of its ranks)


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as ``(host, port)``.

    Raises:
        LaunchError: not of that form, or the port is outside 1..65534 (``PORT+1`` is used too).

    Examples:
        >>> parse_address("node0.cluster:29500")
        ('node0.cluster', 29500)
    """
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise LaunchError(
            f"meshkit launch: --coordinator must be HOST:PORT with PORT in 1..65534 (PORT+1 "
            f"serves JAX's coordinator); got {text!r}."
        )
    return host, int(port)


def program_digest(command: Sequence[str], cwd: str | None) -> str:
    """A digest of what the ranks run: the command line, and the script's bytes when it is one."""
    h = hashlib.sha256(json.dumps(list(command)).encode())
    if command and not command[0].startswith("-"):
        with contextlib.suppress(OSError):
            h.update((Path(cwd or ".") / command[0]).read_bytes())
    return h.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Hello:
    """What a launcher says when it joins: who it is and what it will run."""

    node: int
    nnodes: int
    hostname: str
    processes: int
    devices: int | None
    platform: str
    program: str
    version: str
    max_restarts: int = 0
    allow_unjoined: bool = False

    def machine(self, address: str = "") -> str:
        """``machine 1 (host-b)``, or ``machine 1 (host-b, 198.18.0.2)`` with an address."""
        where = f"{self.hostname}, {address}" if address and address != self.hostname else ""
        return f"machine {self.node} ({where or self.hostname})"


# The settings every machine must share, with how a person reads each.
SAME = (
    ("nnodes", "--nnodes"),
    ("processes", "-n"),
    ("devices", "-d"),
    ("platform", "--platform"),
    ("version", "meshkit version"),
    ("program", "program (digest of its command line and script)"),
    ("max_restarts", "--max-restarts"),
    ("allow_unjoined", "--allow-unjoined"),
)


@dataclasses.dataclass(frozen=True)
class Go:
    """The run every machine starts once all have joined."""

    coordinator: str  # JAX's coordinator, ``HOST:PORT+1``
    num_processes: int
    machines: dict[int, str]  # node -> "host-b"
    attempt: int = 0  # which start of the group (``--max-restarts``), as machine 0 counts


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why the hub stopped every machine: a rank failed, a launcher was stopped, a machine lost."""

    node: int
    why: str  # "failed", "interrupted", "timed out", "lost"
    rank: int | None = None
    text: str = ""
    code: int = 1  # the exit status the run ends with
    after: float = 0.0  # seconds from the start of that machine's ranks


class Wire:
    """One TCP connection carrying one JSON object per line, written whole under a lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.buffer = b""

    def send(self, kind: str, **fields: Any) -> bool:
        data = (json.dumps({"kind": kind, **fields}) + "\n").encode()
        with self.lock:
            try:
                self.sock.sendall(data)
            except OSError:
                return False
        return True

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The whole messages in what has arrived so far (``data`` appended)."""
        self.buffer += data
        if len(self.buffer) > _LINE_LIMIT:
            raise LaunchError("meshkit launch: a message from another machine is too long.")
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def result_record(result: RankResult, *, with_output: bool) -> dict[str, Any]:
    record = dataclasses.asdict(result)
    if not with_output:
        record.update(stdout="", stderr="", tail="")
    return record


def event_record(event: _events.Event) -> dict[str, Any]:
    return {"rank": event.rank, "kind": event.kind, "time": event.time, "fields": event.fields}


def local_host_check(host: str) -> None:
    """Raise unless ``host`` names an address of this machine (machine 0 serves it).

    Raises:
        LaunchError: ``host`` does not resolve, or is not an address here.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise LaunchError(
            f"meshkit launch: the coordinator host {host!r} does not resolve here on machine 0 "
            f"({e.strerror})."
        ) from None
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address[0], 0))
            except OSError:
                continue
            return
    raise LaunchError(
        f"meshkit launch: the coordinator {host!r} is not an address of machine 0 "
        f"({hostname()}), which serves it.\nConsider --coordinator with an address "
        "of the machine started with --node-rank 0."
    )


def serve(host: str, port: int) -> socket.socket:
    """Machine 0's listening socket for the hub, on every address of this machine.

    Raises:
        LaunchError: the port is taken.
    """
    local_host_check(host)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
    except OSError as e:
        s.close()
        raise LaunchError(
            f"meshkit launch: machine 0 cannot serve the coordinator at port {port}: "
            f"{e.strerror}.\nConsider another port in --coordinator."
        ) from None
    s.listen(1024)
    return s


def hostname() -> str:
    """This machine's name, as the reports show it."""
    return socket.gethostname()
