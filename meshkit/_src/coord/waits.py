"""Where each process waits: agreements that cannot meet because processes wait at different ones.

A thread waits at one agreement at a time (`check` or `agree`), and the n-th agreement of a tag
on a channel meets the n-th of the other processes on the same channel
(`meshkit._src.coord.channel`). So when process 0's main thread waits at one agreement (the
first compilation of a program, say) and process 1's main thread at another (the next step of a
`meshkit.global_batches`), neither can go on: process 1 reaches the first only after the second
passes, which needs process 0. Without this module they would wait until the timeout and name
each other as missing.

Each synchronous wait is registered here (a dictionary entry, nothing sent). One that lasts
longer than `PROBE_S` posts every wait of its process (one key per process: channel, tag,
number, what the agreement is and the user's line it waits at) and reads the others' (one
directory read); the probe repeats at doubling intervals. A process finds a *cycle* when
another process waits on the same channel at another tag, at an agreement this process has not
reached yet (its own count of that tag is not past it): each then needs the other first. That
is exact, not a guess from timing: the other process's wait there can only end when this
process arrives, or with an error of its own. The waiting thread then raises a
`DivergenceError` naming where each process waits, at most a probe interval after the
processes stopped. A process that raised keeps its waits posted until its next wait, and goes on
probing for a while (`Node.raise_found`): one that joins the cycle later and waits at a barrier
can only be woken by another process.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ..core.errors import DivergenceError
from ..core.frames import place, user_frame
from . import absent as _absent

__all__ = ["NOTICE", "PREFIX", "Wait", "Waits", "cycles", "notice", "notice_key", "read", "told"]

PREFIX = "meshkit-waits/"  # + process id: that process's waits, as posted by its last probe
NOTICE = "cycle-"  # PREFIX + NOTICE + process id: a cycle another process found it waits in


@dataclass(frozen=True)
class Wait:
    """One synchronous wait at an agreement, as the probes post it.

    Attributes:
        channel: the waiting thread's channel ("" for the main thread's).
        tag: the agreement's tag.
        seq: its number under the tag.
        what: the agreement in words (``step 13 of meshkit.global_batches``).
        where: the user's line the thread waits at (``train.py:28 in main``), "?" if none.
        barrier: the barrier it waits at (`check`), where another process can refuse it so
            that it returns; "" for a wait of `agree`, which wakes up to probe by itself.
        moving: not at an agreement: the thread is inside a step of a
            `meshkit.global_batches` (``seq`` is the step's number from 0, under the iterator's
            steps tag) and has stayed there a while. It may end without the others, so it is
            never the waiting side of a cycle; but a process waiting at an agreement before
            it has taken that step waits in a cycle with it (the processes took their steps and
            agreements in different orders).
    """

    channel: str
    tag: str
    seq: int
    what: str
    where: str = "?"
    barrier: str = ""
    moving: bool = False


class Waits:
    """This process's synchronous waits, and what the probes found about them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[int, Wait] = {}  # thread -> its wait
        self.found: dict[int, DivergenceError] = {}  # thread -> the cycle it waits in
        self.posted = False  # the store holds this process's waits (cleared when none is left)
        self.stale = False  # ... those of a cycle raised, kept until this process's next wait
        self.generation = 0  # counts the stale spells: a lingering probe ends with its own

    def enter(self, channel: str | None, tag: str, seq: int, what: str, barrier: str = "") -> int:
        """Register the calling thread's wait; returns the thread's id for `leave`."""
        me = threading.get_ident()
        wait = Wait(channel or "", tag, seq, what, barrier=barrier)
        with self.lock:
            self.entries[me] = wait
        return me

    def enter_moving(self, thread: int, channel: str | None, tag: str, seq: int, what: str) -> Wait:
        """Register ``thread`` as inside a step (`Wait.moving`), unless it waits already."""
        wait = Wait(channel or "", tag, seq, what, moving=True)
        with self.lock:
            self.entries.setdefault(thread, wait)
        return wait

    def leave_moving(self, thread: int, wait: Wait) -> bool:
        """`leave` for ``thread``'s `enter_moving` ``wait``, if it is still the one registered."""
        with self.lock:
            if self.entries.get(thread) is not wait:
                return False
        return self.leave(thread)

    def leave(self, thread: int) -> bool:
        """Unregister ``thread``'s wait; True: its process's posted waits are to be deleted."""
        with self.lock:
            self.entries.pop(thread, None)
            self.found.pop(thread, None)
            if self.posted and not self.entries and not self.stale:
                self.posted = False
                return True
            return False

    def mark_posted(self) -> None:
        """The store now lists this process's waits (`leave` deletes them when none is left)."""
        with self.lock:
            self.posted = True

    def registered(self, thread: int) -> bool:
        """Whether ``thread`` is in a synchronous wait."""
        return thread in self.entries

    def keep(self, found: dict[int, DivergenceError]) -> None:
        """Keep the cycles a probe found, for the waiting threads to raise."""
        with self.lock:
            self.found.update({t: e for t, e in found.items() if t in self.entries})

    def pending(self, thread: int) -> bool:
        """Whether a probe found a cycle for ``thread`` that it has not raised yet."""
        return thread in self.found

    def current(self) -> list[tuple[int, Wait]]:
        """Every wait now, with its thread, the user's line read from the thread's stack."""
        with self.lock:
            entries = list(self.entries.items())
        frames = sys._current_frames()
        return [(thread, _placed(wait, frames.get(thread))) for thread, wait in entries]

    def take_found(self, thread: int) -> tuple[Wait, DivergenceError, int] | None:
        """The cycle a probe found for ``thread``, with its wait, for the thread to raise.

        The posted waits stay in the store (until this process's next wait), for the
        processes in the cycle that have not probed yet; the number returned names this
        stale spell (`lingering`).
        """
        with self.lock:
            error = self.found.pop(thread, None)
            wait = self.entries.get(thread)
            if error is None or wait is None:
                return None
            if not self.stale:
                self.stale = True
                self.generation += 1
            return wait, error, self.generation

    def lingering(self, generation: int) -> bool:
        """Whether the stale spell ``generation`` goes on (no wait of this process since)."""
        with self.lock:
            return self.stale and self.generation == generation

    def clear_stale(self) -> bool:
        """Whether the store still holds the waits of a cycle raised before (then forget it)."""
        if not self.stale:  # the common case, without the lock
            return False
        with self.lock:
            if not self.stale:
                return False
            self.stale = self.posted = False
            return True


