"""What a launch did, and the launcher's closing report: the root cause, stalls, the end.

The verdicts come from what the ranks recorded (`meshkit._src.core.events`: which rank failed
and why, which stalled where, which reached the end of its program), never from the sentences
meshkit prints for people, so rewording a message cannot change them. The one text still read
is what JAX's own cross-process machinery wrote (gloo, NCCL, the coordination service) when a
rank died without recording anything: `meshkit._src.core.events.diagnose` classifies it.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core import events as _events
from ..core.errors import ranges
from .rank_events import from_event, step_rows, table_text

TAIL_LINES = 40


@dataclasses.dataclass
class RankResult:
    """What one rank did.

    Attributes:
        rank: the process id.
        returncode: its exit status (negative: killed by that signal); None if it never ended.
        stdout: what it printed (the last lines only, unless the launch kept everything).
        stderr: what it printed to stderr (same rule).
        stopped_by_launcher: True when the launcher ended it (fail-fast, timeout, interrupt).
        tail: its last lines, stdout and stderr interleaved as they came.
        pid: its process id while it ran (its process group id too).
        reached_end: it said it reached the end of its program while other ranks still ran
            (it waited at JAX's shutdown barrier for them).
    """

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    stopped_by_launcher: bool = False
    tail: str = ""
    pid: int = 0
    reached_end: bool = False


@dataclasses.dataclass(frozen=True)
class LaunchAttempt:
    """One start of the whole group of processes (``meshkit launch --max-restarts``).

    Attributes:
        number: 0 for the first start, 1 for the first restart, and so on (what
            ``meshkit.runtime_info().attempt`` says in its processes).
        returncode: the attempt's exit status, as `LaunchResult.returncode`.
        cause: the first line of its report: why it failed ("" when it succeeded).
        restartable: it failed in a way a restart may mend (a rank failed or a machine was
            lost), not by a timeout, an interrupt, or processes that never joined.
        elapsed: seconds from its start to the end of its last rank.
        joined_s: seconds from its start until every rank had joined (None: some never did).
        stopped_s: seconds from the failure the launcher saw to every rank stopped (None when
            nothing failed).
        restored_step: the checkpoint step its processes restored (`meshkit.checkpoint`), if any.
        restore_s: the seconds that restore took (the slowest process).
        saved_step: the last checkpoint step it saved completely, if any.
        failure: what identifies the failure (rank, cause, error type, where it was raised,
            the last step), to tell a failure that repeats from one that does not; None when
            it did not fail by an exception.
        compiled: per rank that reported (`meshkit.init` reports under ``meshkit launch``),
            ``(rank, seconds, programs, hits)``: seconds spent compiling or fetching programs
            from JAX's persistent compilation cache, how many programs, how many of them came
            from that cache.
        started_at: when it started (seconds since the epoch).
        steps: the most steps of `meshkit.global_batches` a rank took.
        goodput: where its time went (`meshkit.Goodput`), until the next attempt started.
    """

    number: int
    returncode: int
    cause: str = ""
    restartable: bool = False
    elapsed: float = 0.0
    joined_s: float | None = None
    stopped_s: float | None = None
    restored_step: int | None = None
    restore_s: float | None = None
    saved_step: int | None = None
    failure: tuple[Any, ...] | None = None
    compiled: tuple[tuple[int, float, int, int], ...] = ()
    started_at: float = 0.0
    steps: int = 0
    goodput: _events.Goodput = _events.Goodput(0.0)  # noqa: RUF009 (frozen: one is shared)


@dataclasses.dataclass
class LaunchResult:
    """The outcome of `launch`.

    Attributes:
        returncode: 0 when every rank exited 0; the first failing rank's code (1 for a signal)
            after a failure; 124 after a timeout; 128 + the signal's number after an interrupt
            (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).
        ranks: per-rank results, indexed by rank.
        first_failure: the rank that failed first, if any.
        timed_out: True when ``timeout`` ended the run.
        alive_at_timeout: ranks still running when the timeout struck.
        elapsed: seconds from start to the last rank's end.
        report: the launcher's own closing message (root cause, timeout summary), or "".
        interrupted_by: the signal that stopped the run (``signal.SIGINT`` for a
            KeyboardInterrupt), or None.
        values: for `meshkit.testing` function targets, what each rank returned (None for a
            rank that failed); empty otherwise.
        attempts: every start of the group, the last one this result's (one without
            ``max_restarts``).
        preempted: the ranks ended for a preemption notice (SIGTERM to the launcher, which
            forwarded it, or to a rank): ``returncode`` 143, no restart.
        steps: each rank's step times in its last window (`meshkit.StepRow`), the slowest own
            work first; empty when no rank took a step of `meshkit.global_batches`.
    """

    returncode: int
    ranks: list[RankResult]
    first_failure: int | None
    timed_out: bool
    alive_at_timeout: list[int]
    elapsed: float
    report: str
    values: list[Any] = dataclasses.field(default_factory=list)
    interrupted_by: signal.Signals | None = None
    attempts: list[LaunchAttempt] = dataclasses.field(default_factory=list)
    preempted: bool = False
    steps: list[_events.StepRow] = dataclasses.field(default_factory=list)

    @property
    def goodput(self) -> _events.Goodput:
        """Where the run's wall time went, over every attempt (`meshkit.Goodput`)."""
        return sum((a.goodput for a in self.attempts), _events.Goodput(0.0))


