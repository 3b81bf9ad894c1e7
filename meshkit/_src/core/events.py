"""The launcher <-> rank contract: the variables ``meshkit launch`` sets, the events ranks write.

Both sides import it without JAX. Events are records, never sentences: a rank appends one JSON
object per line to ``events-<rank>.jsonl`` (one ``write`` each, so records never interleave).
While the cluster forms, a rank's stage (``joining``, ``joined``, ``running``) is a file of its
own; the launcher reads them and, once a rank waited a while, says who is where (`Board`).
Outside a launch a rank writes nothing.

A failure that JAX's cross-process machinery ended is classified by its text (`diagnose`:
gloo's, NCCL's and the coordination service's timeouts and lost peers, which name no process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_COORDINATOR = "MESHKIT_COORDINATOR"
ENV_NUM_PROCESSES = "MESHKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHKIT_PROCESS_ID"
ENV_CPU_DEVICES = "MESHKIT_CPU_DEVICES"
ENV_LOCAL_DEVICE_IDS = "MESHKIT_LOCAL_DEVICE_IDS"
ENV_INIT_TIMEOUT = "MESHKIT_INIT_TIMEOUT"
# jax.distributed.initialize's heartbeat and shutdown timeouts, in whole seconds.
ENV_HEARTBEAT_TIMEOUT = "MESHKIT_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "MESHKIT_SHUTDOWN_TIMEOUT"
# JAX's persistent compilation cache directory (``meshkit launch --compilation-cache``).
ENV_COMPILATION_CACHE = "MESHKIT_COMPILATION_CACHE"
# Which start of the whole group this is: 0, then 1 after the first restart.
ENV_ATTEMPT = "MESHKIT_ATTEMPT"
# The run's status directory (stages, events).
ENV_STATUS = "MESHKIT_LAUNCH_STATUS"
# Seconds from a preemption notice to the end of every rank.
ENV_PREEMPT_GRACE = "MESHKIT_PREEMPT_GRACE"
DEFAULT_PREEMPT_GRACE_S = 25.0
# ``meshkit launch --profile-steps A:B --profile-dir D``: a trace of steps A to B on every rank.
ENV_PROFILE_STEPS = "MESHKIT_PROFILE_STEPS"
ENV_PROFILE_DIR = "MESHKIT_PROFILE_DIR"
DEFAULT_PROFILE_DIR = "meshkit-profile"  # without --profile-dir or --log-dir

# The kinds, and their fields:
JOINED = "joined"  # `meshkit.init` returned
# cause ("exception", "signal", "peer", "timeout", "divergence"), error (type or signal name),
# where (exception: file:line), process (peer), system (timeout, peer), processes, field
# (divergence)
FAILED = "failed"
# idle (s), state ("device", "meshkit", "python"), frame, inside (in a meshkit call), holding
# (the processes that hold the run, by the verdict)
STALLED = "stalled"
ENDED = "ended"  # reached the end of its program while others still ran
# step (None without a step_<n> directory), seconds, compiling (the seconds of compiles in it)
SAVED = "saved"
RESTORED = "restored"  # step, seconds, compiling
# how ("saved", "deadline", "ended"), source ("SIGTERM", "process P"), process, received,
# step, saved
PREEMPTED = "preempted"
# totals so far: seconds, programs, hits (persistent cache), tracing (seconds tracing and lowering)
COMPILED = "compiled"
# the run's steps so far (`StepRow`'s fields: per step, over the whole run), and aside: the
# seconds of compiles and checkpoints between the steps' batches
STEPS = "steps"
STRAGGLER = "straggler"  # process 0 named processes slower than the others: processes, said
KINDS = (JOINED, FAILED, STALLED, ENDED, SAVED, RESTORED, PREEMPTED, COMPILED, STEPS, STRAGGLER)
Directory = str | os.PathLike[str]


@dataclass(frozen=True)
class Event:
    """One record a rank wrote."""

    rank: int
    kind: str
    time: float
    fields: dict[str, Any] = field(default_factory=dict)


def path(directory: Directory, rank: int) -> Path:
    """The events file of ``rank`` in a run's status directory."""
    return Path(directory) / f"events-{rank}.jsonl"


