"""Watch a running launch: failures, the end, the timeout, signals, and who is where.

`Supervisor.look` is one look at the run (its ranks' exits, the launcher's signals, the clock,
the board of stages while the cluster forms, the processes the ranks started); `watch` looks
until the run is over and says why it ended. When the ranks end, the board gets one last look
before the run is over, however soon after the previous one: ranks that join and finish between
two looks are still reported as the cluster that formed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType

from ..core.errors import ranges
from ..core.events import STAGES
from .reaper import Guardian, Reaper
from .spawn import Rank
from .stop import POLL_S

_WAITING = ("starting", "joining")  # the ranks' stages (`events.mark`) before they joined
_ARRIVED = ("joined", "running")


def joined(directory: Path, ranks: Iterable[int]) -> set[int]:
    """The ranks whose status file says they joined the cluster (``joined`` or ``running``)."""
    return {r for r in ranks if _written(directory, r) in _ARRIVED}


def unjoined_report(alone: Sequence[int], n: int) -> str:
    """Why a run whose ranks all exited 0 failed: some never joined the program."""
    if len(alone) == n:
        who, they = "none joined the program (none called meshkit.init())", "each"
    else:
        word = "ranks" if len(alone) > 1 else "rank"
        who = f"{word} {ranges(alone)} never joined the program (no meshkit.init() call)"
        they = "each of those"
    return (
        f"meshkit launch: every rank exited 0, but {who}: {they} ran alone, as a program of one "
        "process on its own devices, and what it printed is what one process computes, not "
        f"the answer of one {n}-process program.\n"
        "Consider calling meshkit.init() first in the program, or --allow-unjoined "
        "(launch(allow_unjoined=True)) to run independent processes on purpose.\n"
    )


def _written(directory: Path, rank: int) -> str:
    """What ``rank``'s status file says ("" before it wrote one)."""
    try:
        return (directory / f"rank{rank}").read_text().strip()
    except OSError:  # not written yet
        return ""


def summary(stages: Mapping[int, str]) -> str:
    """``ranks 0-2 joining; rank 3 starting``: every rank once, grouped by stage."""
    parts = []
    for stage in ("joined", "running", "joining", "starting", "exited"):
        ranks = [r for r, s in stages.items() if s == stage]
        if ranks:
            word = "rank" if len(ranks) == 1 else "ranks"
            parts.append(f"{word} {ranges(ranks)} {stage}")
    return "; ".join(parts)


class Board:
    """The launcher's view of the ranks' stages, and when to say it."""

    after, every = 2.0, 5.0  # seconds after the first join, then between repeats of one line

    def __init__(self, directory: Path, ranks: int | Iterable[int]) -> None:
        self.directory = directory
        self.ranks = list(range(ranks) if isinstance(ranks, int) else ranks)
        self.first_join: float | None = None  # seconds into the run when a rank left `starting`
        self.said_at: float | None = None
        self.said = ""
        self.done = False

    def stages(self, exits: Mapping[int, int | None]) -> dict[int, str]:
        """Each rank's stage, from its status file (``starting`` before it wrote one)."""
        out = {}
        for r in self.ranks:
            text = _written(self.directory, r)
            stage = text if text in STAGES else "starting"
            if exits.get(r) is not None and stage not in _ARRIVED:
                stage = "exited"
            out[r] = stage
        return out

    def line(
        self, stages: Mapping[int, str], elapsed: float, others: Mapping[str, str] | None = None
    ) -> str | None:
        """What to print now, given the stages ``elapsed`` seconds into the run, or None."""
        if self.done:
            return None
        if self.first_join is None and any(s != "starting" for s in stages.values()):
            self.first_join = elapsed
        waiting = any(s in _WAITING for s in stages.values())
        arrived = sum(1 for s in stages.values() if s in _ARRIVED)
        if not waiting and (arrived or self.said_at is not None):
            self.done = True
            if self.said_at is None:
                return None
            if not arrived:
                return (
                    f"meshkit launch: every rank exited before the cluster formed ({elapsed:.1f} s)"
                )
            ended = [r for r, s in stages.items() if s == "exited"]
            line = f"meshkit launch: the cluster formed after {elapsed:.1f} s: {arrived} "
            line += "rank joined" if arrived == 1 else "ranks joined"
            if ended:
                line += f"; {'rank' if len(ended) == 1 else 'ranks'} {ranges(ended)} exited"
            return line
        if self.first_join is None or elapsed - self.first_join < self.after:
            return None
        said = summary(stages) + "".join(f"; {m}: {what}" for m, what in (others or {}).items())
        due = self.said_at is None or elapsed - self.said_at >= self.every
        if said == self.said and not due:
            return None
        self.said, self.said_at = said, elapsed
        return f"meshkit launch: waiting for the cluster to form ({elapsed:.1f} s): {said}"