@dataclasses.dataclass(frozen=True)
class Told:
    """What the ranks recorded in the run's events, by rank.

    Attributes:
        failed: each rank's first ``failed`` event (why it failed, as it saw it).
        stalled: each rank's last ``stalled`` event (where its stall watchdog found it).
        ended: the ranks that reached the end of their program while others still ran.
        preempted: each rank's ``preempted`` event (it ended for a preemption notice).
        saved: the last step each rank saved completely (``saved`` events with a step).
        steps: each rank's last window of step times, the slowest own work first.
        stragglers: what process 0 said of the processes slower than the others.
    """

    failed: Mapping[int, _events.Event] = dataclasses.field(default_factory=dict)
    stalled: Mapping[int, _events.Event] = dataclasses.field(default_factory=dict)
    ended: frozenset[int] = frozenset()
    preempted: Mapping[int, _events.Event] = dataclasses.field(default_factory=dict)
    saved: Mapping[int, int] = dataclasses.field(default_factory=dict)
    steps: list[_events.StepRow] = dataclasses.field(default_factory=list)
    stragglers: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, records: Iterable[_events.Event]) -> Told:
        """Sorts ``records`` (oldest first, as `rank_events.read` gives them) by what they say."""
        failed: dict[int, _events.Event] = {}
        stalled: dict[int, _events.Event] = {}
        ended: set[int] = set()
        preempted: dict[int, _events.Event] = {}
        saved: dict[int, int] = {}
        records = list(records)
        stragglers: list[str] = []
        for event in records:
            if event.kind == _events.FAILED:
                failed.setdefault(event.rank, event)  # the first: later ones are its echoes
            elif event.kind == _events.STALLED:
                stalled[event.rank] = event
            elif event.kind == _events.ENDED:
                ended.add(event.rank)
            elif event.kind == _events.PREEMPTED:
                preempted.setdefault(event.rank, event)
            elif event.kind == _events.SAVED and isinstance(event.fields.get("step"), int):
                saved[event.rank] = event.fields["step"]
            elif event.kind == _events.STRAGGLER:
                stragglers += [str(said) for said in event.fields.get("said") or ()]
        steps = step_rows(records)
        return cls(failed, stalled, frozenset(ended), preempted, saved, steps, stragglers)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int | None) -> str:
    """``exit code 3``, ``killed by SIGKILL`` or ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exit code {code}"


def tail_block(title: str, rank: int, text: str) -> str:
    """The last `TAIL_LINES` lines of ``text``, indented under a ``--- title rank N ---`` rule."""
    lines = (text.strip() or "(no output)").splitlines()[-TAIL_LINES:]
    body = "\n".join(f"  | {line}" for line in lines)
    return f"--- {title} rank {rank} ---\n{body}\n"


def straggler_summary(told: Told, most: int = 8) -> str:
    """The processes named slower than the others, and the ranks' step times; "" if none."""
    if not told.stragglers:
        return ""
    names = {r.process: f"rank {r.process}" for r in told.steps}
    return (
        "Slower than the others, as process 0 said during the run: "
        + "; ".join(dict.fromkeys(told.stragglers)).replace("process ", "rank ")
        + ".\nStep times per rank over the run, the slowest own work first:\n"
        + table_text(told.steps[:most], names)
    )


