"""Where a thread waits outside its channel's agreements, to find waits that form a cycle.

A wait longer than `FIRST_S` posts its `Place` and reads the others'; a place of another process
on the same channel that this process has not passed is a cycle, raised by the waiting side. A
caller inside a step (`Moving`) only posts its place: it may end without the others, so it
never decides; it learns of the cycle from a notice.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..core.errors import DivergenceError
from ..core.frames import place
from . import missing as _missing
from .node import Node

PREFIX = "meshkit/at/"  # + process id: where that process waits
NOTICE = PREFIX + "told-"  # + process id: the cycle another process found it in
FIRST_S = 1.0  # a wait posts its place after this long (then 2x, 4x, ... up to LAST_S)
LAST_S = 5.0


@dataclass(frozen=True)
class Place:
    """One wait in a channel's order: the agreement or step (from 0) a thread waits at."""

    sequence: str  # the channel's sequence of agreements (`agreement.channel_sequence`)
    counter: str  # what ``number`` counts: "" the sequence's agreements, "steps:<tag>" steps
    number: int
    what: str  # the wait in words (``step 3 of meshkit.global_batches``)
    where: str  # the user's line (``train.py:28 in main``)


def cycle(node: Node, mine: Place, theirs: dict[int, Place]) -> DivergenceError | None:
    """The error of the cycle ``mine`` waits in with the others' places, if any."""
    places = {node.me: mine, **{q: v for q, v in theirs.items() if v.sequence == mine.sequence}}
    state = node.sequences.get(mine.sequence)
    # How many of each counter's agreements (""), or steps, this process has begun.
    begun = {"": 0 if state is None else state.next, **node.counts}
    blocking = [
        q
        for q, v in places.items()
        if (v.counter, v.number) != (mine.counter, mine.number)
        and begun.get(v.counter, 0) <= v.number
    ]
    if not blocking:
        return None
    return different_agreements(mine.sequence, places, sorted({node.me, *blocking}))


MAIN = "main"  # the main thread's sequence of agreements (other channels: "c:<name>")


def different_agreements(
    sequence: str, spots: Mapping[int, Any], processes: list[int]
) -> DivergenceError:
    """The error of ``processes`` waiting at different ``spots`` (`Place`s or agreement entries)."""
    groups = _missing.by_value({p: f"{s.where} ({s.what})" for p, s in spots.items()})
    at = "; ".join(f"{_missing.processes(ps)} at {spot}" for spot, ps in groups.items())
    channel = sequence.removeprefix("c:")
    thread = "main thread" if sequence == MAIN else f"channel {channel!r}"
    return DivergenceError(
        f"meshkit: the processes wait at different agreements of their {thread}, and none can "
        f"go on: {at}.\n"
        "Each waits for the others to arrive where it is. Every process must reach meshkit's "
        "agreements (its calls with host data, global_batches' steps, first compilations of "
        "programs over several processes) in the same order; consider a branch taken by some "
        "processes only (a condition on jax.process_index(), on local data, or on a value only "
        "some processes read).",
        processes=processes,
        field="order",
    )


def look(node: Node, place: Place) -> None:
    """Post ``place``, read the others'; raise a cycle found here or told by another.

    The process that finds a cycle first tells the others in it, so that each raises it.
    """
    node.service.set(PREFIX + str(node.me), json.dumps(asdict(place)), overwrite=True)
    theirs, notice = {}, None
    for key, value in node.service.dir_get(PREFIX):
        name = key.rsplit("/", 1)[1]
        if name == f"told-{node.me}":
            notice = value
        elif not name.startswith("told-") and int(name) != node.me:
            theirs[int(name)] = Place(**json.loads(value))
    if notice is not None:
        with contextlib.suppress(Exception):
            node.service.delete(NOTICE + str(node.me))
        raise _read_notice(notice)
    error = cycle(node, place, theirs)
    if error is None:
        return
    said = json.dumps({"message": str(error), "processes": error.processes})
    for q in error.processes:
        if q != node.me:
            node.service.set(NOTICE + str(q), said, overwrite=True)
    raise error


def end(node: Node) -> None:
    """This process's wait ended: its place is no longer true."""
    with contextlib.suppress(Exception):  # a failed delete leaves a place that has ended
        node.service.delete(PREFIX + str(node.me))


def told(node: Node) -> DivergenceError | None:
    """The cycle another process found this one's place in, if it wrote one."""
    said = node.service.get(NOTICE + str(node.me), 0.001)
    return None if said is None else _read_notice(said)


def _read_notice(said: str) -> DivergenceError:
    fields = json.loads(said)
    return DivergenceError(fields["message"], processes=fields["processes"], field="order")


class Moving:
    """A caller that moves through an iterator's steps, seen from a watch in the service thread.

    The watch posts the caller as `Place.moving` when it stayed inside one step for a whole
    period, and returns the cycle a waiting process told it of.
    """

    def __init__(self, node: Node, sequence: str, counter: str, what: str) -> None:
        self.node, self.sequence, self.counter, self.what = node, sequence, counter, what
        self.steps, self.seen, self.frame = 0, -1, None
        self.asking = False  # the caller is inside the iterator's next()
        self.posted = False  # its place is posted

    def took(self, steps: int, frame: object) -> None:
        """In the caller's thread: it has taken ``steps`` steps; ``frame`` is its user frame."""
        self.node.counts[self.counter] = self.steps = steps
        self.frame = frame

    def look(self) -> DivergenceError | None:
        """In the watch's thread: post the caller's place if it stays in a step; a notice found."""
        steps = self.steps
        state = self.node.sequences.get(self.sequence)
        agreeing = state is not None and state.inside  # its place is the agreement's
        if steps == 0 or self.asking or agreeing or steps != self.seen or self.frame is None:
            self.seen = steps
            if self.posted:
                end(self.node)
                self.posted = False
            return None
        if not self.posted:
            at = place(self.frame)  # type: ignore[arg-type]
            what = self.what.format(step=steps)
            mine = Place(self.sequence, self.counter, steps - 1, what, at)
            key, posted = PREFIX + str(self.node.me), json.dumps(asdict(mine))
            self.node.service.set(key, posted, overwrite=True)
            self.posted = True
        return told(self.node)
