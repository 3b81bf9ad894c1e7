"""Machine 0's meeting point for the launchers of a run on several machines.

The `Hub` runs in a thread of machine 0's launcher: it takes every machine's join and checks
it against the others, starts the run once all have joined, stops every machine on the first
failure or lost machine, and makes the one report over all of them (the protocol is described
in `meshkit._src.launch.nodes`). One thread serves every machine (a selector), so the hub costs
one thread whatever the number of machines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import selectors
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..core import events as _events
from ..core.errors import LaunchError, ranges
from ..core.version import __version__
from . import restarts as _restarts
from .nodes import BEAT_S, LOST_S, SAME, Hello, Stop, Wire
from .report import (
    LaunchAttempt,
    LaunchResult,
    RankResult,
    Told,
    preempted_report,
    root_cause,
)
from .supervise import summary as stage_summary
from .supervise import unjoined_report

_SAY_EVERY_S = 5.0  # how often the hub says who has not joined yet


@dataclasses.dataclass
class _Peer:
    wire: Wire
    address: str
    seen: float
    hello: Hello | None = None
    ended: dict[str, Any] | None = None
    lost: str = ""  # how it was lost, once it was


class Hub:
    """Machine 0's meeting point for every machine's launcher (see the module's docstring).

    Args:
        listener: a listening socket at the coordinator's port.
        nnodes: machines in the run.
        host: the coordinator's host as the machines reach it.
        jax_port: the port process 0 serves JAX's coordinator on.
        join_timeout: seconds for every machine to join.
        lost_after: seconds of silence after which a machine is lost.
        history: the earlier starts of the group (``--max-restarts``), as this launcher counted
            them; this run is start number ``len(history)``.
        max_restarts: how many restarts the run may make (every machine's is the same).
    """

    def __init__(
        self,
        listener: socket.socket,
        *,
        nnodes: int,
        host: str,
        jax_port: int,
        join_timeout: float,
        lost_after: float = LOST_S,
        history: Sequence[LaunchAttempt] = (),
        max_restarts: int = 0,
    ) -> None:
        self.listener = listener
        self.nnodes = nnodes
        self.host = host
        self.jax_port = jax_port
        self.join_timeout = join_timeout
        self.lost_after = lost_after
        self.history = list(history)
        self.max_restarts = max_restarts
        self.went_at = time.time()  # when the ranks were told to start (epoch, as events)
        self.stages: dict[int, dict[int, str]] = {}  # node -> its ranks' stages, as it said
        self._forming: list[list[Any]] | None = None  # what "forming" said last
        self._forming_at = 0.0
        self.peers: dict[socket.socket, _Peer] = {}
        self.nodes: dict[int, _Peer] = {}
        self.phase = "joining"  # then "running" and "over", or "failed" (the join)
        self.failure = ""
        self.start = time.monotonic()
        self.stop_cause: Stop | None = None
        self.stop_at = 0.0
        self._said_at = self.start
        self._beat_at = self.start
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="meshkit-launch-hub", daemon=True)
        self._thread.start()

    def close(self, wait: float = 5.0) -> None:
        """Stop serving (after the run is over, or at once when this launcher gives up)."""
        self._closing.set()
        self._thread.join(wait)

    # ---- the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closing.is_set() and self.phase != "over":
                for key, _ in self._selector.select(timeout=0.1):
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                self._tick(time.monotonic())
        except Exception as e:  # a bug here must not leave the machines waiting for the hub
            self._fail(f"machine 0's hub failed: {e!r}. Every machine stops.")
            self.phase = "over"
            raise
        finally:
            for peer in self.peers.values():
                peer.wire.close()
            self._selector.close()
            with contextlib.suppress(OSError):
                self.listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            sock, addr = self.listener.accept()
            sock.setblocking(True)
            sock.settimeout(5.0)  # a send never blocks the hub for long
            self.peers[sock] = _Peer(Wire(sock), str(addr[0]), time.monotonic())
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        peer = self.peers[sock]
        try:
            data = sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._gone(sock, peer)
            return
        peer.seen = time.monotonic()
        try:
            messages = peer.wire.feed(data)
        except (LaunchError, ValueError):
            self._gone(sock, peer)
            return
        for message in messages:
            try:
                self._on(peer, message)
            except (KeyError, TypeError, ValueError):  # another meshkit, or not a launcher
                self._garbled(peer, message)
                return

    def _garbled(self, peer: _Peer, message: Mapping[str, Any]) -> None:
        fields = message.get("hello") if isinstance(message, Mapping) else None
        theirs = fields.get("version", "?") if isinstance(fields, Mapping) else "?"
        who = peer.hello.machine(peer.address) if peer.hello else f"the launcher at {peer.address}"
        self._fail(
            f"{who} speaks another protocol (meshkit {theirs}; machine 0 runs {__version__}).\n"
            "Consider installing the same meshkit on every machine."
        )

    def _gone(self, sock: socket.socket, peer: _Peer) -> None:
        self._selector.unregister(sock)
        peer.wire.close()
        del self.peers[sock]
        if peer.hello is None:
            return
        if self.phase == "joining":
            self._fail(f"{peer.hello.machine(peer.address)} left while the machines joined.")
        elif self.phase == "running" and peer.ended is None:
            self._lost(peer, "its launcher's connection closed")

    def _on(self, peer: _Peer, message: Mapping[str, Any]) -> None:
        kind = message.get("kind")
        if kind == "hello":
            self._hello(peer, Hello(**message["hello"]))
        elif kind in ("failed", "interrupted", "timed out") and peer.hello is not None:
            text = f"{peer.hello.machine(peer.address)}: {message['text']}"
            if self.phase == "joining":
                self._fail(f"{text} before every machine joined; no machine starts its ranks.")
            if self.phase != "running":
                return
            rank, code = message["rank"], message["code"]
            self._stop(Stop(peer.hello.node, kind, rank, text, int(code), float(message["after"])))
        elif kind == "ended" and peer.hello is not None:
            peer.ended = dict(message)
        elif kind == "stages" and peer.hello is not None:
            self.stages[peer.hello.node] = {int(r): str(st) for r, st in message["stages"].items()}

    def _tick(self, now: float) -> None:
        if self.phase == "failed":
            return
        if self.phase == "joining":
            missing = [n for n in range(self.nnodes) if n not in self.nodes]
            if now - self.start > self.join_timeout:
                self._fail(
                    f"machine{'s' if len(missing) > 1 else ''} {ranges(missing)} did not join "
                    f"within {self.join_timeout:g} s. {self._joined()}\nConsider starting "
                    f"`meshkit launch --nnodes {self.nnodes} --node-rank R ...` on "
                    "each machine, or a longer --join-timeout."
                )
            elif now - self._said_at >= _SAY_EVERY_S:
                self._said_at = now
                self._all("waiting", missing=missing, elapsed=now - self.start)
            return
        if now - self._beat_at >= BEAT_S:
            self._beat_at = now
            self._all("alive")
        if self._forming != [] and now - self._forming_at >= BEAT_S:
            self._say_forming(now)
        for peer in list(self.peers.values()):
            if peer.hello is not None and peer.ended is None and now - peer.seen > self.lost_after:
                self._lost(peer, f"its launcher said nothing for {self.lost_after:g} s")
        live = [p for p in self.nodes.values() if not p.lost]
        if all(p.ended is not None for p in live):
            self._over()

    # ---- joining ------------------------------------------------------------------------------

    def _hello(self, peer: _Peer, hello: Hello) -> None:
        if self.phase == "failed":  # a machine that comes after the join failed hears why
            peer.wire.send("error", text=self.failure)
            return
        if self.phase != "joining":
            peer.wire.send("error", text="meshkit launch: the run has already started.")
            return
        peer.hello = hello
        other = self.nodes.get(hello.node)
        if other is not None and other.hello is not None:
            self._fail(
                f"{other.hello.machine(other.address)} and {hello.machine(peer.address)} both "
                f"say --node-rank {hello.node}.\nConsider giving each machine its own rank "
                f"in 0..{self.nnodes - 1}."
            )
            return
        for first in self.nodes.values():
            assert first.hello is not None
            # Named in the machines' order, whichever joined first.
            (h1, at1), (h2, at2) = sorted(
                [(first.hello, first.address), (hello, peer.address)], key=lambda x: x[0].node
            )
            for name, word in SAME:
                a, b = getattr(h1, name), getattr(h2, name)
                if a != b:
                    self._fail(
                        f"the machines differ in {word}: {h1.machine(at1)} has {_show(a)}, "
                        f"{h2.machine(at2)} has {_show(b)}.\n"
                        "Consider starting the same program with the same settings, and the "
                        "same meshkit, on every machine."
                    )
                    return
            break
        self.nodes[hello.node] = peer
        if len(self.nodes) == self.nnodes:
            self.phase = "running"
            p = hello.processes
            self.went_at = time.time()
            self._all(
                "go",
                coordinator=f"{self.host}:{self.jax_port}",
                num_processes=self.nnodes * p,
                machines={n: q.hello.hostname for n, q in self.nodes.items() if q.hello},
                attempt=len(self.history),
            )

    def _say_forming(self, now: float) -> None:
        """Tell every machine which machines' ranks still start or join (when that changed).

        One line per such machine, never one per rank: O(machines still forming) per message,
        at most one message a second, none once every rank has joined.
        """
        rows = []
        for node, peer in sorted(self.nodes.items()):
            assert peer.hello is not None
            p = peer.hello.processes
            stages = self.stages.get(node) or dict.fromkeys(
                range(node * p, node * p + p), "starting"
            )
            if any(st in ("starting", "joining") for st in stages.values()):
                rows.append([node, peer.hello.machine(), stage_summary(stages)])
        if rows != self._forming:
            self._forming, self._forming_at = rows, now
            self._all("forming", machines=rows)

    def _joined(self) -> str:
        joined = [f"{p.hello.machine(p.address)}" for _, p in sorted(self.nodes.items()) if p.hello]
        return f"Joined: {', '.join(joined)}." if joined else "No machine joined."

    def _fail(self, text: str) -> None:
        """The join failed: every machine that joined hears why, and so does every later one.

        The hub goes on serving until machine 0's launcher closes it, which it does once its
        own connection has heard: machine 0's launcher may connect after the others.
        """
        self.failure = f"meshkit launch: {text}"
        for peer in self.peers.values():
            peer.wire.send("error", text=self.failure)
        self.phase = "failed"

    # ---- running ------------------------------------------------------------------------------

    def _stop(self, cause: Stop) -> None:
        if self.stop_cause is None:
            self.stop_cause = cause
            self.stop_at = time.monotonic() - self.start
            self._all("stop", stop=dataclasses.asdict(cause))

    def _lost(self, peer: _Peer, how: str) -> None:
        assert peer.hello is not None
        peer.lost = how
        text = f"{peer.hello.machine(peer.address)} was lost: {how}."
        self._stop(Stop(peer.hello.node, "lost", None, text))

    def _all(self, kind: str, **fields: Any) -> None:
        for peer in list(self.peers.values()):
            if peer.hello is not None:
                peer.wire.send(kind, **fields)

    def _over(self) -> None:
        returncode, report, results, events = self._verdict()
        cause = self.stop_cause
        this = _restarts.attempt_of(
            len(self.history),
            LaunchResult(returncode, results, cause.rank if cause else None, False, [],
                         time.monotonic() - self.start, report),
            sorted(events, key=lambda e: (e.time, e.rank)),
            ranks=[r.rank for r in results],
            started_at=self.went_at,
            stopped_s=max((s for p in self.nodes.values() if p.ended
                           and (s := p.ended.get("stopped_s")) is not None), default=None),
            restartable=cause is not None and cause.why in ("failed", "lost"),
        )  # fmt: skip
        attempts = _restarts.extended(self.history, [this])
        report = _restarts.closing(report, attempts, self.max_restarts)
        # No new connection may reach this hub once the verdict is out: a launcher that joins
        # the next start finds the port closed, or the next hub, never this one.
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(self.listener)
            self.listener.close()
        self._all("over", returncode=returncode, report=report,
                  attempts=[dataclasses.asdict(a) for a in attempts])  # fmt: skip
        self.phase = "over"

    def _verdict(self) -> tuple[int, str, list[RankResult], list[_events.Event]]:
        """The run's exit status and report over every machine's ranks; their results, records."""
        results: list[RankResult] = []
        events: list[_events.Event] = []
        machines: dict[int, str] = {}
        for node, peer in sorted(self.nodes.items()):
            assert peer.hello is not None
            p = peer.hello.processes
            for r in range(node * p, node * p + p):
                machines[r] = peer.hello.machine()
            if peer.ended is None:
                continue
            results.extend(RankResult(**r) for r in peer.ended["results"])
            events.extend(_events.Event(**e) for e in peer.ended["events"])
        results.sort(key=lambda r: r.rank)
        code, report = self._decide(results, events, machines)
        return code, report, results, events

    def _decide(
        self,
        results: list[RankResult],
        events: list[_events.Event],
        machines: dict[int, str],
    ) -> tuple[int, str]:
        cause = self.stop_cause
        if cause is None:
            alone = sorted(
                r for p in self.nodes.values() if p.ended for r in p.ended.get("alone", [])
            )
            hello = next(iter(self.nodes.values())).hello
            assert hello is not None
            total = self.nnodes * hello.processes
            if alone and not hello.allow_unjoined and total > 1:
                return 1, unjoined_report(alone, total)
            told = Told.of(sorted(events, key=lambda e: (e.time, e.rank)))
            if told.preempted:  # the ranks ended for a notice: the run is to start again
                overdue = any(r.stopped_by_launcher for r in results)
                return 143, preempted_report(results, told, overdue=overdue, machines=machines)
            return 0, ""
        if cause.why == "lost":
            lost = self.nodes[cause.node]
            assert lost.hello is not None
            p = lost.hello.processes
            ranks = range(cause.node * p, cause.node * p + p)
            return 1, (
                f"meshkit launch: {lost.hello.machine(lost.address)} was lost after "
                f"{self.stop_at:.1f} s: {lost.lost}. Ranks {ranges(ranks)} ran there; every "
                "other machine's ranks were stopped.\n" + _failed_elsewhere(results, machines)
            )
        if cause.why == "failed" and cause.rank is not None:
            told = Told.of(sorted(events, key=lambda e: (e.time, e.rank)))
            bad = next((r for r in results if r.rank == cause.rank), None)
            if bad is not None:
                code = bad.returncode if bad.returncode and bad.returncode > 0 else 1
                return code, root_cause(bad, results, cause.after, told, machines)
        return cause.code, (
            f"meshkit launch: {cause.text}; every machine's ranks were stopped.\n"
            + _failed_elsewhere(results, machines)
        )


def _show(value: object) -> str:
    return "none" if value is None else str(value)


def _failed_elsewhere(results: list[RankResult], machines: Mapping[int, str]) -> str:
    own = [
        f"rank {r.rank} on {machines.get(r.rank, '?')}"
        for r in results
        if r.returncode not in (0, None) and not r.stopped_by_launcher
    ]
    return f"Also failed on their own: {', '.join(own)}.\n" if own else ""
