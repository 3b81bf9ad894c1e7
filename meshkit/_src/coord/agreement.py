"""The one agreement primitive: a record per process, one decision, keyed by a sequence.

A digest the agreed history predicts waits at the sequence's service barrier (one round trip);
any other at the barrier the digest names, then, not passed, takes the counted path. The
protocol, its round trips and why ``ok`` is exact: docs/coordination.md, "The agreement primitive".
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..core.frames import place, user_frame
from . import channel as _channel
from . import places as _places
from .node import BLOCK, LEFT, Group, Node, Outcome, RecordText, text
from .service import Barrier

SHIFT = 16  # counter layout: arrivals in the low 16 bits, flags above (the store holds int32)
ARRIVALS = (1 << SHIFT) - 1
FLAG = 1 << SHIFT
OK, DIFFER = "ok", "differ"
MAX_PERIOD = 16  # the longest pattern of agreements a steady loop may repeat
SPAN = 12  # a period holds over this many agreements before it predicts (`meshkit.debug.PERIOD`)
FAST_S = _places.FIRST_S  # the longest wait at the barrier before the counted path
W = 64  # held-back agreements per sequence: the W-th verifies them all in one


@dataclass
class Entry:
    """One process's record at one agreement, as it posts it."""

    site: str  # which agreement this is (its tag: ``make_mesh``, ``programs``, ...)
    what: str  # the agreement in words, for a message naming processes at different sites
    where: str  # the user's line the call came from (``train.py:28 in main``)
    summary: str  # what must be equal in every process
    record: RecordText  # shown when summaries differ (a function: made only past the barriers)
    # replica group name -> (its reference process, this process's summary for it)
    groups: Mapping[str, Group] = field(default_factory=dict)
    gave_up: bool = False  # stopped waiting before every process arrived

    def text(self) -> str:
        self.record = text(self.record)
        return self.record

    def to_json(self) -> str:
        return json.dumps(
            {f.name: getattr(self, f.name) for f in fields(self)} | {"record": self.text()}
        )

    @classmethod
    def from_json(cls, value: str) -> Entry:
        named: dict[str, Any] = json.loads(value)
        named["groups"] = {k: (int(v[0]), str(v[1])) for k, v in named["groups"].items()}
        return cls(**named)


@dataclass(frozen=True)
class Later:
    """An agreement held back (``check="deferred"``): what it compares, and how it raises."""

    site: str
    summary: str
    record: RecordText
    groups: dict[str, Group]
    timeout: float
    on_outcome: Callable[[Outcome], None]  # raises the call's error from the outcome at it


