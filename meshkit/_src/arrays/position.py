"""Where a `meshkit.global_batches` caller is, for the processes that wait at an agreement for it.

Taking a step of `meshkit.global_batches` is in the order every process must follow, as
meshkit's agreements are (its calls with host data, first compilations of programs over several
processes): the n-th step of an iterator is numbered n - 1 under its *steps tag*, and a process
that has taken k steps has begun k agreements of it (`Node`'s count, read by the cycle
detection of `meshkit._src.coord.waits`). Nothing is sent per step.

A caller that stays inside one step for a whole period of the iterator's watch
(`meshkit._src.arrays.closes.Watch`), outside any meshkit wait, may be waiting in that step's
collective for a process that waits at an agreement instead (which it would reach only after
taking the same step). The watch then reads the other processes' posted waits (one request),
and if one waits on the caller's channel, registers the caller as *moving* at its step
(`Wait.moving`) and probes: the waiting process finds the cycle (it waits at an agreement while
it has taken fewer steps), raises it, and tells this process, whose watch ends it with the same
error unless a meshkit call raises it first. The caller leaves the registration at its next
step.
"""

from __future__ import annotations

import threading

from ..coord import channel as _channel
from ..coord import waits as _waits
from ..coord.node import Node
from ..core.errors import DivergenceError

__all__ = ["Position"]


class Position:
    """One iterator's caller: its thread, channel and steps, and its moving wait when stuck."""

    def __init__(self, node: Node, tag: str, steps: int = 0) -> None:
        self.node = node
        self.tag = tag + "/steps"
        self.count = node.tag(self.tag)  # its ``seq``: the steps taken (`Node._reached`)
        self.count.seq = steps  # a resumed iterator counts on from its start (every process)
        self.lock = threading.Lock()
        self.caller: int | None = None
        self.channel: str | None = None
        self.steps = steps
        self.in_next = False  # the caller asks for a step (it waits for the helper)
        self.seen = -1  # the steps at the watch's last look
        self.wait: tuple[int, _waits.Wait] | None = None  # (thread, wait) registered as moving

    def took(self, steps: int) -> None:
        """In the caller's thread: it has taken ``steps`` steps."""
        self.caller, self.channel = threading.get_ident(), _channel.current()
        self.count.seq = self.steps = steps
        if self.wait is not None:
            self.clear()

    def clear(self) -> None:
        """Forget the moving wait, if registered."""
        with self.lock:
            registered, self.wait = self.wait, None
        if registered is not None and self.node.waits.leave_moving(*registered):
            self.node.forget_waits()  # none of this process's waits is left

    def look(self) -> DivergenceError | None:
        """In the watch's thread, once a period: the cycle the caller is found in, if any."""
        steps, caller = self.steps, self.caller
        if caller is None or steps == 0 or self.in_next or steps != self.seen:
            self.seen = steps
            if self.wait is not None:
                self.clear()
            return None
        node = self.node
        if self.wait is None:
            if node.waits.registered(caller):
                return None  # at an agreement: its own probes post it
            theirs, _ = _waits.read(node.service.dir_get(_waits.PREFIX), node.me)
            here = self.channel or ""
            if not any(v.channel == here for waits in theirs.values() for v in waits):
                return None  # nobody waits on this channel
            what = f"step {steps} of meshkit.global_batches"
            with self.lock:
                wait = node.waits.enter_moving(caller, self.channel, self.tag, steps - 1, what)
                self.wait = (caller, wait)
        node.probe_waits()  # posts the wait; a process in a cycle with it tells this one
        taken = node.waits.take_found(caller) if node.waits.pending(caller) else None
        return None if taken is None else taken[1]
