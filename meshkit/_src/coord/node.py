"""One process's end of coordination: its service and the protocols' state (a `Node`).

No module globals: several "processes" run in one Python process over the fake service of
`meshkit.testing._fake_service`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from ..core import frames as _frames
from ..core.errors import MeshkitError
from . import channel as _channel
from .service import Counted, Service, Stats

BLOCK = 64  # agreements per key block (one delete per block)
LEFT = "\0left"  # the summary of a process that left a tag (it makes no call of its own)
SLICE_S = 2.0  # meshkit's own threads wait in slices this long, to stop at exit

RecordText = str | Callable[[], str]  # a record, or a function that makes it (past the barriers)
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


class Node:
    """One process of ``n`` (``me``) at the coordination service, with its protocols' state.

    ``channel`` and ``is_main`` tell the current thread's channel and whether it is the main
    thread (a fake cluster's threads each are).
    """

    def __init__(
        self,
        service: Service,
        me: int,
        n: int,
        *,
        stats: Stats | None = None,
        channel: Callable[[], str | None] = _channel.current,
        is_main: Callable[[], bool] | None = None,
    ) -> None:
        if n >= 1 << 16:
            raise MeshkitError(
                f"meshkit: {n} processes exceed the {(1 << 16) - 1} the agreement counters hold."
            )
        self.stats = Stats() if stats is None else stats
        self.service = cast(Service, Counted(service, self.stats))
        self.me, self.n = me, n
        self.stopping = threading.Event()  # set at exit: meshkit's threads leave their waits
        self.channel = channel
        self.is_main = is_main or _frames.is_program_thread
        self.lock = threading.Lock()  # guards `sequences`
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
