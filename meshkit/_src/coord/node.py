"""One process's end of coordination: its service and the protocols' state (a `Node`).

No module globals: several "processes" run in one Python process over `meshkit._src.coord.fake`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core import env as _env
from ..core import frames as _frames
from ..core.errors import MeshkitError
from ..core.log import logger, say
from ..lifecycle import exit as _exit
from . import channel as _channel
from .service import Counted, Service, Stats

_LOG = logger("coord")


def _say(text: str) -> None:  # an error no call can raise: a helper thread's, or at exit
    say(_LOG, logging.ERROR, text, stacklevel=2)


BLOCK = 64  # agreements per key block (one delete per block)
LEFT = "\0left"  # the summary of a process that left a tag (it makes no call of its own)
SLICE_S = 2.0  # meshkit's own threads wait in slices this long, to stop at exit

RecordText = str | Callable[[], str]  # a record, or a function that makes it (only when shown)
Group = tuple[int, str]  # a replica group: (its reference process, this process's summary)


def text(record: RecordText) -> str:
    return record if isinstance(record, str) else record()


@dataclass(frozen=True)
class Outcome:
    """What one agreement found."""

    agreed: bool  # every process arrived and every summary (and group summary) is equal
    records: dict[int, str]  # this process's record alone when agreed; else every arrived one's
    missing: tuple[int, ...] = ()  # processes that did not arrive within the timeout, sorted
    gave_up: tuple[int, ...] = ()  # processes that stopped waiting before this one arrived
    seq: int = 0  # the call's number under its tag (the same in every process)


@dataclass
class Call:
    """One call of `agree_later` waiting for its window, or one window of them."""

    summary: str
    groups: dict[str, Group]
    record: RecordText
    arrived: float  # monotonic time of the call
    timeout: float
    on_outcome: Callable[[Outcome], None] | None = None


@dataclass
class WindowState:
    """`agree_later`'s state of one tag in one process (guarded by ``cond``)."""

    name: str
    channel: str | None  # a sync point drains only its own channel's tags
    cond: threading.Condition = field(default_factory=threading.Condition)
    seq: int = 0  # the next window's number
    queue: deque[Call] = field(default_factory=deque)  # calls not yet in a window
    inflight: int = 0  # calls in the window being agreed
    draining: int = 0  # callers waiting in `drain`: the thread must not wait for more calls
    wanted: int = 0  # the queue length the thread waits for: a steady loop wakes it no more
    left: str | None = None  # this process left the tag (`leave_later`): its record
    left_posted: threading.Event = field(default_factory=threading.Event)
    on_outcome: Callable[[Outcome], None] | None = None  # the latest call's
    thread: threading.Thread | None = None


def key(tag: str, seq: int, part: str) -> str:
    return f"meshkit/{tag}/{seq // BLOCK}/{part}/{seq}"