def stall_summary(ranks: Iterable[int], told: Told) -> str:
    """Where each rank was when the run stalled (its ``stalled`` event), or ""."""
    ranks = list(ranks)
    if not any(r in told.stalled for r in ranks):
        return ""
    lines = [f"  rank {r}: {_stall_text(told.stalled[r])}" for r in ranks if r in told.stalled]
    quiet = [str(r) for r in ranks if r not in told.stalled]
    if quiet:
        lines.append(f"  (no stall report from rank {', '.join(quiet)})")
    return "Where each rank was when the run stalled:\n" + "\n".join(lines) + "\n"


# Where a stalled rank's main thread was, in words (the ``stalled`` event's state, inside).
INSIDE, OUTSIDE = "inside a meshkit call", "outside meshkit"
_STATES = {"device": "waiting for device results", "meshkit": INSIDE, "python": "in Python"}


def _stall_text(event: _events.Event) -> str:
    fields = event.fields
    doing = _STATES.get(str(fields.get("state"))) or (INSIDE if fields.get("inside") else OUTSIDE)
    idle = _seconds(fields.get("idle"))
    return f"no progress for {idle} s; main thread at {fields.get('frame') or '?'}, {doing}"


def _seconds(value: object) -> str:
    return f"{value:.0f}" if isinstance(value, (int, float)) else "?"


def preempted_report(
    results: Sequence[RankResult],
    told: Told,
    source: str | None = None,
    overdue: bool = False,
    machines: Mapping[int, str] | None = None,
) -> str:
    """The report of a run its ranks ended for a preemption notice (status 143: requeue it).

    Args:
        results: every rank's result.
        told: what the ranks recorded (their ``preempted`` and ``saved`` events).
        source: who received the notice, when the launcher knows (``"the launcher"``).
        overdue: ranks still ran when the launcher's wait after the notice ran out.
        machines: in a run on several machines, each rank's machine.
    """
    events = sorted(told.preempted.values(), key=lambda e: (e.time, e.rank))
    if source is None and events:
        first = events[0].fields
        source = f"rank {first.get('process')}" if first.get("process") is not None else None
    said = f"meshkit launch: preempted: the notice (SIGTERM to {source or 'a rank'}) reached"
    ranks = [r.rank for r in results]
    how = {e.rank: e.fields.get("how") for e in events}
    saved_after = sorted({e.fields.get("saved") for e in events if e.fields.get("how") == "saved"},
                         key=str)  # fmt: skip
    steps = sorted({e.fields["step"] for e in events if isinstance(e.fields.get("step"), int)})
    at = f" at step {steps[-1]}" if steps else ""
    lines = [f"{said} {'every rank' if set(how) >= set(ranks) else 'ranks ' + ranges(how)}{at}."]
    if saved_after and set(how.values()) == {"saved"}:
        lines.append(
            f"Every rank saved step {', '.join(map(str, saved_after))} after it and exited "
            "(status 143); start the run again to resume there."
        )
    else:
        last = sorted(set(told.saved.values()))
        kinds = {
            "deadline": "the grace after the notice ran out",
            "ended": "its program ended",
            "saved": "it saved",
        }
        for result in results:
            where = f" on {machines[result.rank]}" if machines and result.rank in machines else ""
            why = kinds.get(str(how.get(result.rank)))
            if why is None:  # it ended before it heard of the notice, or said nothing
                why = "its program ended" if result.returncode == 0 else (
                    describe_exit(result.returncode))  # fmt: skip
            lines.append(f"  rank {result.rank}{where}: {why}")
        since = f" (step {last[-1]}, saved by meshkit.checkpoint)" if last else ""
        lines.append(f"Start the run again to resume from its last complete checkpoint{since}.")
    if overdue:
        alive = [str(r.rank) for r in results if r.stopped_by_launcher]
        lines.append(
            f"Ranks {', '.join(alive)} had not ended when the launcher's wait after the notice "
            "ran out; they were stopped."
        )
    return "\n".join(lines) + "\n"