def emit(kind: str, **fields: Any) -> None:
    """Append one event for the launcher (nothing outside a ``meshkit launch`` run)."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}; one of {KINDS}")
    directory, rank = os.environ.get(ENV_STATUS), _own_rank()
    if not directory or rank is None:
        return
    record = {"rank": rank, "kind": kind, "time": time.time(), **fields}
    line = (json.dumps(record, default=str) + "\n").encode()
    # Unbuffered append: one write per record. A lost event only makes a less precise report.
    with contextlib.suppress(OSError), open(path(directory, rank), "ab", buffering=0) as f:
        f.write(line)


def _own_rank() -> int | None:
    raw = os.environ.get(ENV_PROCESS_ID, "")
    return int(raw) if raw.isdigit() else None


# This process's time outside its steps so far, counted where it is spent (`count`): compiles
# (the ``compiled`` event's fields: seconds compiling, programs, hits of JAX's persistent cache,
# seconds tracing and lowering) and checkpoints (seconds saving and restoring). ``aside`` sums
# the seconds, which the steps set aside (the ``steps`` event, `meshkit.RuntimeInfo.goodput`).
totals: dict[str, float] = {"seconds": 0.0, "programs": 0, "hits": 0, "tracing": 0.0,
                            "saving": 0.0, "restoring": 0.0, "aside": 0.0}  # fmt: skip
_counting = threading.Lock()


def count(**amounts: float) -> dict[str, float]:
    """Add ``amounts`` to `totals` (the seconds to ``aside`` too); a copy of `totals` after."""
    with _counting:
        for name, amount in amounts.items():
            totals[name] += amount
            if name not in ("programs", "hits"):
                totals["aside"] += amount
        return dict(totals)


# A rank's stages while the cluster forms, in the order it goes through them.
STAGES = ("starting", "joining", "joined", "running", "exited")


def mark(stage: str, process_id: int | None = None) -> None:
    """Record this rank's stage for the launcher (nothing outside a `meshkit launch` run)."""
    where = os.environ.get(ENV_STATUS)
    process_id = _own_rank() if process_id is None else process_id
    if not where or process_id is None:
        return
    file = Path(where) / f"rank{process_id}"
    part = file.with_name(f".rank{process_id}.{os.getpid()}")
    with contextlib.suppress(OSError):  # written whole then renamed: never read in half
        part.write_text(stage)
        os.replace(part, file)


# Words of fail-fast's end note (for people; the launcher reads the ``ended`` event).
ENDED_MARK = "reached the end of its program"


@dataclass(frozen=True)
class Diagnosis:
    """A failure that JAX's cross-process machinery reported."""

    kind: str
    system: str
    line: str
    process: int | None = None


_RULES: tuple[tuple[str, str, re.Pattern[str]], ...] = tuple(
    (kind, system, re.compile(pattern, re.IGNORECASE))
    for kind, system, pattern in (
        ("timeout", "gloo", r"gloo.*(timed? ?out|deadline_exceeded)"),
        ("timeout", "NCCL", r"nccl.*(timed? ?out|timeout|watchdog)"),
        ("lost", "NCCL", r"nccl.*(remote process exited|connection closed|failed)"),
        ("timeout", "the coordination service", r"(GetKeyValue|barrier).*timed out"),
        ("timeout", "the coordination service", r"DEADLINE_EXCEEDED"),
        ("lost", "the coordination service", r"another task died"),
        ("lost", "the coordination service", r"leader task was preempted|Stream removed"),
        ("lost", "the coordination service", r"UNAVAILABLE|Socket closed|Connection reset"),
        ("lost", "gloo", r"gloo.*(connection closed|connection reset|Read error|EOF)"),
    )
)


def diagnose(text: str) -> Diagnosis | None:
    """The first line of ``text`` that a known cross-process failure wrote, classified."""
    for line in text.splitlines():
        for kind, system, pattern in _RULES:
            if pattern.search(line):  # JAX's, gloo's and NCCL's words name no process
                return Diagnosis(kind, system, line.strip())
    return None


def explain(diagnosis: Diagnosis) -> str:
    """What usually causes ``diagnosis``, and what to run next (several lines, no newline)."""
    what = (
        f"a timeout of {diagnosis.system}: this process waited for another process that never "
        "joined"
        if diagnosis.kind == "timeout"
        else f"reported by {diagnosis.system}: another process of the program (or the "
        "coordination service, which process 0 hosts) is gone"
    )
    return (
        f"meshkit: this error is {what}.\n"
        "Usual causes: a computation or collective run by only some processes (a branch on "
        "jax.process_index(), a value read on one process only), or a process that exited, "
        "crashed or stalled first; its own output holds the cause.\n"
        "Consider running again with MESHKIT_DEBUG=1: debug mode names the first meshkit call "
        "where processes differ."
    )


