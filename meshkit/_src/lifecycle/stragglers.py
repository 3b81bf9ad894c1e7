"""Step times per process, and the processes slower than the others (stragglers).

The program's thread records each step of `meshkit.global_batches` in `progress.steps` (two clock
reads, about 0.3 µs), its loader thread the time the program's loader took. Every `window`
seconds the service thread sums the steps since the last window, with the main thread's CPU time
(read from its CPU clock, not by the main thread): a step splits into waiting for the next batch,
host work (the main thread computing) and the rest (waiting for the devices or the other
processes). It posts the window for the others and writes the run's sums as a ``steps`` event;
process 0 reads every process's window and names the processes whose own work per step (host
work, and the loader's time when it kept the step waiting) holds the others back (`stragglers`)
in two windows in a row. A window without steps posts nothing.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..core import env as _env
from ..core import events as _events
from ..core.events import StepRow as StepRow
from ..core.frames import program_thread, public
from ..core.log import logger, say
from . import exit as _exit
from . import progress as _progress
from .progress import ServiceBoard, cpu_clock

_LOG = logger("guards")

ENV_STEP_WINDOW = "MESHKIT_STEP_WINDOW"
MARGIN = 1.25  # a straggler's own work per step is this many times the median, or more
FLOOR_MS = 2.0  # ... and this many milliseconds more than the median


@dataclass(frozen=True)
class Straggler:
    """A process slower than the others, and by how much."""

    process: int
    ratio: float  # its own work per step over the median's
    part: str  # "waiting for data" or "host work": what it spends the most above the median
    extra_ms: float  # ... and by how much

    def __str__(self) -> str:
        return (
            f"process {self.process}: {self.ratio:.1f}x the median step's own work, "
            f"+{self.extra_ms:.0f} ms {self.part}"
        )


def holding_ms(row: StepRow) -> float:
    """The work per step by which a process can hold the others back.

    Its host work, and its loader's time when the loader made its own main thread wait (else
    prefetching hid it).
    """
    return row.host_ms + (row.loader_ms if row.data_ms >= FLOOR_MS else 0.0)


def stragglers(rows: Sequence[StepRow]) -> list[Straggler]:
    """The processes that hold the others back, slowest first.

    A process's `holding_ms` is `MARGIN` times the median's or more, and `FLOOR_MS` more.
    """
    if len(rows) < 2:
        return []
    median = statistics.median(holding_ms(r) for r in rows)
    loader = statistics.median(r.loader_ms for r in rows)
    host = statistics.median(r.host_ms for r in rows)
    found = []
    for r in rows:
        own = holding_ms(r)
        if own >= MARGIN * median and own - median >= FLOOR_MS:
            part, extra = max(
                ("in its data loader", r.loader_ms - loader), ("of host work", r.host_ms - host),
                key=lambda p: p[1],
            )  # fmt: skip
            ratio = own / median if median > 0 else float("inf")
            found.append(Straggler(r.process, ratio, part, extra))
    return sorted(found, key=lambda s: -s.ratio)


def _compiling() -> float:
    return _events.totals["seconds"] + _events.totals["tracing"]


def clock() -> tuple[float, float]:
    """Now, and the seconds compiled so far: the start of a save or a restore (`checkpointed`)."""
    return time.monotonic(), _compiling()


def checkpointed(part: str, since: tuple[float, float]) -> dict[str, float]:
    """The ``seconds`` of a save or restore begun at ``since`` (`clock`), and its ``compiling``.

    The rest is counted as ``part`` ("saving", "restoring"); the compiles in it were, as compiling.
    """
    seconds, compiling = time.monotonic() - since[0], _compiling() - since[1]
    _events.count(**{part: max(seconds - compiling, 0.0)})
    return {"seconds": round(seconds, 4), "compiling": round(compiling, 4)}


def spent() -> dict[str, float]:
    """This process's seconds compiling, saving and restoring so far (`RuntimeInfo.goodput`)."""
    return {"compiling": _compiling(), "saving": _events.totals["saving"],
            "restoring": _events.totals["restoring"]}  # fmt: skip


def steps_s() -> float:
    """This process's steps so far: their wall time less the compiles and checkpoints between."""
    return _progress.steps.wall - _progress.steps.aside


