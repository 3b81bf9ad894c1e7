"""Events: what a rank tells ``meshkit launch``, as records, never as sentences.

A rank under ``meshkit launch`` appends one JSON object per line to ``events-<rank>.jsonl`` in
the run's status directory (``MESHKIT_LAUNCH_STATUS``). The launcher reads them to decide its
report (which rank failed first and why, who stalled where, who reached the end); messages
printed for people may be reworded freely, and no verdict changes.

Each record has ``rank``, ``kind`` (one of `KINDS`), ``time`` (seconds since the epoch) and the
fields its kind documents. A record is written with one ``write`` on a file opened for
appending, so records from one rank never interleave, and a reader sees whole lines only (a
line cut short by a crash is skipped). Outside a ``meshkit launch`` run `emit` does nothing.

Example:
    >>> import os, tempfile
    >>> directory = tempfile.mkdtemp()
    >>> emit(FAILED, rank=1, directory=directory, error="ValueError", cause="exception")
    >>> [(e.rank, e.kind, e.fields["cause"]) for e in read(directory, 2)]
    [(1, 'failed', 'exception')]
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .contract import ENV_PROCESS_ID, ENV_STATUS

__all__ = [
    "COMPILED",
    "ENDED",
    "FAILED",
    "JOINED",
    "KINDS",
    "PREEMPTED",
    "RESTORED",
    "SAVED",
    "STALLED",
    "Event",
    "emit",
    "path",
    "read",
]

# This rank joined the cluster (`meshkit.init` returned). Fields: none.
JOINED = "joined"
# This rank is failing. Fields: ``cause`` ("exception", "signal", "peer" - another process
# failed first, "timeout" - one of JAX's cross-process waits ran out), ``error`` (the
# exception's type name, or the signal's name), ``where`` (for "exception": the ``file:line`` it
# was raised at), ``process`` (for "peer": the process that failed first), ``system`` (for
# "timeout"/"peer": what reported it, e.g. "gloo"); cause "divergence" (a `DivergenceError`:
# processes differ) has ``processes`` (those it names) and ``field``.
FAILED = "failed"
# The stall watchdog fired. Fields: ``inside`` (True: waiting in a meshkit call; False: in the
# program's own code), ``frame`` (``file:line in function`` of the main thread), ``idle`` (s),
# ``last`` (the last meshkit call, as its report names it, or None; the launcher's stall summary
# shows it).
STALLED = "stalled"
# This rank reached the end of its program while others still ran. Fields: none.
ENDED = "ended"
# This rank saved a checkpoint completely (`meshkit.checkpoint.save`). Fields: ``step`` (from a
# ``step_<n>`` directory name; None otherwise).
SAVED = "saved"
# This rank restored a checkpoint (`meshkit.checkpoint.restore`). Fields: ``step`` (as for
# SAVED), ``seconds`` (how long the restore took).
RESTORED = "restored"
# This rank ends after a preemption notice (`meshkit._src.lifecycle.preemption`). Fields:
# ``how`` ("saved": it saved after the sync point; "deadline": the grace ran out; "ended": its
# program returned), ``source`` ("SIGTERM": it received the notice; "process P": P told it),
# ``process`` (the process that received it), ``received`` (when, seconds since the epoch),
# ``step`` (the program's last step meshkit saw, or None), ``saved`` (for "saved": the step).
PREEMPTED = "preempted"
# This rank finished compiling a program (`meshkit._src.runtime.compile_cache`). Fields, all
# totals since it started: ``seconds`` (compiling, or fetching from JAX's persistent compilation
# cache), ``programs`` (how many), ``hits`` (how many came from that cache).
COMPILED = "compiled"
KINDS = (JOINED, FAILED, STALLED, ENDED, SAVED, RESTORED, PREEMPTED, COMPILED)


@dataclass(frozen=True)
class Event:
    """One record a rank wrote.

    Attributes:
        rank: the rank that wrote it.
        kind: one of `KINDS`.
        time: when, in seconds since the epoch.
        fields: what its kind documents.
    """

    rank: int
    kind: str
    time: float
    fields: dict[str, Any] = field(default_factory=dict)


def path(directory: str | os.PathLike[str], rank: int) -> Path:
    """The events file of ``rank`` in a run's status directory."""
    return Path(directory) / f"events-{rank}.jsonl"


def emit(
    kind: str,
    *,
    rank: int | None = None,
    directory: str | os.PathLike[str] | None = None,
    **fields: Any,
) -> None:
    """Append one event for the launcher (nothing outside a ``meshkit launch`` run).

    Args:
        kind: one of `KINDS`.
        rank: this rank (default: the launcher's ``MESHKIT_PROCESS_ID``).
        directory: the status directory (default: the launcher's ``MESHKIT_LAUNCH_STATUS``).
        **fields: the kind's fields; JSON-serializable.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}; one of {KINDS}")
    directory = directory if directory is not None else os.environ.get(ENV_STATUS)
    if rank is None:
        raw = os.environ.get(ENV_PROCESS_ID, "")
        rank = int(raw) if raw.isdigit() else None
    if not directory or rank is None:
        return
    record = {"rank": rank, "kind": kind, "time": time.time(), **fields}
    line = (json.dumps(record, default=str) + "\n").encode()
    try:
        fd = os.open(path(directory, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:  # an event the launcher cannot read only makes a less precise report
        pass


def _records(file: Path) -> Iterator[dict[str, Any]]:
    try:
        text = file.read_text()
    except OSError:
        return
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # cut short by a crash
            continue
        if isinstance(record, dict) and record.get("kind") in KINDS:
            yield record


def read(directory: str | os.PathLike[str], ranks: int | Iterable[int]) -> list[Event]:
    """The events of ``ranks`` (a count: ranks 0..n-1), in the order written (time, then rank)."""
    out = []
    for rank in range(ranks) if isinstance(ranks, int) else ranks:
        for record in _records(path(directory, rank)):
            fields = {k: v for k, v in record.items() if k not in ("rank", "kind", "time")}
            out.append(Event(int(record["rank"]), record["kind"], float(record["time"]), fields))
    return sorted(out, key=lambda e: (e.time, e.rank))