def root_cause(
    bad: RankResult,
    results: list[RankResult],
    elapsed: float,
    told: Told | None = None,
    machines: Mapping[int, str] | None = None,
) -> str:
    """The report of a failed run: who failed first, whom the evidence points to, their output.

    Args:
        bad: the rank that failed first.
        results: every rank's result.
        elapsed: seconds from the start to ``bad``'s failure.
        told: what the ranks recorded in the run's events.
        machines: in a run on several machines, each rank's machine (``machine 1 (host-b)``).
    """
    told = told or Told()
    others = [r for r in results if r.rank != bad.rank]
    stopped = [str(r.rank) for r in others if r.stopped_by_launcher]
    lines = [
        f"meshkit launch: rank {bad.rank} failed first ({describe_exit(bad.returncode)}) "
        f"after {elapsed:.1f} s."
    ]
    suspect, evidence = _suspect(bad, results, told)
    lines.extend(evidence)
    cause = suspect or bad  # no rank the evidence points to: the first to fail is shown
    if machines:
        named = [bad.rank] if cause is bad else [bad.rank, cause.rank]
        where = "; ".join(f"rank {r} ran on {machines.get(r, '?')}" for r in named)
        lines.append(f"R{where[1:]}.")
    # The rank the evidence points to is named above, with its output below: not again here.
    # A rank whose record names the cause (it was told of its failure) failed because of it.
    also = [
        f"{r.rank} ({describe_exit(r.returncode)})"
        for r in others
        if not r.stopped_by_launcher
        and r.returncode not in (0, None)
        and r is not cause
        and not _ended_by(r, cause, told)
    ]
    if stopped:
        lines.append(f"Stopped the other ranks: {', '.join(stopped)}.")
    if also:
        lines.append(f"Also failed on their own: {', '.join(also)}.")
    if suspect is None:  # every rank failed the same way: the first is not the cause
        # A first rank ended by another's failure (fail-fast) holds only a notice: the error
        # itself is in the output of the rank that raised it.
        first = _diagnosis(bad, told)
        ender = first.process if first is not None and first.kind == "lost" else None
        raised = next((r for r in others if r.rank == ender), None)
        if raised is not None:
            return (
                "\n".join(lines)
                + "\n"
                + tail_block(
                    f"the error that ended rank {bad.rank}:", raised.rank, _error_text(raised)
                )
            )
        return "\n".join(lines) + "\n" + tail_block("first to fail:", bad.rank, _error_text(bad))
    blocks = tail_block("root cause:", cause.rank, _error_text(cause))
    if cause is not bad:
        blocks += tail_block("first to fail:", bad.rank, _error_text(bad))
    return "\n".join(lines) + "\n" + blocks


def _ended_by(result: RankResult, cause: RankResult, told: Told) -> bool:
    """Whether ``result``'s rank recorded that ``cause``'s failure ended it."""
    found = _diagnosis(result, told)
    return found is not None and found.kind == "lost" and found.process == cause.rank


def _error_text(result: RankResult) -> str:
    # A traceback goes to stderr; a rank that wrote nothing there is shown by its stdout.
    return result.stderr.strip() or result.stdout


def _diagnosis(result: RankResult, told: Told) -> _events.Diagnosis | None:
    """Why ``result``'s rank failed as it recorded it, else as JAX's own text says, else None."""
    event = told.failed.get(result.rank)
    if event is not None:
        return from_event(event.fields)
    return _events.diagnose(_error_text(result))


