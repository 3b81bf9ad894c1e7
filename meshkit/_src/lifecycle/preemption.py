"""Preemption: SIGTERM is a notice that the run will be stopped soon, not a failure.

The handler records the notice; the service thread tells JAX's sync managers and the other
processes, and they agree on a sync step (`reached_sync_point`, behind
`meshkit.checkpoint.should_save`). Every process ends ``MESHKIT_PREEMPT_GRACE`` s after the
notice (status 143) unless its program ended first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..core import env as _env
from ..core import events as _events
from ..core.events import DEFAULT_PREEMPT_GRACE_S, ENV_PREEMPT_GRACE
from ..core.log import logger, say
from . import exit as _exit
from . import progress as _progress

_LOG = logger("guards")

PREEMPTED = 128 + signal.SIGTERM  # the exit status of a preempted process: 143


@dataclass(frozen=True)
class PreemptionNotice:
    """A preemption notice this process knows of.

    Attributes:
        process: the process that received the notice (SIGTERM) first.
        received: when, in seconds since the epoch.
        deadline: when every process ends unless its program ended first (``received`` plus
            ``MESHKIT_PREEMPT_GRACE``).
        own: whether this process received it itself (else another process told it).

    Examples:
        >>> import meshkit
        >>> meshkit.PreemptionNotice(3, 0.0, 25.0, own=False).source
        'process 3'
    """

    process: int
    received: float
    deadline: float
    own: bool

    @property
    def source(self) -> str:
        """Who received it, in words: ``SIGTERM`` or ``process 3``."""
        return "SIGTERM" if self.own else f"process {self.process}"


@dataclass(frozen=True)
class Synced:
    """The sync step the processes agreed on after a notice."""

    step: int | None
    agreed: bool = True
    missing: tuple[int, ...] = ()


# Handed in at `install` by the coordination layer:
Tell = Callable[[PreemptionNotice], None]
Sync = Callable[[int | None, float, threading.Event], Synced]


def alone(answered: int | None, timeout: float, stop: threading.Event) -> Synced:
    """The sync step of a process alone: the step after the last one it answered (`Sync`)."""
    return Synced(None if answered is None else answered + 1)


class _State:
    """This process's preemption state (one instance; `install` resets it)."""

    def __init__(self) -> None:
        # Re-entrant: the SIGTERM handler may run inside a block that holds it.
        self.lock = threading.RLock()
        self.installed = False
        self.me = -1
        self.grace = DEFAULT_PREEMPT_GRACE_S
        self.tell: Tell | None = None
        self.sync: Sync | None = None
        self.notice: PreemptionNotice | None = None
        self.untold = False  # an own notice the others have not heard yet
        self.asked: int | None = None  # the last step `reached_sync_point` answered
        self.frozen = False  # step sent: questions wait for the agreement
        self.synced: Synced | None = None
        self.changed = threading.Condition(self.lock)  # `synced` set, or a save finished
        self.sync_step: int | None = None
        self.reached = False  # the next save is the last
        self.saves = 0  # checkpoint saves in progress
        self.reported = False  # the `preempted` event is written
        self.deadline_armed = False


_state = _State()


def _warn(text: str) -> None:
    say(_LOG, logging.WARNING, f"meshkit: {text}\n")


def grace() -> float:
    """``MESHKIT_PREEMPT_GRACE``: seconds from a notice to the end of every process (default 25)."""
    value = _env.seconds(ENV_PREEMPT_GRACE, where="meshkit.init()", positive=False)
    return DEFAULT_PREEMPT_GRACE_S if value is None else value


def install(me: int | None, *, seconds: float, tell: Tell | None, sync: Sync | None) -> None:
    """Take SIGTERM as a preemption notice in process ``me``."""
    with _state.lock:
        _state.grace, _state.tell, _state.sync = seconds, tell, sync
        if me is not None:
            _state.me = me
            own = _state.notice
            if own is not None and own.own and own.process < 0:  # received before it joined
                _state.notice = dataclasses.replace(own, process=me)
        first = not _state.installed
        _state.installed = True
    _exit.on_sigterm(lambda: receive(None))  # the handler takes the notice, nothing that waits
    if first:
        # Told, agreed and armed after each wake-up; while the program steps, told soon.
        _exit.tend(_tend, lambda: _progress.steps.number)
        _exit.on_exit("preemption: record how this process ended", _at_exit, order=_exit.STOP)
    _exit.wake()  # a notice received before ``tell`` was given is told now


def notice() -> PreemptionNotice | None:
    """The first preemption notice (SIGTERM) this process received or was told of, or None.

    meshkit tells every other process, and each ends ``MESHKIT_PREEMPT_GRACE`` seconds later
    unless its program ended first (save at `meshkit.checkpoint.should_save`'s step).

    Examples:
        >>> import meshkit
        >>> meshkit.preemption_notice() is None
        True
    """
    return _state.notice


def receive(told: PreemptionNotice | None) -> PreemptionNotice | None:
    """Take a notice: this process's SIGTERM (``told`` None) or one another process posted."""
    with _state.lock:
        if _state.notice is not None or not _state.installed:
            return _state.notice
        own = told is None
        if own:
            now = time.time()
            told = PreemptionNotice(_state.me, now, now + _state.grace, own=True)
            _state.untold = True
        _state.notice = told
    _exit.wake(nudge=own)  # in the main thread, between bytecodes: a request is safe there
    return told


