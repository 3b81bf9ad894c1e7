"""Where a launch's wall time went: joining, compiling, steps, checkpoints, restarts, redone steps.

Each attempt's split (`meshkit.Goodput`) comes from what its ranks recorded (events: joined,
compiled, saved, restored, steps), each part the slowest rank's figure (the others wait for it at
their next collective); the steps are those of the rank that took the most. What an attempt lost
is known once the next one started (`settle`): the time from its failure to that start
(restarts), and its steps past the checkpoint the next attempt restored (redone).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence

from ..core import events as _events
from ..core.events import Goodput
from .report import LaunchAttempt


def of_attempt(
    records: Iterable[_events.Event],
    elapsed: float,
    joined_s: float | None,
    stopped_s: float | None,
) -> tuple[Goodput, int]:
    """An attempt's split before the next attempt is known, and the most steps a rank took.

    An attempt whose ranks did not all join spent its time joining, until it stopped.
    """
    compiled: dict[int, float] = {}
    spent: dict[str, dict[int, float]] = {
        "saving": defaultdict(float),
        "restoring": defaultdict(float),
    }
    steps: dict[int, tuple[int, float]] = {}
    for e in records:
        seconds = float(e.fields.get("seconds") or 0.0)
        if e.kind == _events.COMPILED:
            compiled[e.rank] = seconds + float(e.fields.get("tracing") or 0.0)  # so far
        elif e.kind in (_events.SAVED, _events.RESTORED):  # its compiles count as compiling
            seconds -= float(e.fields.get("compiling") or 0.0)
            spent["saving" if e.kind == _events.SAVED else "restoring"][e.rank] += seconds
        elif e.kind == _events.STEPS:  # the run so far: steps, wall per step, compiles aside
            n, per = int(e.fields.get("steps") or 0), float(e.fields.get("step_ms") or 0.0)
            steps[e.rank] = (n, n * per / 1000.0 - float(e.fields.get("aside") or 0.0))
    taken, stepped = max(steps.values(), default=(0, 0.0))
    stopping = stopped_s or 0.0
    goodput = Goodput.of(
        elapsed,
        joining=elapsed - stopping if joined_s is None else joined_s,
        compiling=max(compiled.values(), default=0.0),
        steps=stepped,
        **{part: max(by_rank.values(), default=0.0) for part, by_rank in spent.items()},
        restarts=stopping,
    )
    return goodput, taken


def settle(attempt: LaunchAttempt, after: LaunchAttempt) -> LaunchAttempt:
    """``attempt`` with what it lost, now that ``after`` (the next attempt) has run.

    Its wall time runs until ``after`` started; the launcher's time between the two counts as
    restarts. Its steps past the checkpoint ``after`` restored (all of them when it restored
    none but took steps) count as redone, at the attempt's mean step time; none when ``after``
    neither restored nor stepped (it says nothing of what was kept).
    """
    g = attempt.goodput
    gap = max(after.started_at - attempt.started_at - attempt.elapsed, 0.0)
    redone = 0.0
    if attempt.steps and (after.steps or after.restored_step is not None):
        last = (attempt.restored_step or 0) + attempt.steps  # steps numbered from 1, as saved
        lost = min(max(last - (after.restored_step or 0), 0), attempt.steps)
        redone = lost * g.steps / attempt.steps
    parts = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)}
    parts.update(
        wall=g.wall + gap, restarts=g.restarts + gap, steps=g.steps - redone, redone=redone
    )
    return dataclasses.replace(attempt, goodput=Goodput.of(**parts))


def table(attempts: Sequence[LaunchAttempt]) -> str:
    """The report's table: a column per attempt (when restarted) and the run's; "" without steps."""
    if not any(a.steps for a in attempts):
        return ""
    columns = [(f"attempt {a.number}", a.goodput) for a in attempts] if len(attempts) > 1 else []
    total = sum((a.goodput for a in attempts), Goodput(0.0))
    return "Where the time went (seconds):\n" + _events.goodput_table([*columns, ("run", total)])