@dataclass
class Sequence:
    """One process's state of one sequence of agreements."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    next: int = 0  # the next agreement's number
    history: deque[str] = field(default_factory=lambda: deque(maxlen=2 * MAX_PERIOD))  # agreed
    period: int = 0  # the history's period while calls repeat it (0: to be found)
    uses: dict[str, int] = field(default_factory=dict)  # agreements begun per site
    epoch: int = 0  # keys move to a new epoch when every process starts the sequence again
    differed: int = 0  # agreements that did not agree (each renames the digest barriers)
    inside: int = 0  # agreements under way (while any is, the caller's moving place is not true)
    blocks: set[int] = field(default_factory=set)  # key blocks written (process 0 deletes them)
    later: list[Later] = field(default_factory=list)  # agreements held back (``later``)


def predict(history: deque[str] | list[str], period: int = 0) -> tuple[str | None, int]:
    """The digest the next agreement repeats (None: no period), and the period it was read with.

    The smallest ``p`` (``period`` first, when still true) such that each of the last
    ``max(p, SPAN)`` digests equals the one ``p`` before it: a function of the agreed history
    alone, so every process predicts the same.
    """
    h = list(history)
    candidates = ([period] if period else []) + list(range(1, MAX_PERIOD + 1))
    for p in candidates:
        span = max(p, SPAN)
        if len(h) >= span + p and h[-span:] == h[-span - p : -p]:
            return h[-p], p
    return None, 0


def digest(site: str, summary: str, groups: Mapping[str, Group]) -> str:
    h = hashlib.blake2b(site.encode() + b"\0" + summary.encode(), digest_size=16)
    for name in sorted(groups):
        h.update(b"\0" + name.encode() + b"\0" + groups[name][1].encode())
    return h.hexdigest()


def _key(sequence: str, k: int, part: str) -> str:
    return f"meshkit/q/{sequence}/{k // BLOCK}/{part}/{k}"


def _state(node: Node, sequence: str) -> Sequence:
    with node.lock:
        return node.sequences.setdefault(sequence, Sequence())


def _where() -> str:
    return place(user_frame(sys._getframe(2)))


def agree(
    node: Node,
    sequence: str,
    site: str,
    summary: str,
    record: RecordText,
    *,
    timeout: float,
    groups: Mapping[str, Group] | None = None,
    what: str = "",
    later: Callable[[Outcome], None] | None = None,
    meet: bool = True,
) -> Outcome:
    """Agree with every process on ``summary`` at this process's next agreement of ``sequence``.

    ``site``, ``record``, ``groups`` and ``what`` are as in `Entry` (``what`` defaults to
    ``site``). Raises a `DivergenceError` (``field == "order"``) when the processes are at
    different sites. The agreements held back in the sequence are verified first (`verify`).

    ``later`` (``check="deferred"``): the agreement is held back and the call returns an agreed
    outcome at once; the sequence's next agreement, or its `W`-th held one, verifies it with
    the others held, and ``later`` raises from the outcome at it if the processes differ.

    ``meet=False`` (an exchange: records may differ without error): a new digest takes the
    counted path at once, not first its own barrier (which others leave at its ~1 s timeout).
    """
    groups = dict(groups or {})
    state = _state(node, sequence)
    if later is not None:
        with state.lock:  # `leave`, at exit, takes the held list under it
            state.later.append(Later(site, summary, record, groups, timeout, later))
            full = len(state.later) >= W
        if full:
            verify(node, sequence)
        return Outcome(True, {})
    if state.later:
        verify(node, sequence)
    state.inside += 1
    try:
        mine = digest(site, summary, groups)
        with state.lock:
            k, base = state.next, f"{sequence}/e{state.epoch}"
            state.next += 1
            use = state.uses.get(site, 0)
            state.uses[site] = use + 1
            predicted, state.period = predict(state.history, state.period)
            differed = state.differed
        flagged = mine != predicted
        node.stats.agreements += 1
        deadline = time.monotonic() + timeout

        def agreed() -> Outcome:
            with state.lock:
                state.history.append(mine)
            return Outcome(True, {node.me: record} if isinstance(record, str) else {}, seq=use)

        if predicted is not None and _fast(node, base, timeout, unflagged=not flagged):
            return agreed()
        if flagged and meet and not groups and _same_digest(node, base, differed, mine, timeout):
            return agreed()
        entry = Entry(site, what or site, _where(), summary, record, groups)
        _collect_garbage(node, state, base, k)
        _post(node, base, k, entry)  # before it counts: whoever reads after the count finds it
        total = node.service.increment(_key(base, k, "c"), 1 + FLAG * flagged)
        if total & ARRIVALS == node.n:  # the last arrival decides, from every arrival's entry
            verdict = OK if total >> SHIFT == 0 or same(_read(node, base, k)) else DIFFER
            node.service.set(_key(base, k, "v"), verdict)
        else:
            verdict = _wait(node, sequence, base, k, deadline, entry)
        if verdict is None:  # too late: post that, mark the counter, then read the verdict again
            entry.gave_up = True  # posted first: a last arrival that sees the mark sees it too
            _post(node, base, k, entry, overwrite=True)
            total = node.service.increment(_key(base, k, "c"), FLAG)
            if total & ARRIVALS == node.n:  # the last arrived just now: its verdict is on the way
                verdict = node.read(_key(base, k, "v"), time.monotonic() + timeout)
        if verdict == OK:
            return agreed()
        entries = _read(node, base, k)  # every process counted posted its entry before
        with state.lock:
            state.history.clear()  # every process compares again
            state.differed += 1
        here = {p: e for p, e in entries.items() if e.summary != LEFT}
        if len({e.site for e in here.values()}) > 1:  # the processes are at different sites
            raise _places.different_agreements(sequence, here, sorted(here))
        missing = tuple(p for p in range(node.n) if p not in entries)
        # Who stopped waiting before this process came; none when this process gave up itself.
        late = sorted(p for p, e in entries.items() if e.gave_up and p != node.me)
        gave_up = () if verdict is None else tuple(late)
        records = {p: e.text() for p, e in entries.items()}
        return Outcome(False, records, missing, gave_up, use)
    finally:
        state.inside -= 1


def leave(node: Node, sequence: str, site: str, record: str) -> None:
    """Tell the processes at ``sequence``'s next agreement that this one will not come, and why.

    Posts ``record`` (summary `LEFT`) and arrives flagged, so the others find it; never waits.
    The agreements held back in the sequence are posted before it: the others' verification
    names the first one this process did not make.
    """
    state = _state(node, sequence)
    with state.lock:
        k, base = state.next, f"{sequence}/e{state.epoch}"
        state.next += 1
        predicted, _ = predict(state.history, state.period)
        state.history.clear()
        state.differed += 1  # the others do not agree here either
        calls, state.later = state.later, []
    if calls:
        record = json.dumps([*_entries(calls), {"summary": LEFT, "record": record, "groups": {}}])
    if predicted is not None:
        _fast(node, base, 0.0, unflagged=False)
    entry = Entry(site, site, _where(), LEFT, record)
    _collect_garbage(node, state, base, k)
    _post(node, base, k, entry)
    total = node.service.increment(_key(base, k, "c"), 1 + FLAG)
    if total & ARRIVALS == node.n:
        node.service.set(_key(base, k, "v"), DIFFER)


def _fast(node: Node, base: str, timeout: float, *, unflagged: bool) -> bool:
    """The barrier of sequence ``base``: whether every process arrived there unflagged.

    A flagged process breaks it for everyone with a list naming itself twice (the service
    refuses lists that differ at once, without logging).
    """
    name = f"meshkit/b/{base}"
    if unflagged:
        return node.service.barrier(name, min(timeout, FAST_S)) is Barrier.PASSED
    node.service.barrier(name, 1.0, [*range(node.n), node.me])
    return False


def _same_digest(node: Node, base: str, differed: int, mine: str, timeout: float) -> bool:
    """Whether every process arrived at the barrier named by ``mine`` (waits at most `FAST_S`).

    A digest no history predicts (a new layout, a sequence that does not repeat): processes
    with equal digests meet in one round trip. Each process uses a name exactly when the
    others do while they agree; an agreement that did not agree renames them all
    (``differed``), so a name one process used alone is not used again.
    """
    name = f"meshkit/b/{base}/d{differed}/{mine}"
    # A quarter of a short timeout at most: the counted path still has time to name who is late.
    return node.service.barrier(name, min(timeout / 4, FAST_S)) is Barrier.PASSED


def _wait(
    node: Node, sequence: str, base: str, k: int, deadline: float, entry: Entry
) -> str | None:
    """The verdict of agreement ``k``, read until ``deadline``.

    A long wait posts its place and reads the others' (`places.look`), to raise a cycle with
    a process waiting in this channel's order outside any agreement.
    """
    key, period, place = _key(base, k, "v"), _places.FIRST_S, None
    try:
        while True:
            verdict = node.read(key, min(deadline, time.monotonic() + period))
            if verdict is not None or time.monotonic() >= deadline or node.stopping.is_set():
                return verdict
            if place is None:
                place = _places.Place(sequence, "", k, entry.what, entry.where)
            _places.look(node, place)
            period = min(period * 2, _places.LAST_S)
    finally:
        if place is not None:
            _places.end(node)


def _post(node: Node, sequence: str, k: int, entry: Entry, overwrite: bool = False) -> None:
    node.service.set(f"{_key(sequence, k, 'r')}/{node.me}", entry.to_json(), overwrite=overwrite)


def _read(node: Node, sequence: str, k: int) -> dict[int, Entry]:
    entries = node.service.dir_get(_key(sequence, k, "r") + "/")
    return {int(key.rsplit("/", 1)[1]): Entry.from_json(v) for key, v in entries}


def same(entries: Mapping[int, Entry]) -> bool:
    """Whether every entry has the same site and summary, and every replica group one summary."""
    if len({(e.site, e.summary) for e in entries.values()}) > 1:
        return False
    if any(e.gave_up or e.summary == LEFT for e in entries.values()):
        return False
    by_group: dict[str, set[str]] = {}
    for e in entries.values():
        for name, (_, summary) in e.groups.items():
            by_group.setdefault(name, set()).add(summary)
    return all(len(s) == 1 for s in by_group.values())


def channel_sequence(node: Node, name: str | None = None) -> str:
    """The sequence of channel ``name``; by default the calling thread's (`channel.current`)."""
    name = node.channel() if name is None else name
    return _places.MAIN if name is None else "c:" + _channel.tag_part(name)