def asked_step() -> int | None:
    """The step `meshkit.checkpoint.should_save` was last asked about (None: never)."""
    return _state.asked


def reached_sync_point(step: int) -> bool:
    """Whether ``step`` is the step at which every process saves after a notice."""
    with _state.lock:
        notice_ = _state.notice
        if notice_ is not None:  # a step sent: wait for the agreement (until the deadline)
            left = notice_.deadline - time.time()
            _state.changed.wait_for(lambda: not _state.frozen or _state.synced is not None, left)
        _state.asked = _progress.steps.number = step
        synced = _state.synced
        if synced is None or not synced.agreed or _state.reached:
            return False  # not agreed (yet); or saved for it already
        if _state.sync_step is None:
            # No process had answered a step before the notice: this first one, on each.
            _state.sync_step = step if synced.step is None else synced.step
        # The first step at or past it (steps asked may skip): the same on every process.
        _state.reached = step >= _state.sync_step
        return _state.reached


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Around a checkpoint save: the deadline waits for it to finish."""
    with _state.lock:
        _state.saves += 1
    try:
        yield
    finally:
        with _state.lock:
            _state.saves -= 1
            _state.changed.notify_all()


def saved(step: int | None) -> None:
    """A checkpoint save completed: after the sync point, the process ends (status 143)."""
    notice_ = _state.notice
    if notice_ is None or not _state.reached:
        return
    _event("saved", notice_, saved=step)
    _warn(
        f"preempted ({notice_.source}): saved step {step}; exiting with status {PREEMPTED} "
        "for the scheduler to start the run again."
    )
    raise SystemExit(PREEMPTED)


def _event(how: str, notice_: PreemptionNotice, saved: int | None = None) -> None:
    with _state.lock:
        if _state.reported:
            return
        _state.reported = True
    fields = {"source": notice_.source, "process": notice_.process, "received": notice_.received}
    _events.emit(_events.PREEMPTED, how=how, **fields, step=_progress.steps.number, saved=saved)


def _at_exit() -> None:
    """At a normal end after a notice: a ``preempted`` event (the status is the program's)."""
    notice_ = _state.notice
    if notice_ is not None and not _exit.ending():
        _event("ended", notice_)


def _end_at_deadline(notice_: PreemptionNotice) -> None:
    """The grace ran out: wait for a save in progress, then end this process (status 143)."""
    with _state.lock:
        _state.changed.wait_for(lambda: not _state.saves)
    if _exit.ending():
        return
    _event("deadline", notice_)
    number = _progress.steps.number
    step = "" if number is None else f" at step {number}"
    announce = (
        f"meshkit: preempted ({notice_.source} {max(0.0, time.time() - notice_.received):.1f} s "
        f"ago){step}: the program did not save and stop within {ENV_PREEMPT_GRACE}="
        f"{_state.grace:g} s; exiting with status {PREEMPTED}.\n"
    )
    _exit.end(PREEMPTED, grace=0.0, announce=announce, level=logging.WARNING)


def past_deadline() -> PreemptionNotice | None:
    """The notice whose deadline has passed, or None: the processes are ending for it."""
    notice_ = _state.notice
    return notice_ if notice_ is not None and time.time() >= notice_.deadline else None


def end_preempted(notice_: PreemptionNotice, why: str) -> None:
    """End this process as preempted now (status 143): ``why`` says what ended the others."""
    _event("deadline", notice_)
    text = f"meshkit: preempted ({notice_.source}): {why}; exiting with status {PREEMPTED}.\n"
    _exit.now(PREEMPTED, text, level=logging.WARNING)


def _tend() -> None:
    """In the service thread, after a notice: tell the others, agree, arm the deadline."""
    notice_ = _state.notice
    if notice_ is None:
        return
    _tell(notice_)
    _agree(notice_)
    with _state.lock:
        if _state.deadline_armed:
            return
        _state.deadline_armed = True
    left = max(0.0, notice_.deadline - time.time())
    _exit.at("preemption: the deadline", left, lambda: _end_at_deadline(notice_), nudge=False)


def _agree(notice_: PreemptionNotice) -> None:
    """Send the last step answered, and agree with the others on the sync step (once)."""
    with _state.lock:
        if _state.frozen or _state.sync is None:
            return  # agreed already; or joining: agreed once this process has joined
        _state.frozen = True
        answered, sync = _state.asked, _state.sync
    try:
        synced = sync(answered, max(0.0, notice_.deadline - time.time()), _exit.stopping)
    except Exception as e:  # the service is gone: no sync step, the deadline ends the run
        _warn(f"could not agree on a step to save at after the notice: {e}")
        synced = Synced(None, agreed=False)
    if not synced.agreed and not _exit.stopping.is_set():
        who = f"process(es) {', '.join(map(str, synced.missing))}" if synced.missing else (
            "some process")  # fmt: skip
        _warn(
            f"no step to save at after the preemption notice: {who} did not take part in "
            "time; the deadline ends the run."
        )
    with _state.lock:
        _state.synced = synced
        _state.changed.notify_all()


def _tell(notice_: PreemptionNotice) -> None:
    with _state.lock:
        if not _state.untold or _state.tell is None:
            return
        _state.untold = False
        tell = _state.tell
    try:
        tell(notice_)
    except Exception as e:  # the others learn it from JAX's protocol, or not at all
        _warn(f"could not tell the other processes of the preemption notice: {e}")