def _suspect(
    bad: RankResult, results: list[RankResult], told: Told
) -> tuple[RankResult | None, list[str]]:
    """The rank the evidence points to, and the lines that say why (none: ``bad`` itself).

    None where the evidence points to no rank: a `meshkit.DivergenceError` with no majority,
    or every rank that recorded a failure failed with the same error at the same line (a
    check every process makes, such as `meshkit.global_batches` comparing the batches).

    The first rank to exit is not always the cause: a rank that waited for another in JAX's
    cross-process machinery (a gloo or NCCL timeout) or lost it (the coordination service
    gone) fails because of another. Evidence, in order: the rank another one's failure names
    (meshkit's failure watch told of it, or a meshkit check waited for it); a rank that failed
    with an error of its own; a rank that timed out waiting (it was in a computation the others
    never joined); and, as context, the ranks that reached the end of their program meanwhile.
    """
    stalled = _stalled_run(results, told)
    if stalled is not None:
        return stalled
    differ = _divergence(told)
    if differ is not None:
        return _differing(bad, results, *differ)
    same = _same_failure(told)
    if same:
        return None, [same]
    found = {r.rank: _diagnosis(r, told) for r in results}
    naming = [d for r in results if (d := found[r.rank]) is not None and d.process is not None]
    if found[bad.rank] is None:
        # An error of its own: the cause when the others' records name it (it exited before
        # the ranks its failure ended), else unless its watchdog found it waiting inside.
        naming = [d for d in naming if d.process == bad.rank]
        if not naming:
            return _stalled_elsewhere(bad, results, told)
    failed = [r for r in results if r.returncode not in (0, None) and not r.stopped_by_launcher]
    own = [r for r in failed if found[r.rank] is None]
    waited = [r for r in failed if (d := found[r.rank]) is not None and d.kind == "timeout"]
    ended = [r.rank for r in results if r.rank in told.ended or r.returncode == 0]
    named = [r for r in results if naming and r.rank == naming[0].process]
    cause = named[0] if named else own[0] if own else waited[0] if waited else bad
    lines: list[str] = []
    first = found[bad.rank]
    if cause is not bad and first is not None:
        lines.append(f"Its error is {_kind_text(first)}; it failed because of another rank.")
    diagnosis = found[cause.rank]
    if named and naming[0].kind == "lost":
        lines.append(
            f"The evidence points to rank {cause.rank}: it failed first, and told the others "
            "(meshkit's failure watch)."
        )
    elif named:
        lines.append(
            f"The evidence points to rank {cause.rank}: a meshkit check of the others waited "
            "for it in vain."
        )
    elif diagnosis is None:
        lines.append(f"The evidence points to rank {cause.rank}: it failed with its own error.")
    elif diagnosis.kind == "timeout":
        lines.append(
            f"The evidence points to rank {cause.rank}: it waited for other ranks in "
            f"{diagnosis.system} until a timeout, in a computation or collective they never "
            "joined."
        )
    else:
        lines.append(f"Its error is {_kind_text(diagnosis)}; no rank left an error of its own.")
    away = [r for r in ended if r != cause.rank]
    if away:
        lines.append(
            f"Rank{'s' if len(away) > 1 else ''} {', '.join(map(str, away))} reached the end "
            "of the program meanwhile."
        )
    if named or (diagnosis is None and own):
        return cause, lines  # an error of its own: its output says the rest
    lines.append(
        "Usual causes: a computation or collective run by only some ranks (a branch on "
        "jax.process_index()), or a rank that exited, crashed or stalled first. Consider running "
        "again with MESHKIT_DEBUG=1: it names the first meshkit call where ranks differ."
    )
    return cause, lines


def _stalled_run(
    results: list[RankResult], told: Told
) -> tuple[RankResult | None, list[str]] | None:
    """The rank the ranks' stall verdict says held the run, when a stall ended it; else None."""
    verdicts = [e.fields for e in told.failed.values() if e.fields.get("cause") == "stall"]
    if not verdicts:
        return None
    raw = verdicts[0].get("processes")
    holding = [p for p in raw if isinstance(p, int)] if isinstance(raw, list) else []
    named = [r for r in results if len(holding) == 1 and r.rank == holding[0]]
    if named:
        return named[0], [
            f"The evidence points to rank {named[0].rank}: the run stalled, and the ranks' "
            "stall verdict says it held the run (the others waited for it)."
        ]
    who = (
        f"ranks {ranges(holding)} held it"
        if holding
        else "no rank held it (each waited for the others, or each was stuck in its own code)"
    )
    return None, [f"The run stalled, and {who}; each rank's output says where it was."]


