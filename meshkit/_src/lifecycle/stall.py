"""Stalls: a run in which no process makes progress is explained, then ended.

Each process samples its own progress in the service thread (`progress.Sampler`: meshkit's
steps, the main thread's stack or CPU, a busy thread, device work completing). A process without
progress for `Settings.report_after` seconds posts its `StallRecord` and reads the others'; once
every process has posted one, each says the same `verdict`: which processes hold the run, and
where each waits. When no process has made progress for `Settings.deadline` seconds, every
process ends with status 1 (``docs/hangs.md``). A process that moves again takes its record
back; while the processes make progress nothing is posted or read.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from types import FrameType

import jax

from ..core import env as _env
from ..core import events as _events
from ..core.frames import in_meshkit, place, program_thread, short_path, user_frame, user_place
from ..core.log import flush as flush_logs
from ..core.log import logger, say
from . import exit as _exit
from . import progress as _progress
from .progress import ServiceBoard

_LOG = logger("guards")

ENV_STALL_TIMEOUT = "MESHKIT_STALL_TIMEOUT"
REPORT_PARTS = 5  # the report comes after a fifth of the deadline
_LAST_PERIOD_S = 5.0  # samples are at most this far apart
_STACK_FRAMES = 12  # of the main thread, in a record

# What a stalled process's main thread waits on:
DEVICE = "device"  # a device result that stays pending (a collective the others have not run)
MESHKIT = "meshkit"  # inside a meshkit call (an agreement with the others)
PYTHON = "python"  # the program's own code: nothing waits for the others there
_JAX_DIR = os.path.dirname(jax.__file__ or "") + os.sep
_LOADER = "meshkit-global-batches"  # the name of `global_batches`' prefetch thread
_CHECKPOINT_DIR = f"{os.sep}orbax{os.sep}"
_CHECKPOINT_CODE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "checkpoint") + os.sep


@dataclass(frozen=True)
class Settings:
    """When a stall is reported, and when it ends the run.

    Attributes:
        report_after: seconds without progress before the processes compare records and say
            the verdict (once per stall).
        deadline: seconds without progress on every process before each ends with status 1;
            None: report only.
        source: where the deadline comes from, in words ("": ``MESHKIT_STALL_TIMEOUT``).
    """

    report_after: float
    deadline: float | None
    source: str = ""

    @property
    def period(self) -> float:
        """Seconds between two samples."""
        return min(_LAST_PERIOD_S, max(0.1, self.report_after / 4))


def settings() -> Settings | None:
    """``MESHKIT_STALL_TIMEOUT`` (default 300 s; 0: off) as `Settings`; None when off."""
    deadline = _env.seconds(ENV_STALL_TIMEOUT, where="meshkit.init()", zero="off", default=300.0)
    return Settings(deadline / REPORT_PARTS, deadline) if deadline else None


@dataclass(frozen=True)
class StallRecord:
    """What one stalled process posts: where its main thread is, and what it waits on."""

    process: int
    idle: float  # seconds without progress when posted
    state: str  # DEVICE, MESHKIT or PYTHON
    where: str  # the user's line: ``train.py:39 in main``
    inner: str  # the innermost frame, when not the user's: ``threading.py:629 in wait``
    step: str  # what meshkit counted: ``step 5 of meshkit.global_batches``, or ""
    stack: str  # the main thread's innermost frames, formatted


def record(me: int, idle: float, main: int, step: str) -> StallRecord:
    """The record of process ``me``, whose main thread has the id ``main``.

    A main thread inside a meshkit call that waits for its own loader (the thread of
    `meshkit.global_batches`, stuck in the program's code) is in Python there.
    """
    frames = sys._current_frames()
    frame = frames.get(main)
    if frame is None:
        return StallRecord(me, idle, PYTHON, "?", "", step, "")
    if in_meshkit(frame):
        state = MESHKIT
    elif frame.f_code.co_filename.startswith(_JAX_DIR) or any(
        _progress.pending(a) for a in jax.live_arrays()
    ):
        state = DEVICE  # a result that stays pending waits for a collective others have not run
    else:
        state = PYTHON
    if state == MESHKIT:
        for thread in threading.enumerate():
            loader = frames.get(thread.ident or -1)
            if thread.name.startswith(_LOADER) and user_frame(loader) is not None:
                frame, state, step = loader, PYTHON, f"{step}; in {thread.name}".lstrip("; ")
                break
    assert frame is not None
    where = user_place(frame) or place(frame)
    code = frame.f_code
    inner = f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
    inner = "" if where.startswith(f"{short_path(code.co_filename)}:{frame.f_lineno} ") else inner
    stack = "".join(traceback.format_stack(frame, limit=_STACK_FRAMES))
    return StallRecord(me, round(idle, 1), state, where, inner, step, stack)


def in_checkpoint(frame: FrameType | None) -> bool:
    """Whether ``frame``'s stack saves or restores a checkpoint (orbax, or meshkit's own)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if _CHECKPOINT_DIR in name or name.startswith(_CHECKPOINT_CODE):
            return True
        frame = frame.f_back
    return False