STATUS_S = 0.25  # how often the ranks' stages are read while the cluster forms
# What ends a launcher from outside: Ctrl-C, a CI job cancelled or a scheduler, a terminal closed.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_recorded(enabled: bool) -> Iterator[list[int]]:
    """While inside, `STOP_SIGNALS` are appended to the yielded list instead of acting.

    The run loop polls the list, so no signal ever raises in the middle of stopping the ranks.
    An inherited SIG_IGN is replaced too: a background job of a non-interactive shell starts
    with SIGINT ignored, and a launcher that cannot be stopped leaves its ranks running.
    """
    received: list[int] = []
    if not enabled:
        yield received
        return

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _first(failed: list[Rank]) -> Rank:
    """The rank that most likely failed first among those one look found failed.

    Looks are `POLL_S` apart, and a rank whose peer vanished mid-collective often ends within
    that time: Gloo and XLA end it with SIGABRT. So among ranks seen failed together, one
    ended by SIGABRT comes after one ended otherwise (killed, or an exit status of its own);
    then the lowest rank.
    """

    def aborted(rank: Rank) -> bool:
        return rank.proc.returncode in (-signal.SIGABRT, 128 + signal.SIGABRT)

    return min(failed, key=lambda rank: (aborted(rank), rank.rank))


@dataclasses.dataclass
class Preemption:
    """A preemption notice during a run (SIGTERM to the launcher, or to a rank directly).

    Attributes:
        source: who received it: ``"the launcher"`` (which forwarded it to every rank) or
            ``"rank R"`` (the first rank seen to end for it).
        after: seconds from the start of the run to the notice.
        overdue: the ranks did not all end within the launcher's wait after it (they were
            stopped).
    """

    source: str
    after: float
    overdue: bool = False


@dataclasses.dataclass
class Outcome:
    """Why a run ended, as the supervisor saw it.

    Attributes:
        first_failure: the first rank seen with a non-zero exit, or None.
        failed_after: seconds from the start to that failure.
        timed_out: the run's timeout struck.
        alive_at_timeout: the ranks still running then.
        tails_at_timeout: their last lines then (before stopping them adds signal-handler noise).
        interrupted: the signal that stopped the launcher (the launcher sets ``SIGINT`` for a
            KeyboardInterrupt).
        stopped_by: in a run on several machines, why another machine stopped this one (what
            ``remote`` returned).
        preempted: the run's ranks ended for a preemption notice (`Preemption`).
    """

    first_failure: int | None = None
    failed_after: float = 0.0
    timed_out: bool = False
    alive_at_timeout: list[int] = dataclasses.field(default_factory=list)
    tails_at_timeout: dict[int, str] = dataclasses.field(default_factory=dict)
    interrupted: int | None = None
    stopped_by: object | None = None
    preempted: Preemption | None = None


