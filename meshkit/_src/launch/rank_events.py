"""The launcher's reading of the events its ranks wrote (`meshkit._src.core.events`).

The ranks write the records; only the launcher reads them back: all of a run's events, each
rank's step times, and the diagnosis a rank recorded with its failure.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core import events as _events


def read(directory: _events.Directory, ranks: int | Iterable[int]) -> list[_events.Event]:
    """The events of ``ranks`` (a count: ranks 0..n-1), in the order written (time, then rank)."""
    out = []
    for rank in range(ranks) if isinstance(ranks, int) else ranks:
        try:
            lines = _events.path(directory, rank).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # cut short by a crash
                continue
            if isinstance(record, dict) and record.get("kind") in _events.KINDS:
                writer, kind = int(record.pop("rank")), record.pop("kind")
                out.append(_events.Event(writer, kind, float(record.pop("time")), fields=record))
    return sorted(out, key=lambda e: (e.time, e.rank))


def step_rows(records: Iterable[_events.Event]) -> list[_events.StepRow]:
    """Each rank's last ``steps`` event as a `StepRow`, the slowest own work first."""
    last = {e.rank: e for e in records if e.kind == _events.STEPS}
    fields = [f.name for f in dataclasses.fields(_events.StepRow)]
    rows = [_events.StepRow(**{k: e.fields.get(k, 0) for k in fields}) for e in last.values()]
    return sorted(rows, key=lambda r: (-r.own_ms, r.process))


def table_text(table: Sequence[_events.StepRow], ranks: Mapping[int, str] | None = None) -> str:
    """One line per process: its row in milliseconds per step (``ranks``: how to name each)."""
    name = ranks or {}
    return "".join(
        f"  {name.get(r.process, f'process {r.process}')}: {r.steps} steps, {r.step_ms:.1f} ms "
        f"per step: {r.loader_ms:.1f} in the loader, {r.host_ms:.1f} host work, "
        f"{r.data_ms:.1f} waiting for the batch, {r.wait_ms:.1f} for the devices or the others\n"
        for r in table
    )


def from_event(fields: Mapping[str, Any]) -> _events.Diagnosis | None:
    """The diagnosis a rank recorded in its ``failed`` event, or None for an error of its own."""
    cause = fields.get("cause")
    if cause not in ("peer", "timeout"):
        return None
    raw = fields.get("process")
    process = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    system = str(fields.get("system") or ("meshkit" if process is not None else "JAX"))
    kind = "lost" if cause == "peer" else "timeout"
    return _events.Diagnosis(kind, system, str(fields.get("error") or ""), process)
