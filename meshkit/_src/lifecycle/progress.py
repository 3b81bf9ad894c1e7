"""What counts as a process's progress: the one record of its steps, and `Sampler`.

The program's thread hands each step of `meshkit.global_batches` to `step`, once: it feeds
`steps`, the record every guard reads (preemption's step, stragglers' times, the service
thread's activity), and a profile of those steps. The service thread samples progress: meshkit
sees a call or a step, the main thread's stack changes or it runs, a thread runs or waits for a
CPU, device work completes. `stall` acts on a process that shows none.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import CodeType
from typing import Any, TypeVar

import jax

from ..core import events as _events
from ..core.frames import is_program_thread, program_thread
from . import profiles as _profiles

# A thread that wanted a CPU this share of an interval, and waited RUN_SHARE of it, was starved.
DEMAND_SHARE = 0.5
# A thread that ran (or waited runnable) this share of an interval is running, not waiting
# (measured: a blocked wait 0.02-0.04%, a computation in one C call ~100%).
RUN_SHARE = 0.1
_MAX_REFS = 8192  # live arrays watched for being freed (a count covers the rest)
_MAX_PENDING = 256  # pending arrays watched for completing

R = TypeVar("R")


@dataclass(frozen=True)
class ServiceBoard:
    """Texts the processes post under one prefix of the coordination service.

    The stall records and the windows of step times, as the coordination layer hands them in:
    ``post(name, text)`` writes ``name``, ``read()`` returns every name and text posted,
    ``drop(name)`` deletes one.
    """

    post: Callable[[str, str], None]
    read: Callable[[], dict[str, str]]
    drop: Callable[[str], None]

    def put(self, me: int, record: Any) -> None:
        """Post process ``me``'s ``record`` (a dataclass) under its id."""
        self.post(str(me), json.dumps(asdict(record)))

    def records(self, kind: Callable[..., R], posted: dict[str, str] | None = None) -> dict[int, R]:
        """Every process's record (of ``kind``) in ``posted`` (None: posted now)."""
        posted = self.read() if posted is None else posted
        return {int(k): kind(**json.loads(v)) for k, v in posted.items() if k.isdigit()}


@dataclass
class Steps:
    """This process's steps: the program's thread writes, the loader's and the service's read.

    Unlocked: a reader that sees a field late only hears of a step a sample later.
    """

    number: int | None = None  # the program's step: global_batches' last, or should_save's
    marks: int = 0  # meshkit calls, barriers and steps (`note_progress`)
    taken: int = 0  # steps of `meshkit.global_batches`, over every loop
    wall: float = 0.0  # from the first step's batch to the last's
    data: float = 0.0  # waiting for the batches
    loads: int = 0  # batches the loader gave (ahead of the steps, as far as prefetching goes)
    loader: float = 0.0  # the loader's seconds for them
    last: float = -1.0  # when the last batch arrived (perf_counter)
    aside: float = 0.0  # of ``wall``: compiles and checkpoints between two batches
    seen: float = 0.0  # `events.totals`' ``aside`` when the last batch arrived

    def now(self) -> tuple[float, ...]:
        """What a window of step times sums (`stragglers`)."""
        return self.taken, self.wall, self.data, self.loads, self.loader


steps = Steps()


def step(n: int, asked: float, got: float) -> None:
    """In the program's thread: step ``n``, its batch asked for at ``asked``, got at ``got``."""
    s, aside = steps, _events.totals["aside"]
    if s.last >= 0.0:  # the compiles and checkpoints before the first batch are not in wall
        s.wall += got - s.last
        s.aside += aside - s.seen
    s.seen, s.last = aside, got
    s.data += got - asked
    s.taken += 1
    s.marks += 1
    s.number = n
    if _profiles.active is not None:  # a trace of some steps was asked for
        _profiles.active.step(n)


def loaded(seconds: float) -> None:
    """In the loader's thread: the program's loader took ``seconds`` for one batch."""
    steps.loader += seconds
    steps.loads += 1


def note_progress() -> None:
    """Count progress seen by meshkit itself (a call, a barrier)."""
    steps.marks += 1


Stack = tuple[tuple[CodeType, int], ...]


class _Arrays:
    """Weak references to this process's live arrays and to those still pending."""

    def __init__(self) -> None:
        arrays = jax.live_arrays()
        self.count = len(arrays)
        self.refs = [weakref.ref(a) for a in arrays[:_MAX_REFS]]
        self.pending = [weakref.ref(a) for a in arrays if pending(a)][:_MAX_PENDING]

    def changed_since(self, before: _Arrays) -> bool:
        """Whether an array was made or freed, or one pending before has completed."""
        if self.count != before.count or any(r() is None for r in before.refs):
            return True
        return any(not pending(r()) for r in before.pending)