@dataclass(frozen=True)
class StepRow:
    """One process's steps in its latest window (milliseconds per step) and in all.

    Attributes:
        process: the process id.
        steps: steps of `meshkit.global_batches` this process has taken in all.
        step_ms: wall time per step (from one batch's arrival to the next's).
        data_ms: time per step the main thread waited for the next batch.
        loader_ms: time per batch the program's loader took (in meshkit's loader thread,
            ahead of the steps).
        host_ms: time per step the main thread computed (Python, dispatch).
        wait_ms: the rest of the step: waiting for the devices, or for the other processes.
    """

    process: int
    steps: int
    step_ms: float
    data_ms: float
    loader_ms: float
    host_ms: float
    wait_ms: float

    @property
    def own_ms(self) -> float:
        """The process's own work per step: its loader's time and its host work."""
        return self.loader_ms + self.host_ms


_PARTS = ("joining", "compiling", "steps", "saving", "restoring", "restarts", "redone")


@dataclass(frozen=True)
class Goodput:
    """Where the wall time of a run, or of one attempt of it, went, in seconds.

    Attributes:
        wall: the whole time.
        joining: until every process had joined (`meshkit.init` returned).
        compiling: tracing, lowering and compiling programs (or fetching them from JAX's
            persistent cache).
        steps: the steps of `meshkit.global_batches` kept: from the first batch's arrival to the
            last's, less the compiles and checkpoints between them, less ``redone``.
        saving: writing checkpoints (`meshkit.checkpoint.save`).
        restoring: reading them (`meshkit.checkpoint.restore`).
        restarts: stopping every process after a failure, and starting them again.
        redone: steps lost to a restart: those past the checkpoint that the next attempt
            restored, at their attempt's mean step time.

    Examples:
        >>> import meshkit
        >>> g = meshkit.Goodput.of(10.0, joining=1.0, compiling=2.0, steps=6.0)
        >>> round(g.other, 1), f"{g.ratio:.0%}"
        (1.0, '60%')
    """

    wall: float
    joining: float = 0.0
    compiling: float = 0.0
    steps: float = 0.0
    saving: float = 0.0
    restoring: float = 0.0
    restarts: float = 0.0
    redone: float = 0.0

    @classmethod
    def of(cls, wall: float, **parts: float) -> Goodput:
        """The measured ``parts`` (negative ones as 0) fitted into ``wall``.

        Parts measured apart may overlap (each is the slowest process's); where they add up to
        more than ``wall``, the steps give way first, then the last parts above.
        """
        raw, left, kept = cls(wall, **parts), max(wall, 0.0), {}
        for name in sorted(_PARTS, key=lambda p: p == "steps"):
            kept[name] = min(max(getattr(raw, name), 0.0), left)
            left -= kept[name]
        return cls(max(wall, 0.0), **kept)

    @property
    def other(self) -> float:
        """The wall time no part names: the program's own work outside the steps, its exit."""
        return max(self.wall - sum(getattr(self, p) for p in _PARTS), 0.0)

    @property
    def ratio(self) -> float:
        """The goodput: the share of the wall time spent in steps kept (0 without wall time)."""
        return self.steps / self.wall if self.wall > 0 else 0.0

    def __add__(self, other: Goodput) -> Goodput:
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return Goodput(*(a + b for a, b in pairs))

    def __str__(self) -> str:
        return goodput_table([("seconds", self)])


def goodput_table(columns: Sequence[tuple[str, Goodput]]) -> str:
    """A column per named `Goodput`: a row per part, then other, wall, and the goodput."""
    rows = [("", *(name for name, _ in columns))]
    for part in (*_PARTS, "other", "wall"):
        rows.append((part, *(f"{v:.1f}" if (v := getattr(g, part)) else "-" for _, g in columns)))
    rows.append(("goodput", *(f"{g.ratio:.0%}" for _, g in columns)))
    width = max(len(cell) for row in rows for cell in row[1:]) + 2
    return "".join(f"  {r[0]:<9}" + "".join(f"{c:>{width}}" for c in r[1:]) + "\n" for r in rows)