@dataclass(frozen=True)
class Verdict:
    """What every process says of a stall."""

    holding: tuple[int, ...]  # the processes that hold the run (none: nobody to blame)
    why: str  # one sentence: who holds the run, or why nobody does
    places: str  # a line per place, naming the processes there
    stacks: str  # the main-thread stacks of the processes that hold the run
    idle: float  # seconds without progress on every process, as the records said

    def text(self, then: str = "") -> str:
        """The whole verdict, ``then`` after its first sentences."""
        head = f"meshkit: no process has made progress for {self.idle:.0f} s. {self.why}"
        return f"{head}{then}\n{self.places}{self.stacks}"


def _who(processes: list[int]) -> str:
    return f"process {processes[0]}" if len(processes) == 1 else (
        "processes " + ", ".join(map(str, processes))
    )  # fmt: skip


def verdict(records: Mapping[int, StallRecord]) -> Verdict:
    """What every process says of a stall, from every process's record.

    A process in its own Python code holds the run when others wait for device results or at a
    meshkit agreement: they wait for a collective it has not reached.
    """
    ordered = sorted(records.values(), key=lambda r: (r.state != PYTHON, r.process))
    groups: dict[tuple[str, str, str, str], list[int]] = {}
    for r in ordered:
        groups.setdefault((r.state, r.where, r.inner, r.step), []).append(r.process)
    lines = []
    for (state, where, inner, step), ps in groups.items():
        many = len(ps) > 1
        what = {
            DEVICE: f"wait{'' if many else 's'} for device results at {where}",
            MESHKIT: f"wait{'' if many else 's'} inside a meshkit call at {where}",
            PYTHON: f"{'are' if many else 'is'} in Python at {where}",
        }[state]
        more = "".join(f", {part}" for part in (f"in {inner}" if inner else "", step) if part)
        lines.append(f"  {_who(ps)} {what}{more}\n")
    holding = tuple(r.process for r in ordered if r.state == PYTHON)
    waiting = [r.process for r in ordered if r.state != PYTHON]
    idle = min(r.idle for r in ordered)
    if holding and waiting:
        they = "it has" if len(holding) == 1 else "they have"
        why = (
            f"{_who(list(holding)).capitalize()} hold{'s' if len(holding) == 1 else ''} the run: "
            "the others "
            f"wait for a collective or an agreement {they} not reached."
        )
    elif holding:
        why = "Every process is stuck in its own code; none waits for another or holds the run."
        holding = ()
    else:
        why = (
            "Every process waits for the others, so none holds the run: a collective that cannot "
            "complete (processes that ran different computations: a branch on "
            "jax.process_index() or on local data), or a device or network fault."
        )
    stacks = "".join(
        f"Process {p}'s main thread (most recent call last):\n{records[p].stack}"
        for p in holding[:2]
        if records[p].stack
    )
    return Verdict(holding, why, "".join(lines), stacks, idle)


_TASK = "stall: sample"


