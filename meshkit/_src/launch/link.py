"""A launcher's connection to machine 0's hub, in a run on several machines.

The `Link` joins the hub, says it is alive every `BEAT_S` seconds, tells the hub how this
machine's run ended, and hands the launcher what the hub says: the run to start, a stop, the
final report (the protocol is described in `meshkit._src.launch.nodes`).
"""

from __future__ import annotations

import dataclasses
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core import events as _events
from ..core.errors import LaunchError, ranges
from .nodes import BEAT_S, LOST_S, Go, Hello, Stop, Wire, event_record, result_record
from .report import LaunchAttempt, RankResult


@dataclasses.dataclass(frozen=True)
class Over:
    """The hub's verdict on a run over every machine.

    Attributes:
        returncode: the run's exit status, the same on every machine.
        report: the run's report.
        attempts: every start of the group so far (``--max-restarts``), as machine 0 counts
            them, this one last.
    """

    returncode: int
    report: str
    attempts: list[LaunchAttempt]


def _attempt(record: dict[str, Any]) -> LaunchAttempt:
    """A `LaunchAttempt` from its JSON record (its tuples are lists there, its goodput a dict)."""
    failure = record.get("failure")
    compiled = tuple(tuple(c) for c in record.get("compiled", ()))  # JSON gives lists
    goodput = _events.Goodput(**record.get("goodput", {"wall": 0.0}))
    return LaunchAttempt(**{**record, "failure": None if failure is None else tuple(failure),
                            "compiled": compiled, "goodput": goodput})  # fmt: skip


def reach(
    host: str, port: int, node: int, join_timeout: float, interrupted: Callable[[], bool]
) -> socket.socket | None:
    """A connection to the hub, trying again while machine 0's launcher is not up yet.

    Returns:
        The connection, or None when ``interrupted()`` became true first (a signal).

    Raises:
        LaunchError: the hub did not answer within ``join_timeout`` seconds.
    """
    deadline = time.monotonic() + join_timeout
    last: OSError | None = None
    while time.monotonic() < deadline:
        if interrupted():
            return None
        try:
            sock = socket.create_connection((host, port), timeout=2.0)
        except OSError as e:
            last = e
            time.sleep(0.2)
            continue
        if sock.getsockname() == sock.getpeername():
            # A connection to itself: with nothing listening yet on a local port of the
            # ephemeral range, the kernel may pick that very port as the source (a TCP
            # simultaneous open); it would also keep machine 0 from serving the port.
            sock.close()
            time.sleep(0.2)
            continue
        sock.settimeout(None)
        return sock
    raise LaunchError(
        f"meshkit launch: machine {node} could not reach the coordinator {host}:{port} within "
        f"{join_timeout:g} s ({last.strerror if last else 'no answer'}).\nConsider checking "
        "that machine 0's launcher runs, and that HOST is an address of machine 0 that this "
        "machine can reach."
    )