def _placed(wait: Wait, frame: Any) -> Wait:
    return dataclasses.replace(wait, where=place(user_frame(frame)))


def encode(waits: list[Wait]) -> str:
    return json.dumps([asdict(w) for w in waits])


def decode(value: str) -> list[Wait]:
    return [Wait(**fields) for fields in json.loads(value)]


def cycles(
    me: int,
    mine: list[tuple[int, Wait]],
    theirs: dict[int, list[Wait]],
    reached: dict[str, int],
) -> dict[int, DivergenceError]:
    """Per waiting thread of this process, the error of the cycle it waits in (if any).

    ``mine``: this process's waits (thread, wait); ``theirs``: the other processes' posted
    waits; ``reached``: per tag, how many agreements of it this process has begun. Process q's
    wait ``v`` and this process's wait ``w`` form a cycle when they are on the same channel at
    different tags and this process has not begun agreement ``v.seq`` of ``v.tag``.
    """
    found: dict[int, DivergenceError] = {}
    for thread, w in mine:
        if w.moving:
            continue  # it may end without the others: only they can tell it waits in a cycle
        blocking = {
            q: v
            for q, waits in theirs.items()
            for v in waits
            if v.channel == w.channel and v.tag != w.tag and reached.get(v.tag, 0) <= v.seq
        }
        if not blocking:
            continue
        places = {me: w}
        for q, waits in theirs.items():  # everyone posted on this channel, blocking or not
            for v in waits:
                if v.channel == w.channel:
                    places[q] = v
        found[thread] = _error(me, places, sorted(blocking))
    return found


def _error(me: int, places: dict[int, Wait], blocking: list[int]) -> DivergenceError:
    groups = _absent.by_value({p: f"{w.where} ({w.what})" for p, w in places.items()})
    where = "; ".join(f"{_absent.processes(ps)} at {place}" for place, ps in groups.items())
    channel = places[me].channel
    thread = "main thread" if not channel else f"channel {channel!r}"
    return DivergenceError(
        f"meshkit: the processes wait at different agreements of their {thread}, and none can "
        f"go on: {where}.\n"
        "Each waits for the others to arrive where it is. Every process must reach meshkit's "
        "agreements (its calls with host data, global_batches' steps, first compilations of "
        "programs over several processes) in the same order; consider a branch taken by some "
        "processes only (a condition on jax.process_index(), on local data, or on a value only "
        "some processes read).",
        processes=sorted({me, *blocking}),
        field="order",
    )


def notice_key(process: int) -> str:
    """Where a process that found a cycle tells ``process``, another in it, what it found."""
    return f"{PREFIX}{NOTICE}{process}"


def notice(error: DivergenceError, wait: Wait) -> str:
    """What a process that found a cycle tells another about the ``wait`` of that one in it."""
    said = {"message": str(error), "processes": error.processes, "field": error.field}
    return json.dumps({**said, "channel": wait.channel, "tag": wait.tag, "seq": wait.seq})


def read(entries: Iterable[tuple[str, str]], me: int) -> tuple[dict[int, list[Wait]], list[dict]]:
    """From a directory read of `PREFIX`: the other processes' waits, and the notices for me."""
    theirs: dict[int, list[Wait]] = {}
    notices: list[dict[str, Any]] = []
    for key_, value in entries:
        name = key_.rsplit("/", 1)[1]
        if name.startswith(NOTICE):
            if name == f"{NOTICE}{me}":
                notices.append(json.loads(value))
        elif int(name) != me:
            theirs[int(name)] = decode(value)
    return theirs, notices


def told(mine: list[tuple[int, Wait]], notices: list[dict[str, Any]]) -> dict[int, DivergenceError]:
    """Per waiting thread of this process, the error another process found it waits in."""
    found: dict[int, DivergenceError] = {}
    for said in notices:  # about a wait that has ended (raised already): none of these
        for thread, w in mine:
            if (w.channel, w.tag, w.seq) == (said["channel"], said["tag"], said["seq"]):
                found[thread] = DivergenceError(
                    said["message"], processes=said["processes"], field=said["field"]
                )
    return found