def pending(array: Any) -> bool:
    """Whether ``array`` is live and its value not computed yet."""
    if array is None:
        return False
    try:
        return not array.is_deleted() and not array.is_ready()
    except RuntimeError:  # deleted (donated) by another thread between the two questions
        return False


def main_native_id() -> int | None:
    """The kernel's id of the program's thread (`meshkit._src.core.frames.program_thread`)."""
    # Asked from the thread itself: ``main_thread().native_id`` is stale after ``os.fork``.
    if is_program_thread():
        return threading.get_native_id()
    return program_thread().native_id


class Sampler:
    """Tells, sample after sample, whether this process moved since the previous sample."""

    def __init__(self, main: int, native_id: int | None = None) -> None:
        self.main = main
        self.clock = cpu_clock(main)
        path = f"/proc/self/task/{native_id}/schedstat"
        self.schedstat = path if native_id is not None and os.path.exists(path) else None
        self.mark = steps.marks
        self.stack: Stack | None = self._stack()
        self.cpu = self._cpu()
        self.arrays: _Arrays | None = None
        self.threads: dict[str, tuple[int, int]] | None = None
        self.me = str(threading.get_native_id())  # the sampling thread, left out of `threads`

    def moved(self, interval: float) -> str | None:
        """What moved since the last sample (for messages), or None: nothing did."""
        reason = None
        mark, stack, cpu = steps.marks, self._stack(), self._cpu()
        if mark != self.mark:
            reason = "meshkit call"
        elif stack != self.stack:
            reason = "main thread moved"
        elif cpu is not None and self.cpu is not None and cpu - self.cpu >= RUN_SHARE * interval:
            reason = "main thread ran"
        self.mark, self.stack, self.cpu = mark, stack, cpu
        if reason is not None:
            # Read the threads and the arrays only while everything else stands still.
            self.arrays = self.threads = None
            return reason
        threads = _threads(self.me) if self.schedstat is not None else None
        before, self.threads = self.threads, threads
        if threads is not None and before is not None and _busy(before, threads, interval):
            self.arrays = None
            return "a thread ran"
        arrays = _Arrays()
        before, self.arrays = self.arrays, arrays
        return "device work" if before is not None and arrays.changed_since(before) else None

    def _stack(self) -> Stack | None:
        frame = sys._current_frames().get(self.main)
        if frame is None:
            return None
        return tuple((f.f_code, f.f_lasti) for f, _ in traceback.walk_stack(frame))

    def _cpu(self) -> float | None:
        """Seconds the thread ran or waited, runnable, for a CPU; None once it has ended."""
        if self.schedstat is not None:
            ns = _read_schedstat(self.schedstat)
            return None if ns is None else sum(ns) / 1e9
        return self.clock()


def cpu_clock(thread: int) -> Callable[[], float | None]:
    """A reader of thread ``thread``'s CPU seconds (POSIX): None once it ended, or without one."""
    try:
        clock = time.pthread_getcpuclockid(thread)
    except (AttributeError, OSError, OverflowError):  # no such call here, or no such thread
        return lambda: None

    def read() -> float | None:
        try:
            return time.clock_gettime(clock)
        except OSError:  # the thread has ended
            return None

    return read


def _threads(besides: str) -> dict[str, tuple[int, int]] | None:
    """Per thread of this process (all but ``besides``): nanoseconds it ran, and waited runnable."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    found = {t: _read_schedstat(f"/proc/self/task/{t}/schedstat") for t in tasks if t != besides}
    return {t: ns for t, ns in found.items() if ns is not None}


def _read_schedstat(path: str) -> tuple[int, int] | None:
    """Nanoseconds a thread ran, and waited runnable; None once it has ended."""
    try:
        with open(path) as f:
            ran, waited = f.read().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def _busy(
    before: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]], interval: float
) -> bool:
    """Whether a thread ran `RUN_SHARE` of ``interval``, or was starved of a CPU.

    Starved: it wanted a CPU `DEMAND_SHARE` of ``interval`` and waited for one `RUN_SHARE` of it.
    """
    for task, (ran, waited) in now.items():
        if task in before:
            more_ran, more_waited = ran - before[task][0], waited - before[task][1]
            share = RUN_SHARE * interval * 1e9
            starved = more_ran + more_waited >= DEMAND_SHARE * interval * 1e9
            if more_ran >= share or (starved and more_waited >= share):
                return True
    return False
