"""The stall watchdog (debug mode): what counts as progress, and what a stall does.

Progress: the main thread's stack changes or it runs, device work completes, a thread is
starved of CPU, or meshkit sees a call. A stall prints every thread's stack and a ``stalled``
event; with ``exit_on_stall`` the process exits 1 later (``docs/hangs.md``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import jax

from ..core import compat as _compat
from ..core import events as _events
from ..core.events import INSIDE, OUTSIDE, WATCHDOG_MARK
from ..core.frames import in_meshkit, is_program_thread, program_thread, short_path, user_frame
from ..core.log import flush as flush_logs
from ..core.log import logger, say
from . import exit as _exit

_LOG = logger("guards")

# A thread that ran (or waited runnable) this share of an interval is running, not waiting
# (measured: a blocked wait 0.02-0.04%, a computation in one C call ~100%).
RUN_SHARE = 0.1
# A thread that wanted a CPU this share of an interval, and waited RUN_SHARE of it, was starved.
DEMAND_SHARE = 0.5
_MAX_REFS = 8192  # live arrays watched for being freed (a count covers the rest)
_MAX_PENDING = 256  # pending arrays watched for completing

_marks = 0


def note_progress() -> None:
    """Count progress seen by meshkit itself (a call, a barrier, a delivered batch)."""
    global _marks
    _marks += 1


Stack = tuple[tuple[CodeType, int], ...]


class _Arrays:
    """Weak references to this process's live arrays and to those still pending."""

    def __init__(self) -> None:
        arrays = jax.live_arrays()
        self.count = len(arrays)
        self.refs = [weakref.ref(a) for a in arrays[:_MAX_REFS]]
        self.pending = [weakref.ref(a) for a in arrays if _pending(a)][:_MAX_PENDING]

    def changed_since(self, before: _Arrays) -> bool:
        """Whether an array was made or freed, or one pending before has completed."""
        if self.count != before.count or any(r() is None for r in before.refs):
            return True
        return any(not _pending(r()) for r in before.pending)


def _pending(array: Any) -> bool:
    if array is None:
        return False
    try:
        return not array.is_deleted() and not array.is_ready()
    except RuntimeError:  # deleted (donated) by another thread between the two questions
        return False


def _main_native_id() -> int | None:
    """The kernel's id of the program's thread (`meshkit._src.core.frames.program_thread`)."""
    # Asked from the thread itself: ``main_thread().native_id`` is stale after ``os.fork``.
    if is_program_thread():
        return threading.get_native_id()
    return program_thread().native_id


class _Sampler:
    """Tells, sample after sample, whether this process moved since the previous sample."""

    def __init__(self, main: int, native_id: int | None = None) -> None:
        self.main = main
        try:  # the thread's CPU-time clock (POSIX)
            self.clock: int | None = time.pthread_getcpuclockid(main)
        except (AttributeError, OSError, OverflowError):  # no such call here, or no such thread
            self.clock = None
        path = f"/proc/self/task/{native_id}/schedstat"
        self.schedstat = path if native_id is not None and os.path.exists(path) else None
        self.mark = _marks
        self.stack: Stack | None = self._stack()
        self.cpu = self._cpu()
        self.arrays: _Arrays | None = None
        self.threads: dict[str, tuple[int, int]] | None = None
        self.me = str(threading.get_native_id())  # the sampling thread, left out of `threads`

    def moved(self, interval: float) -> str | None:
        """What moved since the last sample (for messages), or None: nothing did."""
        reason = None
        mark, stack, cpu = _marks, self._stack(), self._cpu()
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
        if threads is not None and before is not None and _starved(before, threads, interval):
            self.arrays = None
            return "a thread was starved"
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
        if self.clock is None:
            return None
        try:
            return time.clock_gettime(self.clock)
        except OSError:  # the thread has ended
            return None


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


def _starved(
    before: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]], interval: float
) -> bool:
    """Whether a thread wanted a CPU `DEMAND_SHARE` of ``interval`` and waited `RUN_SHARE`."""
    for task, (ran, waited) in now.items():
        if task in before:
            more_ran, more_waited = ran - before[task][0], waited - before[task][1]
            demand = more_ran + more_waited >= DEMAND_SHARE * interval * 1e9
            if demand and more_waited >= RUN_SHARE * interval * 1e9:
                return True
    return False


class Watchdog:
    """Dumps this process's stacks after ``after`` seconds without progress, then may exit."""

    def __init__(
        self, after: float, timeout: float, exit_on_stall: bool, last_call: Callable[[], str]
    ) -> None:
        self.after, self.timeout, self.exit_on_stall = after, timeout, exit_on_stall
        self.last_call = last_call
        self.stop = threading.Event()
        self.main = program_thread().ident or 0
        self.main_native_id = _main_native_id()
        self.period = min(1.0, after / 4)
        self.sampler: _Sampler | None = None
        self.then = self.progress = time.monotonic()
        self.dumped = False

    def start(self) -> None:
        """Take the first sample one period from now."""
        _exit.at("watchdog: sample", self.period, self._sample)

    def _sample(self) -> None:
        if self.stop.is_set():
            return
        _exit.at("watchdog: sample", self.period, self._sample, nudge=False)
        if _compat.distributed_state()[2] == 1:
            return  # one process: nobody to wait for, and no run to end
        now = time.monotonic()
        if self.sampler is None:
            self.sampler = _Sampler(self.main, self.main_native_id)
            moved: str | None = "started"
        else:
            moved = self.sampler.moved(now - self.then)
        self.then = now
        if moved is not None:
            self.progress, self.dumped = now, False  # re-armed
            return
        idle = now - self.progress
        if not self.dumped and idle >= self.after:
            self.dumped = True
            self._dump(idle)
        elif self.dumped and self.exit_on_stall and idle >= self.after + self.timeout:
            _, me, _ = _compat.distributed_state()
            _exit.now(
                1,
                f"{WATCHDOG_MARK} process {me} still made no progress after "
                f"{idle:.0f} s; exiting with status 1 so that the whole run ends instead of "
                "hanging (meshkit.debug.enable(exit_on_stall=False) keeps waiting).\n",
            )

    def _dump(self, idle: float) -> None:
        _, me, _ = _compat.distributed_state()
        frame = sys._current_frames().get(self.main)
        here = frame_text(frame) if frame is not None else "?"
        inside = frame is not None and in_meshkit(frame)
        where = INSIDE if inside else OUTSIDE
        last = self.last_call()
        _events.emit(_events.STALLED, inside=inside, frame=here, idle=round(idle, 1), last=last)
        say(
            _LOG,
            logging.WARNING,
            f"{WATCHDOG_MARK} process {me} made no progress for {idle:.0f} s (its "
            f"main thread waited in one place, no device work completed, no meshkit call); "
            f"main thread now {here}, {where}; last meshkit call: "
            f"{last or 'none'}. Stacks follow.\n",
        )
        # faulthandler writes from C, taking no lock a stuck thread may hold (logging could).
        flush_logs()
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        with contextlib.suppress(Exception):
            sys.stderr.flush()


def frame_text(frame: FrameType) -> str:
    """``in f (file:line), called from g (user.py:12)``: innermost frame, innermost user frame."""
    user = user_frame(frame)
    called = f", called from {_named(user)}" if user is not None and user is not frame else ""
    return f"in {_named(frame)}{called}"


def _named(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({short_path(frame.f_code.co_filename)}:{frame.f_lineno})"
