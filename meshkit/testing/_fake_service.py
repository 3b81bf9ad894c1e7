"""An in-process fake of the coordination service: several "processes" in one Python process.

It follows the real service where the protocols depend on it: a process's n-th wait at a
barrier name meets the n-th wait of the others there; different participant lists refuse it to
everyone; a waiter's timeout times it out for all, and a later arrival hears so at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshkit._src.coord.node import Node
from meshkit._src.coord.service import UNAVAILABLE, Barrier


class ServiceGone(ConnectionError):
    """A process that left (`FakeCluster.leave`) called the service: the code of a lost one."""

    error_code = UNAVAILABLE


@dataclass
class _Use:
    """One use of a barrier name: who arrived, with which participant list, and how it ended."""

    participants: frozenset[int]  # the first arrival's
    arrived: set[int] = field(default_factory=set)
    ended: Barrier | None = None


class FakeCluster:
    """The coordination service of ``n`` processes, in memory."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cond = threading.Condition()
        self.store: dict[str, str] = {}
        self.uses: dict[tuple[str, int], int] = {}  # (barrier, process) -> its next use
        self.barriers: dict[tuple[str, int], _Use] = {}
        self.gone: set[int] = set()

    def service(self, process: int) -> FakeService:
        """Process ``process``'s view of the service."""
        return FakeService(self, process)

    def nodes(self) -> list[Node]:
        """A `Node` per process: each thread is its main thread."""
        return [
            Node(self.service(p), p, self.n, channel=lambda: None, is_main=lambda: True)
            for p in range(self.n)
        ]

    def leave(self, process: int) -> None:
        """``process`` has left: its calls raise `ServiceGone`; the others wait for it in vain."""
        with self.cond:
            self.gone.add(process)
            self.cond.notify_all()


class FakeService:
    """One process's view of a `FakeCluster` (a `meshkit._src.coord.service.Service`)."""

    def __init__(self, cluster: FakeCluster, process: int) -> None:
        self.cluster, self.process = cluster, process

    def _enter(self) -> threading.Condition:
        if self.process in self.cluster.gone:
            raise ServiceGone(f"process {self.process} has left the fake coordination service")
        return self.cluster.cond

    def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
        with self._enter():
            if key in self.cluster.store and not overwrite:
                raise KeyError(f"ALREADY_EXISTS: key {key} already exists")
            self.cluster.store[key] = value
            self.cluster.cond.notify_all()

    def get(self, key: str, timeout: float) -> str | None:
        with self._enter():
            found = self.cluster.cond.wait_for(lambda: key in self.cluster.store, timeout)
            return self.cluster.store[key] if found else None

    def dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self._enter():
            return sorted((k, v) for k, v in self.cluster.store.items() if k.startswith(prefix))

    def delete(self, key: str) -> None:
        with self._enter():
            for k in [
                k for k in self.cluster.store if k == key or (key[-1:] == "/" and k.startswith(key))
            ]:
                del self.cluster.store[k]

    def increment(self, key: str, amount: int) -> int:
        with self._enter():
            value = int(self.cluster.store.get(key, "0")) + amount
            self.cluster.store[key] = str(value)
            self.cluster.cond.notify_all()
            return value

    def barrier(
        self, name: str, timeout: float, participants: Sequence[int] | None = None
    ) -> Barrier:
        wanted = frozenset(range(self.cluster.n) if participants is None else participants)
        cluster = self.cluster
        with self._enter():
            use = cluster.uses.get((name, self.process), 0)
            cluster.uses[(name, self.process)] = use + 1
            at = cluster.barriers.setdefault((name, use), _Use(wanted))
            if at.ended is not None:
                return at.ended  # a late arrival: the barrier is over
            listed = None if participants is None else len(participants)
            # A participant list of another process, or one naming a process twice: refused.
            if at.participants != wanted or listed not in (None, len(wanted)):
                at.ended = Barrier.REFUSED
            at.arrived.add(self.process)
            if at.ended is None and at.arrived >= at.participants:
                at.ended = Barrier.PASSED
            cluster.cond.notify_all()
            ended = cluster.cond.wait_for(lambda: at.ended, timeout)
            if ended is None:
                at.ended = ended = Barrier.TIMED_OUT
                cluster.cond.notify_all()
            return ended