def _collect_garbage(node: Node, state: Sequence, sequence: str, k: int) -> None:
    """Process 0 deletes the key blocks two or more blocks behind, which every process has left.

    Process 0 takes the counted path at every agreement that wrote keys: it knows their blocks.
    """
    if node.me != 0:
        return
    block = k // BLOCK
    with state.lock:
        state.blocks.add(block)
        done = sorted(b for b in state.blocks if b <= block - 2)
        state.blocks.difference_update(done)
    for b in done:
        with contextlib.suppress(Exception):  # a failed delete only leaves keys behind
            node.service.delete(f"meshkit/q/{sequence}/{b}/")


def verify(node: Node, sequence: str) -> None:
    """One agreement on the sequence's held calls, run by run; a difference raises (`_report`)."""
    state = _state(node, sequence)
    with state.lock:
        calls, state.later = state.later, []
    if not calls:
        return
    runs = [[s, len(list(run))] for s, run in itertools.groupby(c.summary for c in calls)]
    groups = {f"{i}/{name}": g for i, c in enumerate(calls) for name, g in c.groups.items()}
    outcome = agree(
        node,
        sequence,
        calls[0].site,
        json.dumps(runs),
        lambda: json.dumps(_entries(calls)),
        timeout=calls[0].timeout,
        groups=groups,
    )
    if not outcome.agreed:
        _report(calls, outcome)


