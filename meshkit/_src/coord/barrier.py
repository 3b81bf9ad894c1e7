"""`check`: one barrier per call, for agreements where any difference is an error.

Every process waits at the coordination service's barrier named by the tag and the digest of
its summary, its n-th wait there meeting the n-th of the others: when every summary is equal,
they all meet, and the barrier passing is the answer (one round trip, no key written).
Processes that differ wait at different barriers; each one still waiting after `PROBE_S` posts
its record and reads the others' (`Prober`), and on finding another digest arrives at that
digest's barrier with a participant list of its own, which the service refuses to every process
waiting there: all of them stop at once, and read every record to name who differs. A process
that does not come is named when the barrier's timeout expires. A barrier so spoiled is not used
again: every process moves to a new *epoch* of barrier names after a failed check.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass, field

from .node import (
    LEFT,
    PROBE_MAX_S,
    PROBE_S,
    SLICE_S,
    Node,
    Outcome,
    Posted,
    Record,
    Tag,
    digest,
    key,
    text,
)
from .service import Barrier

__all__ = ["PROBE_S", "Prober", "check", "leave_check", "meet"]


def barrier_id(tag: str, epoch: int, digest_: str) -> str:
    return f"meshkit/{tag}/b{epoch}/{digest_}"


def check(
    node: Node, tag: str, summary: str, record: Record, *, timeout: float, what: str = ""
) -> Outcome:
    """`agree` for checks, where any difference between processes is an error: one round trip.

    The summaries of a tag take any number of distinct values without cost (a loop that
    alternates functions alternates barriers); no key is written while processes agree.
    ``record`` may be a function that makes it: it is made only when shown (and an agreed
    `Outcome` then has no records). ``what``: the agreement in words, for a message naming
    processes that wait at different agreements (`meshkit._src.coord.waits`; default the tag).

    Raises:
        DivergenceError: the processes wait at different agreements (`Node.probe_waits`).
    """
    state = node.tag(tag)
    mine = digest(summary, {})
    with state.lock:
        seq = state.seq
        state.seq += 1
        state.barrier.last = mine
        epoch = state.barrier.epoch
    node.stats.agreements += 1
    node.collect_garbage(tag, seq)
    deadline = time.monotonic() + timeout
    with node.waited(tag, seq, what, barrier_id(tag, epoch, mine)):
        return meet(node, state, seq, epoch, mine, summary, record, deadline)


def meet(
    node: Node,
    state: Tag,
    seq: int,
    epoch: int,
    digest_: str,
    summary: str,
    record: Record,
    deadline: float,
) -> Outcome:
    """`check`'s protocol for agreement ``seq`` of ``state``'s tag, once numbered."""
    tag, me, n = state.name, node.me, node.n
    waiter = Waiter(node, tag, seq, epoch, digest_, summary, record, threading.get_ident())
    start = time.monotonic()
    prober = _prober(node)
    prober.add(waiter)
    try:
        ended = node.service.barrier(
            barrier_id(tag, epoch, digest_), max(deadline - time.monotonic(), 0.001)
        )
    finally:
        prober.remove(waiter)
    if ended is Barrier.PASSED:
        return Outcome(True, {me: record} if isinstance(record, str) else {}, (), (), seq)
    if node.waits.registered(waiter.thread):
        # Refused by this process's probe (processes wait at different agreements), or by
        # another's: a process refused here while the others wait elsewhere learns it now.
        if not node.waits.pending(waiter.thread):
            with contextlib.suppress(Exception):
                node.probe_waits()
        node.raise_found(waiter.thread)
    timed_out = ended is Barrier.TIMED_OUT
    with state.lock:
        state.barrier.epoch = max(state.barrier.epoch, epoch + 1)
        state.barrier.last = None
    node.stats.slow += 1
    # A process that arrives after the others' timeout is refused at once: it did not give up.
    waited = time.monotonic() - start
    gave_up_here = timed_out and waited >= min(0.5, max(deadline - start, 0.0) / 2)
    waiter.post(gave_up=gave_up_here)
    if not timed_out:
        # Refused: another process found a difference. Those waiting at other barriers (which
        # this process's probes may not have seen yet) are refused now, by this one.
        with contextlib.suppress(Exception):
            waiter.probe()
    grace = 1.0 if timed_out else min(max(deadline - time.monotonic(), 1.0), 10.0)
    records, missing, gave_up = node.collect(tag, seq, n, time.monotonic() + grace)
    if gave_up_here:  # missing: every process that was not waiting when the barrier expired
        missing, gave_up = tuple(p for p in range(n) if p not in gave_up), ()
    return Outcome(False, records, missing, gave_up, seq)


def leave_check(node: Node, tag: str, record: str) -> None:
    """`leave` for a tag of `check`: post ``record`` and spoil the barrier the others wait at.

    The others, if they wait for this process at the barrier of the tag's last summary (a
    steady loop), are refused at once and find ``record``; never waits.
    """
    state = node.tag(tag)
    with state.lock:
        seq = state.seq
        state.seq += 1
        epoch, last = state.barrier.epoch, state.barrier.last
        state.barrier.epoch += 1
        state.barrier.last = None
    Waiter(node, tag, seq, epoch, "", LEFT, record, threading.get_ident()).post()
    if last is not None:
        node.spoil(barrier_id(tag, epoch, last))


@dataclass(eq=False)
class Waiter:
    """A `check` in progress: what its probes post and compare."""

    node: Node
    tag: str
    seq: int
    epoch: int
    digest: str
    summary: str
    make_record: Record
    thread: int  # the waiting thread
    posted: bool = False
    spoiled: set[str] = field(default_factory=set)
    # The prober's thread and the waiting one both post: one write of the record, not two.
    lock: threading.Lock = field(default_factory=threading.Lock)

    @functools.cached_property
    def record(self) -> str:
        return text(self.make_record)

    def post(self, gave_up: bool = False) -> None:
        """Write this record once (again with ``gave_up``: the barrier's timeout passed here)."""
        with self.lock:
            if self.posted and not gave_up:
                return
            posted = Posted(self.summary, self.record, {}, gave_up, self.digest, self.epoch)
            self.node.write(self.tag, self.seq, posted, overwrite=self.posted)
            self.posted = True

    def probe(self) -> None:
        """Post this record, read the others'; spoil the barriers of other digests.

        A synchronous wait also compares where every process waits (`Node.probe_waits`); in a
        cycle, the others in it refuse this barrier (as this probe refuses theirs), so that its
        thread returns and raises.
        """
        node = self.node
        if node.waits.registered(self.thread):
            node.probe_waits()
            if node.waits.pending(self.thread):
                return
        self.post()
        entries = node.service.dir_get(key(self.tag, self.seq, "r") + "/")
        for _, value in entries:
            theirs = Posted.from_json(value)
            if theirs.epoch != self.epoch or theirs.digest in ("", self.digest):
                continue
            if theirs.digest not in self.spoiled:
                self.spoiled.add(theirs.digest)
                node.spoil(barrier_id(self.tag, self.epoch, theirs.digest))


def _prober(node: Node) -> Prober:
    """The node's prober (one thread per process, started at its first probe)."""
    with node.prober_lock:
        if node.prober is None:
            prober = node.prober = Prober(node)
            node.threads.append((prober, prober.cond))
        assert isinstance(node.prober, Prober)
        return node.prober


class Prober(threading.Thread):
    """Probes the checks of one process that wait longer than `PROBE_S`.

    While checks come, it looks every ``PROBE_S / 4``; `add` wakes it only from a long sleep
    (no check for a while), so a steady loop of checks wakes no thread per call.
    """

    def __init__(self, node: Node) -> None:
        super().__init__(name="meshkit-check-probe", daemon=True)
        self.node = node
        self.cond = threading.Condition()
        self.waiting: dict[Waiter, tuple[float, float]] = {}  # -> (next probe, period)
        self.asleep = True  # in a long sleep: the next `add` wakes the thread
        self.last_add = 0.0

    def add(self, waiter: Waiter) -> None:
        now = time.monotonic()
        with self.cond:
            self.waiting[waiter] = (now + PROBE_S, PROBE_S)
            self.last_add = now
            if self.asleep:
                self.asleep = False
                if not self.is_alive():
                    self.start()
                self.cond.notify()

    def remove(self, waiter: Waiter) -> None:
        with self.cond:
            self.waiting.pop(waiter, None)

    def run(self) -> None:
        tick = PROBE_S / 4
        while not self.node.stopping.is_set():
            with self.cond:
                now = time.monotonic()
                due = [w for w, (t, _) in self.waiting.items() if t <= now]
                for w in due:
                    period = min(self.waiting[w][1] * 2, PROBE_MAX_S)
                    self.waiting[w] = (now + period, period)
                if not due:
                    if not self.waiting and now - self.last_add > 50 * tick:
                        self.asleep = True
                        self.cond.wait(SLICE_S)
                    else:
                        self.cond.wait(tick)
                    continue
            for w in due:
                with contextlib.suppress(Exception):  # a probe that fails leaves the timeout
                    w.probe()