class Supervisor:
    """Looks at a run until it is over.

    Args:
        ranks: the ranks started.
        received: the signals the launcher received (`signals_recorded`), polled.
        timeout: seconds from ``start`` before the run is over (None: no limit).
        board: says who is where while the cluster forms (None: say nothing).
        note: prints one of the launcher's own lines.
        reaper: finds the processes the ranks started (None: not on this system).
        guardian: told of those processes, to end them should the launcher be killed.
        clock: seconds, monotonic; ``start`` is its value when the ranks started.
        start: when the run started, on ``clock`` (default: now).
        remote: in a run on several machines, asked at each look whether another machine
            stopped the run: None, or why (the run is then over).
        share: in a run on several machines, given this machine's ranks' stages at each look
            at the board; returns the other machines still forming (name -> their stages).
        preempted: whether rank R recorded that it ended for a preemption notice (its
            ``preempted`` event); asked once for a rank that exits with a status other than 0.
        notice_wait: with ``preempted``, a SIGTERM to the launcher is a preemption notice: it
            is forwarded to every rank, which end by themselves, and the run is over when they
            have, or ``notice_wait`` seconds later (the rest are then stopped). Without it
            (None), SIGTERM stops the run as SIGINT does.
    """

    def __init__(
        self,
        ranks: Sequence[Rank],
        received: list[int],
        *,
        timeout: float | None,
        board: Board | None,
        note: Callable[[str], None],
        reaper: Reaper | None = None,
        guardian: Guardian | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: float | None = None,
        remote: Callable[[], object | None] | None = None,
        share: Callable[[Mapping[int, str]], Mapping[str, str]] | None = None,
        preempted: Callable[[int], bool] | None = None,
        notice_wait: float | None = None,
    ) -> None:
        self.ranks = ranks
        self.received = received
        self.timeout = timeout
        self.board = board
        self.note = note
        self.reaper = reaper
        self.guardian = guardian
        self.clock = clock
        self.start = clock() if start is None else start
        self.outcome = Outcome()
        self.remote = remote
        self.share = share
        self.preempted = preempted
        self.notice_wait = notice_wait
        self._next_look = 0.0
        self._signals = 0  # the signals in ``received`` already acted on
        self._ended_by_notice: set[int] = set()  # ranks that exited for a notice

    def watch(self, poll: float = POLL_S) -> Outcome:
        """Look every ``poll`` seconds until the run is over; why it ended."""
        while not self.look():
            time.sleep(poll)
        return self.outcome

    def look(self) -> bool:
        """One look at the run; True once it is over (`outcome` says why)."""
        now = self.clock() - self.start
        while self._signals < len(self.received):
            signum = self.received[self._signals]
            self._signals += 1
            if signum != signal.SIGTERM or self.notice_wait is None:
                self.outcome.interrupted = signum
                return True
            if self.outcome.preempted is None:  # a second SIGTERM changes nothing
                self._forward(now)
        if self.remote is not None:
            self.outcome.stopped_by = self.remote()
            if self.outcome.stopped_by is not None:
                return True
        running = [rk for rk in self.ranks if rk.proc.poll() is None]
        failed = [rk for rk in self.ranks if not self._ended_well(rk, now)]
        preempted = self.outcome.preempted
        if preempted is not None and running and not failed:
            assert self.notice_wait is not None
            if now - preempted.after > self.notice_wait:
                preempted.overdue = True
                return True
        if failed or not running:
            if failed:
                self.outcome.first_failure = _first(failed).rank
                self.outcome.failed_after = now
            # What the ranks reached before they ended, however soon after the last look.
            self._look_at_board(now, final=True)
            return True
        self._look_at_board(now)
        if self.reaper is not None:
            seen_now = self.reaper.watch()
            if self.guardian is not None:
                self.guardian.add_known(seen_now)
        if self.timeout is not None and self.clock() - self.start > self.timeout:
            self.outcome.timed_out = True
            self.outcome.alive_at_timeout = [rk.rank for rk in running]
            self.outcome.tails_at_timeout = {rk.rank: "\n".join(rk.both) for rk in running}
            return True
        return False

    def _forward(self, now: float) -> None:
        """SIGTERM to the launcher: a preemption notice for every rank (not their children)."""
        self.outcome.preempted = Preemption("the launcher", now)
        for rk in self.ranks:
            if rk.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(rk.proc.pid, signal.SIGTERM)
        self.note(
            "meshkit launch: SIGTERM: a preemption notice, forwarded to every rank; they save "
            "and end by themselves."
        )

    def _ended_well(self, rank: Rank, now: float) -> bool:
        """Whether ``rank`` runs, ended with status 0, or ended for a preemption notice."""
        code = rank.proc.returncode
        if code is None or code == 0 or rank.rank in self._ended_by_notice:
            return True
        if code not in (128 + signal.SIGTERM, -signal.SIGTERM) or self.preempted is None:
            return False
        forwarded = self.outcome.preempted is not None and (
            self.outcome.preempted.source == "the launcher"
        )
        if not forwarded and not self.preempted(rank.rank):
            return False
        self._ended_by_notice.add(rank.rank)
        if self.outcome.preempted is None:
            self.outcome.preempted = Preemption(f"rank {rank.rank}", now)
        return True

    def _look_at_board(self, now: float, *, final: bool = False) -> None:
        if self.board is None or self.board.done or (now < self._next_look and not final):
            return
        self._next_look = now + STATUS_S
        exits = {rk.rank: rk.proc.returncode for rk in self.ranks}
        stages = self.board.stages(exits)
        others = self.share(stages) if self.share is not None else {}
        said = self.board.line(stages, now, others)
        if said is not None:
            self.note(said)