class Detector:
    """One process's stall detection, run by the service thread every `Settings.period` s."""

    def __init__(
        self, me: int, n: int, board: ServiceBoard, steps: Callable[[], str], settings: Settings
    ) -> None:
        self.me, self.n, self.board, self.steps = me, n, board, steps
        self.settings = settings
        self.main = program_thread().ident or 0
        self.main_native_id = _progress.main_native_id()  # asked here: stale after a fork
        self.sampler: _progress.Sampler | None = None
        self.seen = ""
        self.then = self.progress = time.monotonic()
        self.posted = False
        self.said = ""  # the places the last report said (a stall there again is not new)

    def _turn(self) -> None:
        if self is not _detector or _exit.ending() or _exit.stopping.is_set():
            return  # replaced by `install`, or this process ends
        _exit.at(_TASK, self.settings.period, self._turn, nudge=False)
        now = time.monotonic()
        steps = self.steps()
        if self.sampler is None:
            self.sampler = _progress.Sampler(self.main, self.main_native_id)
            moved: str | None = "started"
        else:
            moved = self.sampler.moved(now - self.then)
        if steps != self.seen:
            self.seen, moved = steps, "a meshkit step"
        elif moved is None and in_checkpoint(sys._current_frames().get(self.main)):
            moved = "a checkpoint"  # its writes may block for long: orbax's timeouts rule
        self.then = now
        if moved is not None:
            self.progress = now
            if self.posted:
                self.posted = False
                with contextlib.suppress(Exception):  # a stale record only delays a verdict
                    self.board.drop(str(self.me))
            return
        idle = now - self.progress
        if idle >= self.settings.report_after:
            self._compare(idle, steps)

    def _compare(self, idle: float, steps: str) -> None:
        mine = record(self.me, idle, self.main, steps)
        self.board.put(self.me, mine)
        self.posted = True
        posted = self.board.read()
        decided = posted.get("verdict")
        if decided is not None:
            fields = json.loads(decided)
            self._end(Verdict(**{**fields, "holding": tuple(fields["holding"])}))
            return
        records = self.board.records(StallRecord, posted)
        if len(records) < self.n:  # another process makes progress: no stall of the run
            return
        found = verdict(records)
        deadline = self.settings.deadline
        if found.places != self.said:
            _events.emit(
                _events.STALLED, idle=round(idle, 1), state=mine.state, frame=mine.where,
                inside=mine.state == MESHKIT, holding=list(found.holding),
            )  # fmt: skip
            ends = "" if deadline is None else (
                f" The run ends if no process moves for {deadline:g} s "
                f"({self.settings.source or ENV_STALL_TIMEOUT})."
            )  # fmt: skip
            say(_LOG, logging.WARNING, found.text(ends))
            self.said = found.places
        oldest = min(r.idle for r in records.values()) + self.settings.period
        if deadline is not None and idle >= deadline and oldest >= deadline:
            self.board.post("verdict", json.dumps(asdict(found)))
            self._end(found)

    def _end(self, found: Verdict) -> None:
        """Say ``found``, exit with status 1."""
        if not _exit.claim():
            return
        at = self.settings
        named = at.source or f"{ENV_STALL_TIMEOUT}={at.deadline:g}; 0 turns the end off"
        ends = f" Process {self.me} ends with status 1 ({named})."
        if found.places == self.said:  # said in full at the report: once is enough
            say(_LOG, logging.ERROR, f"meshkit: still no progress after {found.idle:.0f} s "
                f"(the places above).{ends}\n")  # fmt: skip
        else:
            say(_LOG, logging.ERROR, found.text(ends))
        if self.me in found.holding or not found.holding:  # every thread, from C (no lock)
            flush_logs()
            with contextlib.suppress(Exception):
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _events.emit(_events.FAILED, cause="stall", processes=list(found.holding), error="stall")
        _exit.now(1)


_detector: Detector | None = None
_installed: Settings | None = None  # what `install` was given (`configure(None)` returns to it)


def install(me: int, n: int, board: ServiceBoard, steps: Callable[[], str], at: Settings) -> None:
    """Start stall detection for process ``me`` of ``n`` (again: with ``at`` from now)."""
    global _detector, _installed
    _detector, _installed = Detector(me, n, board, steps, at), at
    _exit.at(_TASK, at.period, _detector._turn)  # the first sample one period from now


def configure(at: Settings | None) -> None:
    """Detect with ``at`` from now on (debug mode's watchdog); None: as installed."""
    detector, chosen = _detector, at or _installed
    if detector is not None and chosen is not None and chosen != detector.settings:
        detector.settings = chosen  # the turn due replaced: the next one period of it from now
        _exit.at(_TASK, chosen.period, detector._turn)
