"""A picture of a run: one lane per rank over time, drawn from the events the ranks wrote.

`meshkit launch --log-dir D` keeps every attempt's events in ``D/events.jsonl`` and draws
``D/timeline.svg`` after each attempt: a self-contained SVG a browser opens. Each lane shows when
the rank joined and compiled, its steps of `meshkit.global_batches` (a line rising with the
steps taken), checkpoints saved and restored, stalls, the preemption, its failure or end, and a
straggler's lane in red; each attempt is a band, so restarts show as gaps between bands. Every
mark carries a tooltip with the event's fields.
"""

from __future__ import annotations

import contextlib
import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from ..core import events as _events
from ..core.events import Event

EVENTS = "events.jsonl"
PICTURE = "timeline.svg"
_LEFT, _WIDTH, _LANE, _TOP = 90, 900, 34, 46  # pixels
_MARKS = {  # kind: (shape, colour)
    _events.JOINED: ("circle", "#555"),
    _events.COMPILED: ("tick", "#1f77b4"),
    _events.SAVED: ("triangle", "#2ca02c"),
    _events.RESTORED: ("circle", "#2ca02c"),
    _events.STALLED: ("tick", "#ff7f0e"),
    _events.PREEMPTED: ("diamond", "#9467bd"),
    _events.FAILED: ("cross", "#d62728"),
    _events.ENDED: ("square", "#555"),
}


def record(log_dir: Path, attempt: int, records: Iterable[Event], ranks: Sequence[int]) -> None:
    """Add one attempt's events to ``log_dir``'s record of the run, and draw the run again."""
    path = log_dir / EVENTS
    with contextlib.suppress(OSError):  # a picture is not worth failing the run for
        with path.open("a" if attempt else "w", encoding="utf-8") as f:
            for e in records:
                f.write(json.dumps({**asdict(e), "attempt": attempt}, default=str) + "\n")
        (log_dir / PICTURE).write_text(draw(read(path), ranks), encoding="utf-8")


def read(path: Path) -> list[tuple[int, Event]]:
    """The ``(attempt, event)`` pairs kept in ``path``."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            fields = json.loads(line)
            attempt = int(fields.pop("attempt"))
            out.append((attempt, Event(**fields)))
    return out


def draw(kept: Sequence[tuple[int, Event]], ranks: Sequence[int]) -> str:
    """The SVG of a run: ``kept`` events of every attempt, a lane for each of ``ranks``."""
    times = [e.time for _, e in kept] or [0.0]
    t0, span = min(times), max(max(times) - min(times), 1e-3)

    def x(t: float) -> float:
        return _LEFT + (t - t0) / span * _WIDTH

    lanes = {r: _TOP + i * _LANE for i, r in enumerate(sorted(ranks))}
    height = _TOP + len(lanes) * _LANE + 40
    slow = {p for _, e in kept if e.kind == _events.STRAGGLER for p in e.fields["processes"]}
    most = max(
        (int(e.fields.get("steps", 0)) for _, e in kept if e.kind == _events.STEPS), default=0
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 20}" '
        f'height="{height}" font-family="sans-serif" font-size="12">',
        f'<text x="{_LEFT}" y="18" font-size="14">meshkit launch: {len(lanes)} ranks, '
        f"{len({a for a, _ in kept}) or 1} attempt(s), {span:.1f} s</text>",
    ]
    for attempt in sorted({a for a, _ in kept}):
        ts = [e.time for a, e in kept if a == attempt]
        out.append(
            f'<rect class="attempt" x="{x(min(ts)):.1f}" y="{_TOP - 14}" '
            f'width="{max(x(max(ts)) - x(min(ts)), 2):.1f}" height="{len(lanes) * _LANE + 8}" '
            f'fill="#f2f2f2"><title>attempt {attempt}</title></rect>'
            f'<text x="{x(min(ts)) + 2:.1f}" y="{_TOP - 18}" fill="#888">attempt {attempt}</text>'
        )
    for rank, y in lanes.items():
        colour = "#d62728" if rank in slow else "#000"
        label = f"rank {rank}" + (" (slow)" if rank in slow else "")
        out.append(
            f'<text class="lane" x="4" y="{y + 4}" fill="{colour}">{label}</text>'
            f'<line x1="{_LEFT}" y1="{y}" x2="{_LEFT + _WIDTH}" y2="{y}" stroke="#ddd"/>'
        )
        for attempt in sorted({a for a, _ in kept}):
            steps = [(e.time, int(e.fields.get("steps", 0))) for a, e in kept
                     if a == attempt and e.rank == rank and e.kind == _events.STEPS]  # fmt: skip
            if steps and most:
                points = " ".join(
                    f"{x(t):.1f},{y + 12 - 24 * n / most:.1f}" for t, n in steps
                )  # fmt: skip
                out.append(
                    f'<polyline class="steps" points="{points}" fill="none" stroke="{colour}" '
                    f'stroke-width="1.5"><title>rank {rank}: {steps[-1][1]} steps</title>'
                    "</polyline>"
                )
        for _, e in kept:
            if e.rank == rank and e.kind in _MARKS:
                out.append(_mark(e, x(e.time), y))
    out.append(_legend(height - 14))
    return "\n".join(out) + "\n</svg>\n"


def _mark(e: Event, cx: float, y: float, group: str = "") -> str:
    shape, colour = _MARKS[e.kind]
    tip = html.escape(f"rank {e.rank}: {e.kind} " + json.dumps(e.fields, default=str)[:300])
    body = {
        "circle": f'<circle cx="{cx:.1f}" cy="{y}" r="4" fill="{colour}"/>',
        "tick": f'<rect x="{cx - 1:.1f}" y="{y - 9}" width="3" height="18" fill="{colour}"/>',
        "triangle": f'<path d="M{cx:.1f},{y - 6} l6,11 h-12 z" fill="{colour}"/>',
        "diamond": f'<path d="M{cx:.1f},{y - 7} l7,7 l-7,7 l-7,-7 z" fill="{colour}"/>',
        "cross": f'<path d="M{cx - 6:.1f},{y - 6} l12,12 m0,-12 l-12,12" stroke="{colour}" '
        'stroke-width="3"/>',
        "square": f'<rect x="{cx - 4:.1f}" y="{y - 4}" width="8" height="8" fill="{colour}"/>',
    }[shape]
    return f'<g class="{group or e.kind}"><title>{tip}</title>{body}</g>'


def _legend(y: float) -> str:
    parts, cx = [], float(_LEFT)
    for kind in _MARKS:
        parts.append(_mark(Event(0, kind, 0.0), cx, y, group="legend"))
        parts.append(f'<text x="{cx + 9:.1f}" y="{y + 4}" fill="#555">{kind}</text>')
        cx += 95
    return "\n".join(parts)