class Link:
    """This launcher's connection to the hub (see the module's docstring).

    Args:
        sock: a connection to the hub (`reach`).
        hello: what this launcher says when it joins.
        lost_after: seconds of silence after which the hub is lost.
    """

    def __init__(self, sock: socket.socket, hello: Hello, *, lost_after: float = LOST_S) -> None:
        self.hello = hello
        self.lost_after = lost_after
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self.closed = threading.Event()
        self.lost = ""  # how the hub was lost, once it was
        self.forming: dict[str, str] = {}  # other machines whose ranks still join, as the hub says
        self._stages: dict[int, str] | None = None  # this machine's ranks' stages, as last sent
        self.wire = Wire(sock)
        self.wire.send("hello", hello=dataclasses.asdict(hello))
        self.seen = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="meshkit-launch-link", daemon=True)
        self._reader.start()
        self._beat = threading.Thread(target=self._beats, name="meshkit-launch-beat", daemon=True)
        self._beat.start()

    def _read(self) -> None:
        try:
            while True:
                data = self.wire.sock.recv(1 << 16)
                if not data:
                    break
                self.seen = time.monotonic()
                for message in self.wire.feed(data):
                    self.inbox.put(message)
        except (OSError, LaunchError, ValueError):
            pass
        if not self.closed.is_set():
            self._hub_lost("its connection closed")

    def _hub_lost(self, how: str) -> None:
        if not self.lost:
            self.lost = how
            self.inbox.put({"kind": "hub lost", "how": how})

    def _beats(self) -> None:
        while not self.closed.wait(BEAT_S):
            self.wire.send("alive")
            if time.monotonic() - self.seen > self.lost_after:
                self._hub_lost(f"it said nothing for {self.lost_after:g} s")
                return

    def join(
        self, note: Callable[[str], None], interrupted: Callable[[], bool], start: float
    ) -> Go | None:
        """Wait until every machine joined: the run, or None when this launcher got a signal.

        Raises:
            LaunchError: the hub refused the join (its message), or was lost.
        """
        while not interrupted():
            try:
                message = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            kind = message["kind"]
            if kind == "go":
                machines = {int(k): str(v) for k, v in message["machines"].items()}
                return Go(
                    str(message["coordinator"]),
                    int(message["num_processes"]),
                    machines,
                    int(message.get("attempt", 0)),
                )
            if kind == "error":
                raise LaunchError(str(message["text"]))
            if kind == "stop":  # the hub's own failure to start (it sends "error" first)
                raise LaunchError(f"meshkit launch: {Stop(**message['stop']).text}")
            if kind == "hub lost":
                raise LaunchError(
                    "meshkit launch: machine 0's launcher went away while the machines joined "
                    f"({message['how']})."
                )
            if kind == "waiting":
                missing = [int(m) for m in message["missing"]]
                note(
                    f"meshkit launch: waiting for machine{'s' if len(missing) > 1 else ''} "
                    f"{ranges(missing)} to join ({time.monotonic() - start:.1f} s)"
                )
        return None

    def stop_requested(self) -> Stop | str | None:
        """A `Stop` from the hub, the text of a lost hub, or None; never blocks."""
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return None
            if message["kind"] == "forming":
                self.forming = {
                    str(label): str(text)
                    for node, label, text in message["machines"]
                    if node != self.hello.node
                }
                continue
            if message["kind"] == "stop":
                return Stop(**message["stop"])
            if message["kind"] == "hub lost":
                return f"machine 0, which serves the coordinator, was lost: {message['how']}."

    def share_stages(self, stages: Mapping[int, str]) -> dict[str, str]:
        """Tell the hub this machine's ranks' stages (when they changed); the other machines'.

        Returns:
            Each other machine whose ranks are still starting or joining, by its name
            (``machine 1 (host-1)``), with what its ranks do (``ranks 2-3 starting``).
        """
        if dict(stages) != self._stages:
            self._stages = dict(stages)
            self.wire.send("stages", stages={str(r): st for r, st in stages.items()})
        return dict(self.forming)

    def tell(
        self, kind: str, code: int, rank: int | None = None, text: str = "", after: float = 0.0
    ) -> None:
        """Tell the hub this machine's run ended early: ``failed``, ``interrupted``, ``timed out``.

        ``code`` is the exit status the run ends with on every machine; ``after`` the seconds
        from this machine's start to the failure.
        """
        self.wire.send(kind, code=code, rank=rank, text=text, after=after)

    def end(
        self,
        results: Sequence[RankResult],
        events: Sequence[_events.Event],
        stopped_s: float | None = None,
        alone: Sequence[int] = (),
    ) -> Over | None:
        """Send what this machine's ranks did; the run's exit status and report, or None.

        ``stopped_s``: seconds from the failure this launcher saw to its ranks stopped;
        ``alone``: this machine's ranks that never joined the program. Waits
        until the hub has heard from every machine (or lost it); None when the hub itself was
        lost.
        """
        failed = {e.rank for e in events if e.kind == _events.FAILED}
        records = [
            result_record(
                r,
                with_output=(r.returncode not in (0, None) and not r.stopped_by_launcher)
                or r.rank in failed,
            )
            for r in results
        ]
        # Sent even when the hub is gone: its report may already be here (it reports, then
        # closes), and the loop below reads it first.
        self.wire.send(
            "ended",
            results=records,
            events=[event_record(e) for e in events],
            stopped_s=stopped_s,
            alone=list(alone),
        )
        while True:  # the heartbeats bound it: a silent hub is lost after `lost_after`
            try:
                message = self.inbox.get(timeout=0.1)
            except queue.Empty:
                if self.lost:  # only once what came before the loss is read: the hub sends
                    return None  # its report, then closes
                continue
            if message["kind"] == "over":
                attempts = [_attempt(a) for a in message.get("attempts", [])]
                return Over(int(message["returncode"]), str(message["report"]), attempts)

    def close(self) -> None:
        self.closed.set()
        self.wire.close()
