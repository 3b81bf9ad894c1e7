"""Events: what a rank tells ``meshkit launch``, as records, never as sentences.

A rank appends one JSON object per line to ``events-<rank>.jsonl`` in the run's status
directory (one ``write`` each, so records never interleave). Outside a launch `emit` does
nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .contract import ENV_PROCESS_ID, ENV_STATUS

# The kinds, and their fields:
JOINED = "joined"  # `meshkit.init` returned
# cause ("exception", "signal", "peer", "timeout", "divergence"), error (type or signal name),
# where (exception: file:line), process (peer), system (timeout, peer), processes, field
# (divergence)
FAILED = "failed"
STALLED = "stalled"  # inside (in a meshkit call), frame, idle (s), last (the last meshkit call)
ENDED = "ended"  # reached the end of its program while others still ran
SAVED = "saved"  # step (None without a step_<n> directory)
RESTORED = "restored"  # step, seconds
# how ("saved", "deadline", "ended"), source ("SIGTERM", "process P"), process, received,
# step, saved
PREEMPTED = "preempted"
COMPILED = "compiled"  # totals so far: seconds, programs, hits (persistent cache)
KINDS = (JOINED, FAILED, STALLED, ENDED, SAVED, RESTORED, PREEMPTED, COMPILED)
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


def emit(
    kind: str, *, rank: int | None = None, directory: Directory | None = None, **fields: Any
) -> None:
    """Append one event for the launcher (nothing outside a ``meshkit launch`` run)."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}; one of {KINDS}")
    directory = directory if directory is not None else os.environ.get(ENV_STATUS)
    rank = own_rank() if rank is None else rank
    if not directory or rank is None:
        return
    record = {"rank": rank, "kind": kind, "time": time.time(), **fields}
    line = (json.dumps(record, default=str) + "\n").encode()
    with contextlib.suppress(OSError):  # a lost event only makes a less precise report
        fd = os.open(path(directory, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def own_rank() -> int | None:
    """This rank under ``meshkit launch`` (``MESHKIT_PROCESS_ID``), else None."""
    raw = os.environ.get(ENV_PROCESS_ID, "")
    return int(raw) if raw.isdigit() else None


def read(directory: Directory, ranks: int | Iterable[int]) -> list[Event]:
    """The events of ``ranks`` (a count: ranks 0..n-1), in the order written (time, then rank)."""
    out = []
    for rank in range(ranks) if isinstance(ranks, int) else ranks:
        try:
            lines = path(directory, rank).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # cut short by a crash
                continue
            if isinstance(record, dict) and record.get("kind") in KINDS:
                writer, kind = int(record.pop("rank")), record.pop("kind")
                out.append(Event(writer, kind, float(record.pop("time")), fields=record))
    return sorted(out, key=lambda e: (e.time, e.rank))