def _divergence(told: Told) -> tuple[list[int], str] | None:
    """The processes and the field of the ``divergence`` the ranks recorded, if any.

    Every rank that checked raises the same `meshkit.DivergenceError`, so one rank's record
    says who differs. Where the ranks' records name different processes (each names the
    other, as two processes whose loops ended at different steps do), all those named are
    returned: no rank is singled out.
    """
    found: list[tuple[list[int], str]] = []
    for rank in sorted(told.failed):
        fields = told.failed[rank].fields
        raw = fields.get("processes")
        if fields.get("cause") == "divergence" and isinstance(raw, list):
            processes = [p for p in raw if isinstance(p, int) and not isinstance(p, bool)]
            found.append((processes, str(fields.get("field") or "")))
    if not found:
        return None
    named = sorted({p for processes, _ in found for p in processes})
    return (found[0][0] if named == sorted(found[0][0]) else named), found[0][1]


def _same_failure(told: Told) -> str:
    """A line saying that the ranks failed alike, when two or more did; else ""."""
    seen = {
        rank: (str(e.fields.get("error")), str(e.fields.get("where")))
        for rank, e in told.failed.items()
        if e.fields.get("cause") == "exception" and e.fields.get("where")
    }
    if len(seen) < 2 or len(set(seen.values())) > 1:
        return ""
    error, where = next(iter(seen.values()))
    return (
        f"Ranks {ranges(seen)} failed alike ({error} at {where}): the first to fail is not "
        "known to be the cause, so no rank is named as one; each rank's message says what it "
        "saw."
    )


def _differing(
    bad: RankResult, results: list[RankResult], processes: list[int], field: str
) -> tuple[RankResult | None, list[str]]:
    """The rank a `meshkit.DivergenceError` names, when it names one; else None."""
    named = [r for r in results if len(processes) == 1 and r.rank == processes[0]]
    if not named:
        ranks = ", ".join(map(str, processes)) or "?"
        return None, [
            f"meshkit found that ranks {ranks} differ ({field}); no majority says which is "
            "wrong, so no rank is named as the cause."
        ]
    cause = named[0]
    if field == "arrival":
        why = "a meshkit check of the others waited for it in vain"
    else:
        why = f"meshkit found that it differs from the others ({field})"
    lines = [f"The evidence points to rank {cause.rank}: {why}."]
    if cause is not bad:
        lines.insert(0, "Its error is meshkit's notice of a difference; another rank differs.")
    return cause, lines


def _stalled_elsewhere(
    bad: RankResult, results: list[RankResult], told: Told
) -> tuple[RankResult, list[str]]:
    """``bad``, unless the stall watchdog found it inside a meshkit call and another outside.

    A rank that waits at a meshkit call for another that stalled in its own code (a sleep, a
    raw collective) is a victim, even when its own watchdog ends it first.
    """
    mine = told.stalled.get(bad.rank)
    if mine is None or not mine.fields.get("inside"):
        return bad, []
    outside = [
        r
        for r in results
        if (e := told.stalled.get(r.rank)) is not None and not e.fields.get("inside")
    ]
    if not outside:
        return bad, []
    cause = outside[0]
    where = str(told.stalled[cause.rank].fields.get("frame") or "?")
    return cause, [
        f"The evidence points to rank {cause.rank}: the stall watchdog found it outside "
        f"meshkit (in {where.removeprefix('in ')}) while rank {bad.rank} waited inside a "
        "meshkit call."
    ]


def _kind_text(diagnosis: _events.Diagnosis) -> str:
    if diagnosis.process is not None and diagnosis.kind == "lost":
        return f"meshkit's notice that rank {diagnosis.process} failed"
    if diagnosis.process is not None:
        return f"a meshkit check that waited for rank {diagnosis.process} in vain"
    if diagnosis.kind == "timeout":
        return f"a timeout of {diagnosis.system} (it waited for another rank)"
    return f"a lost connection reported by {diagnosis.system} (another rank is gone)"