class Node:
    """One process of ``n`` (``me``) at the coordination service, with its protocols' state.

    ``failures`` keeps deferred failures for `settle`; ``on_unraised`` ends the process when one
    is not raised within the check timeout; ``channel`` and ``is_main`` tell the current
    thread's channel and whether it is the main thread (a fake cluster's threads each are).
    """

    def __init__(
        self,
        service: Service,
        me: int,
        n: int,
        *,
        stats: Stats | None = None,
        failures: deque[BaseException] | None = None,
        channel: Callable[[], str | None] = _channel.current,
        on_unraised: Callable[[], None] | None = None,
        is_main: Callable[[], bool] | None = None,
    ) -> None:
        if n >= 1 << 16:
            raise MeshkitError(
                f"meshkit: {n} processes exceed the {(1 << 16) - 1} the agreement counters hold."
            )
        self.stats = Stats() if stats is None else stats
        self.service = Counted(service, self.stats)
        self.me, self.n = me, n
        self.failures: deque[BaseException] = deque() if failures is None else failures
        self.failed = threading.Event()  # a check verified after the call returns failed here
        self.stopping = threading.Event()  # set at exit: meshkit's threads leave their waits
        self.exiting = threading.Event()  # set when the exit drain begins: no timer is started
        self.channel = channel
        self.is_main = is_main or _frames.is_program_thread
        # The failure was said already; nothing may wait for a process that hangs.
        self.on_unraised = on_unraised or functools.partial(_exit.now, 1)
        self.tags: dict[str, WindowState] = {}  # tags agreed after the call returns
        self.tags_lock = threading.Lock()
        self.sequences: dict[str, Any] = {}  # `agreement.Sequence` by name
        self.counts: dict[str, int] = {}  # steps taken per iterator (`places.Moving`)

    def read(self, key: str, deadline: float) -> str | None:
        """The value of ``key`` once written; None if it is not written before ``deadline``.

        Outside the program's thread, waits in slices of `SLICE_S` and gives up once the process
        exits: no thread may be inside a blocking call then.
        """
        if self.is_main():
            return self.service.get(key, max(deadline - time.monotonic(), 0.001))
        while not self.stopping.is_set():
            now = time.monotonic()
            value = self.service.get(key, max(min(deadline, now + SLICE_S) - now, 0.001))
            if value is not None or time.monotonic() >= deadline:
                return value
        return None

    def collect_garbage(self, tag: str, seq: int) -> None:
        """Process 0 deletes the key block two blocks behind, which every process has left."""
        if self.me == 0 and seq % BLOCK == 0 and seq >= 2 * BLOCK:
            with contextlib.suppress(Exception):  # a failed delete only leaves keys behind
                self.service.delete(f"meshkit/{tag}/{seq // BLOCK - 2}/")

    def fail(self, error: BaseException, grace: float | None, *, quiet: bool = False) -> None:
        """Keep ``error`` for `settle`, say so (unless ``quiet``), end the process if never raised.

        A main thread that does not come back to meshkit within the check timeout is likely
        blocked in a collective on the inputs that disagree: exiting ends the run, not a hang.
        """
        self.failures.append(error)
        self.failed.set()
        if self.exiting.is_set() or not threading.main_thread().is_alive():
            # Found at exit (or once the main thread has ended, when Python starts no thread):
            # no meshkit call will come to raise it; `stop` ends the process.
            _say(f"meshkit: a cross-process check failed:\n{type(error).__name__}: {error}\n")
            return
        grace = _env.check_timeout() if grace is None else grace
        if not quiet:  # its text is printed once: where it is raised, or below if never
            _say(
                "meshkit: a cross-process check failed; this process's next meshkit call raises "
                f"it (if none comes within {grace:g} s, the process exits).\n"
            )

        def exit_if_unraised() -> None:
            if any(e is error for e in self.failures):
                _say(
                    f"meshkit: exiting with status 1, no call raised this within {grace:g} s "
                    f"({_env.ENV_CHECK_TIMEOUT} sets the wait):\n{type(error).__name__}: {error}\n"
                )
                self.on_unraised()

        timer = threading.Timer(grace, exit_if_unraised)
        timer.daemon = True
        timer.start()

    def drain(self, timeout: float, windows: Iterable[WindowState] | None = None) -> bool:
        """Wait until every `agree_later` call (of ``windows``) is verified, or ``timeout``.

        While it waits, the windows of this process do not wait for calls it has not made.
        """
        deadline = time.monotonic() + timeout
        for window in list(self.tags.values()) if windows is None else windows:
            with window.cond:
                if not (window.queue or window.inflight):
                    continue  # nothing to wait for (and no thread to wake)
                window.draining += 1
                window.cond.notify_all()
                try:
                    while (window.queue or window.inflight) and not self.failures:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            return False
                        window.cond.wait(min(remaining, 0.1))
                finally:
                    window.draining -= 1
        return True

    def stop(self) -> None:
        """At exit: verify what is pending (a few seconds), then let this node's threads leave.

        A thread still inside a blocking call when the interpreter ends aborts the process. A
        failed check that no call raised ends the process with status 1 (``on_unraised``).
        """
        self.exiting.set()
        if self.tags and not self.failed.is_set():  # after a failed check, it is not worth it
            self.drain(5.0)
        self.stopping.set()
        unraised = bool(self.failures)
        windows = list(self.tags.values())
        for window in windows:
            with window.cond:
                window.cond.notify_all()
        end = time.monotonic() + SLICE_S + 0.5
        for thread in [w.thread for w in windows]:
            if thread is not None:
                thread.join(max(0.0, end - time.monotonic()))
        if unraised:  # the program ended before a meshkit call could raise it: not a success
            left = next(iter(self.failures), None)
            _say(
                "meshkit: exiting with status 1: a cross-process check failed after this process's "
                f"last meshkit call, so nothing raised it:\n{type(left).__name__}: {left}\n"
            )
            self.on_unraised()

    def settle(self) -> None:
        """Raise the first disagreement a deferred check found since the last call, if any."""
        try:
            error = self.failures.popleft()
        except IndexError:  # none, or another thread raised it meanwhile
            return
        raise error