def _entries(calls: list[Later]) -> list[dict]:
    return [{"summary": c.summary, "record": text(c.record), "groups": c.groups} for c in calls]


def _listed(record: str) -> list[dict]:
    """A process's posted calls; a process that left the program posted its leave record alone."""
    value = json.loads(record)
    return value if isinstance(value, list) else [{"summary": LEFT, "record": record, "groups": {}}]


def _report(calls: list[Later], outcome: Outcome) -> None:
    """Name the first held call on which the processes differ (its ``on_outcome`` raises).

    A process whose list ends where another left after it is not absent: the other left.
    """
    posted = {p: _listed(r) for p, r in outcome.records.items()}
    width = max((len(v) for v in posted.values()), default=1)
    i, here, absent = 0, {}, set(outcome.missing)
    for i in range(width):  # stops at the first call that differs, else at the last one
        here = {p: v[i] for p, v in posted.items() if i < len(v)}
        left = all(e["summary"] == LEFT for e in here.values())
        absent = set(outcome.missing) | (set() if left else posted.keys() - here.keys())
        compared = {p: Entry("", "", "", e["summary"], "", e["groups"]) for p, e in here.items()}
        if absent or not same(compared):
            break
    records = {p: e["record"] for p, e in here.items()}
    call = calls[min(i, len(calls) - 1)]
    call.on_outcome(Outcome(False, records, tuple(sorted(absent)), outcome.gave_up, outcome.seq))