def _row(me: int, steps: int, before: tuple[float, ...], now: tuple[float, ...]) -> StepRow:
    """The means per step between two readings ``(steps, wall, data, loads, loader, cpu)``.

    The loader's is per batch loaded: prefetching loads ahead of the steps.
    """
    n, wall, data, loads, loader, cpu = (b - a for a, b in zip(before, now, strict=True))
    host = min(max(cpu, 0.0), max(wall - data, 0.0))
    per_load = loader / loads if loads > 0 else 0.0
    parts = (wall / n, data / n, per_load, host / n, (wall - data - host) / n)
    return StepRow(me, steps, *(round(x * 1000.0, 3) for x in parts))


class _Windows:
    """The service thread's task: one window every ``window`` s."""

    def __init__(self, me: int, board: ServiceBoard | None, window: float) -> None:
        self.me, self.board, self.window = me, board, window
        self.clock = cpu_clock(program_thread().ident or 0)
        self.first = self.then = (*_progress.steps.now(), self._cpu())
        self.latest: StepRow | None = None
        self.named: frozenset[int] = frozenset()  # said already
        self.suspects: frozenset[int] = frozenset()  # stragglers in the last window

    def _cpu(self) -> float:
        return self.clock() or 0.0

    def turn(self, *, last: bool = False) -> None:
        if not last:
            if _exit.stopping.is_set():  # this process ends: the last window was its last
                return
            _exit.at(_TASK, self.window, self.turn, nudge=False)
        now = (*_progress.steps.now(), self._cpu())
        before, self.then = self.then, now
        if now[0] <= before[0]:  # no step in this window: nothing to say
            return
        steps = int(now[0] - self.first[0])
        self.latest = row = _row(self.me, steps, before, now)
        run = asdict(_row(self.me, steps, self.first, now))  # the whole run, for the launcher
        _events.emit(_events.STEPS, **run, aside=round(_progress.steps.aside, 4))
        if self.board is None or last:
            return
        with contextlib.suppress(Exception):  # a lost window only delays a straggler's name
            self.board.put(self.me, row)
            if self.me == 0:
                self._name(list(self.board.records(StepRow).values()))

    def _name(self, table: list[StepRow]) -> None:
        found = {s.process: s for s in stragglers(table)}
        persistent = self.suspects & found.keys()  # two windows in a row
        self.suspects = frozenset(found)
        new = persistent - self.named
        self.named = frozenset(persistent)
        if new:
            said = "; ".join(str(found[p]) for p in sorted(new, key=lambda p: -found[p].ratio))
            median = statistics.median(r.step_ms for r in table)
            say(
                _LOG,
                logging.WARNING,
                f"meshkit: slower than the other processes, two windows in a row: {said} (the "
                f"median step takes {median:.0f} ms; the others wait for it at each step's "
                "collective). meshkit.step_times() has every process's row.\n",
            )
            _events.emit(
                _events.STRAGGLER, processes=sorted(new),
                said=[str(found[p]) for p in sorted(new)],
            )  # fmt: skip


_TASK = "stragglers: a window"
_windows: _Windows | None = None


def window_s() -> float | None:
    """``MESHKIT_STEP_WINDOW`` (default 30 s; 0: off), refused early when not seconds."""
    return _env.seconds(ENV_STEP_WINDOW, where="meshkit.init()", zero="off", default=30.0) or None


def install(me: int, board: ServiceBoard | None, window: float) -> None:
    """Sum steps into windows every ``window`` s for process ``me`` (``board``: several)."""
    global _windows
    windows = _windows = _Windows(me, board, window)
    _exit.at(_TASK, window, windows.turn, nudge=False)
    # The steps since the last window, in the run's sums for the launcher.
    _exit.on_exit("step times: the last window", lambda: windows.turn(last=True), order=_exit.STOP)


@public
def step_times() -> list[StepRow]:
    """Every process's step times in its latest window, the slowest own work first.

    Each process sums the steps of `meshkit.global_batches` into windows of
    ``MESHKIT_STEP_WINDOW`` seconds (default 30): per step, the wall time, the time waiting for
    data, the host work, and the rest (waiting for the devices or for the other processes).
    Reading the others' rows takes one request to the coordination service. Empty before the
    first window with steps, or without `meshkit.init`.

    Examples:
        >>> import meshkit
        >>> [row.process for row in meshkit.step_times()]  # no window yet in this process
        []
    """
    windows = _windows
    if windows is None:
        return []
    table = list(windows.board.records(StepRow).values()) if windows.board is not None else []
    if not table and windows.latest is not None:
        table = [windows.latest]
    return sorted(table, key=lambda r: (-r.own_ms, r.process))
