"""Whole-group restarts: ``meshkit launch --max-restarts K``.

When a rank fails (or, on several machines, a machine is lost), the launcher has already
stopped every process of the group; with restarts left it starts the whole group again, with a
fresh coordination session (a new coordinator port, process 0 started anew), and tells the
processes which start this is (``MESHKIT_ATTEMPT``, `meshkit.runtime_info().attempt`). The
program resumes from its latest checkpoint (`meshkit.checkpoint.latest`).

What each start did is a `LaunchAttempt`, built from what the ranks recorded (events: joined,
failed, saved, restored; `meshkit._src.core.events`), never from printed text. A failure that
repeats (the same rank failing with the same error type raised at the same line, with no
checkpoint saved past the step the attempt restored) is a failure a restart will not mend: the
launcher stops restarting after the second such attempt in a row and says so. A timeout, an
interrupt (Ctrl-C, SIGTERM to the launcher) or processes that never joined end the run without
restart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..core import events as _events
from . import goodput as _goodput
from .report import LaunchAttempt, LaunchResult, Told

ENV_MAX_RESTARTS = "MESHKIT_MAX_RESTARTS"


def attempt_of(
    number: int,
    result: LaunchResult,
    records: Iterable[_events.Event],
    *,
    ranks: Sequence[int],
    started_at: float,
    stopped_s: float | None,
    restartable: bool,
) -> LaunchAttempt:
    """The `LaunchAttempt` of one run of the group, from its result and the ranks' records.

    Args:
        number: which start this was.
        result: the run's result (its exit status, first failure, report).
        records: the events the ranks wrote (oldest first).
        ranks: the ranks of the run (all of them: a joined time needs each).
        started_at: when the run started (seconds since the epoch, as event times are).
        stopped_s: seconds from the failure seen to every rank stopped, if something failed.
        restartable: whether a restart may mend how it ended.
    """
    joined: dict[int, float] = {}
    saved: list[int] = []
    restored: list[tuple[int | None, float]] = []
    compiled: dict[int, tuple[float, int, int]] = {}  # each rank's last totals
    records = list(records)
    for event in records:
        if event.kind == _events.JOINED:
            joined.setdefault(event.rank, event.time)
        elif event.kind == _events.SAVED and event.fields.get("step") is not None:
            saved.append(int(event.fields["step"]))
        elif event.kind == _events.RESTORED:
            restored.append((event.fields.get("step"), float(event.fields.get("seconds", 0.0))))
        elif event.kind == _events.COMPILED:
            fields = event.fields
            compiled[event.rank] = (
                float(fields.get("seconds", 0.0)),
                int(fields.get("programs", 0)),
                int(fields.get("hits", 0)),
            )
    restored_step = next((s for s, _ in restored if s is not None), None)
    saved_step = max(saved) if saved else None
    failure = None
    # The rank whose own exception started it (the earliest such record), whichever rank the
    # launcher saw exit first: the others' exits (a peer's failure noticed) race with it.
    failed = Told.of(records).failed  # each rank's first failure, as the report reads them
    raised = [e for e in failed.values() if e.fields.get("cause") == "exception"]
    if result.returncode != 0 and raised:
        first = min(raised, key=lambda e: (e.time, e.rank))
        last_step = saved_step if saved_step is not None else restored_step
        failure = (first.rank, first.fields.get("error"), first.fields.get("where"), last_step)
    joined_s = max(joined.values()) - started_at if ranks and set(ranks) <= set(joined) else None
    goodput, steps = _goodput.of_attempt(records, result.elapsed, joined_s, stopped_s)
    return LaunchAttempt(
        number=number,
        returncode=result.returncode,
        cause="" if result.returncode == 0 else result.report.strip().split("\n", 1)[0],
        restartable=restartable and result.returncode != 0,
        elapsed=result.elapsed,
        joined_s=joined_s,
        stopped_s=stopped_s,
        restored_step=restored_step,
        restore_s=max(s for _, s in restored) if restored else None,
        saved_step=saved_step,
        compiled=tuple((rank, *compiled[rank]) for rank in sorted(compiled)),
        failure=failure,
        started_at=started_at,
        steps=steps,
        goodput=goodput,
    )


def repeated(attempts: Sequence[LaunchAttempt]) -> bool:
    """Whether the last two attempts failed the same way at the same step (see the module)."""
    if len(attempts) < 2:
        return False
    a, b = attempts[-2], attempts[-1]
    return a.failure is not None and a.failure == b.failure


def should_restart(attempts: Sequence[LaunchAttempt], max_restarts: int) -> bool:
    """Whether to start the group again after the last of ``attempts`` (see the module).

    Every launcher of a run on several machines decides from the same attempts (machine 0's
    count, sent with the verdict) and the same ``max_restarts`` (checked at the join), so
    all decide alike.
    """
    return (
        bool(attempts)
        and attempts[-1].restartable
        and len(attempts) <= max_restarts
        and not repeated(attempts)
    )


def run_attempts(
    one: Callable[[int], LaunchResult],
    max_restarts: int,
    note: Callable[[str], None],
) -> LaunchResult:
    """Run ``one(attempt)`` until it succeeds or restarting ends; the last result.

    Restarting ends when an attempt ends in a way a restart cannot mend, fails the same way as
    the one before it, or ``max_restarts`` restarts are spent. The result lists every attempt,
    and its report ends with them.
    """
    attempts: list[LaunchAttempt] = []
    while True:
        result = one(len(attempts))
        attempts = extended(attempts, result.attempts[-1:])
        if not should_restart(attempts, max_restarts):
            break
        note(restarting(attempts, max_restarts))
    result.attempts = attempts
    result.report = closing(result.report, attempts, max_restarts)
    return result


def extended(
    attempts: Sequence[LaunchAttempt], new: Sequence[LaunchAttempt]
) -> list[LaunchAttempt]:
    """``attempts`` and the ``new`` ones, the one before each new one settled (`goodput.settle`)."""
    out = list(attempts)
    for attempt in new:
        if out:
            out[-1] = _goodput.settle(out[-1], attempt)
        out.append(attempt)
    return out


def closing(report: str, attempts: Sequence[LaunchAttempt], max_restarts: int) -> str:
    """``report``, then the attempts and where the time went.

    The attempts after a restart, or a failure with restarts on; the time when a rank took steps.
    """
    listed = len(attempts) > 1 or bool(max_restarts and attempts[-1:] and attempts[-1].returncode)
    parts = [report.rstrip("\n"), summary(attempts, max_restarts) if listed else ""]
    parts.append(_goodput.table(attempts))
    return "\n".join(x for x in parts if x) if any(parts[1:]) else report


def restarting(attempts: Sequence[LaunchAttempt], max_restarts: int) -> str:
    """The line the launcher prints as it starts the group again."""
    return (
        f"meshkit launch: restarting every process (restart {len(attempts)} of at most "
        f"{max_restarts}): {_why(attempts[-1])}"
    )


def _why(attempt: LaunchAttempt) -> str:
    """The attempt's cause without the launcher's prefix or the closing full stop."""
    return attempt.cause.removeprefix("meshkit launch: ").rstrip(".")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _compiled(compiled: Sequence[tuple[int, float, int, int]]) -> str:
    """The first rank's compile time, its programs from the cache, and the slowest rank's."""
    rank, seconds, programs, hits = compiled[0]
    text = f"rank {rank} compiled {programs} programs in {seconds:.2f} s ({hits} from the cache)"
    slowest = max(compiled, key=lambda c: c[1])
    if slowest[0] != rank:
        text += f", rank {slowest[0]} in {slowest[1]:.2f} s ({slowest[3]} from the cache)"
    return text


def summary(attempts: Sequence[LaunchAttempt], max_restarts: int) -> str:
    """The report's list of attempts: what each did, why each restart came, what it cost."""
    restarts = len(attempts) - 1
    lines = [f"meshkit launch: {restarts} restart{'' if restarts == 1 else 's'} "
             f"(at most {max_restarts}):"]  # fmt: skip
    for a in attempts:
        joined = "not every rank joined" if a.joined_s is None else None
        parts = [joined or f"every rank joined after {_s(a.joined_s)}"]
        if a.restored_step is not None:
            parts.append(f"restored step {a.restored_step} in {_s(a.restore_s)}")
        if a.compiled:
            parts.append(_compiled(a.compiled))
        if a.saved_step is not None:
            parts.append(f"saved up to step {a.saved_step}")
        if a.returncode == 0:
            parts.append("finished")
        else:
            parts.append(_why(a))
            if a.stopped_s is not None:
                parts.append(f"every process stopped {_s(a.stopped_s)} later")
        lines.append(f"  attempt {a.number}: " + "; ".join(parts))
    last = attempts[-1]
    if last.returncode != 0 and repeated(attempts) and last.failure is not None:
        rank, error, where, step = last.failure
        at = f"after step {step}" if step is not None else "before any checkpoint"
        lines.append(
            f"meshkit launch: not restarting again: attempts {attempts[-2].number} and "
            f"{last.number} failed the same way (rank {rank}: {error} raised at {where}, {at}); "
            "a restart will not mend it."
        )
    elif last.returncode != 0 and last.restartable and restarts >= max_restarts:
        lines.append(f"meshkit launch: no restart left (--max-restarts {max_restarts}).")
    return "\n".join(lines)
