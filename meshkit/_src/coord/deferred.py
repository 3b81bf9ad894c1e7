"""Checks verified after their call returned (``global_array_from_local(check="deferred")``).

A call appends its summary to its tag's pending list and returns. The caller verifies the list,
in its own thread, with one agreement of its channel's sequence: at the tag's `W`-th pending
call (the same call in every process), at the channel's next waiting agreement (`sync_point`),
at `verify_all` (the explicit drain, and exit). docs/coordination.md, "The deferred form".
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import agreement as _agreement
from .node import LEFT, Group, Node, Outcome, RecordText, text

W = 64  # pending calls per tag: the W-th verifies them all (one agreement per W calls)


@dataclass
class Call:
    """One pending call: what its agreement would have compared, and how its error is raised."""

    summary: str
    record: RecordText
    groups: dict[str, Group]
    on_outcome: Callable[[Outcome], None]  # raises the call's error from the outcome at it


@dataclass
class Pending:
    """A tag's calls not verified yet (one thread at a time makes them: the tag's channel's)."""

    channel: str | None
    timeout: float
    calls: list[Call] = field(default_factory=list)


def add(
    node: Node,
    tag: str,
    summary: str,
    record: RecordText,
    *,
    timeout: float,
    on_outcome: Callable[[Outcome], None],
    groups: Mapping[str, Group] | None = None,
) -> None:
    """Keep a call of ``tag`` for verification; the `W`-th verifies them (and may raise)."""
    pending = node.deferred.get(tag)
    if pending is None:
        pending = node.deferred[tag] = Pending(node.channel(), timeout)
    pending.calls.append(Call(summary, record, dict(groups or {}), on_outcome))
    if len(pending.calls) >= W:
        verify(node, tag)


def verify(node: Node, tag: str) -> None:
    """One agreement on ``tag``'s pending calls, run by run; a difference raises (`_report`)."""
    pending = node.deferred.pop(tag, None)
    if pending is None:
        return
    calls = pending.calls
    runs = [[s, len(list(run))] for s, run in itertools.groupby(c.summary for c in calls)]
    groups = {f"{i}/{name}": g for i, c in enumerate(calls) for name, g in c.groups.items()}
    outcome = _agreement.agree(
        node,
        _agreement.channel_sequence(node, pending.channel),
        tag,
        json.dumps(runs),
        lambda: json.dumps(_entries(calls)),
        timeout=pending.timeout,
        groups=groups,
    )
    if not outcome.agreed:
        _report(calls, outcome)


def sync_point(node: Node) -> None:
    """Before an agreement the caller waits for: its channel's pending calls are verified first."""
    here = node.channel()
    for tag in [t for t, p in list(node.deferred.items()) if p.channel == here]:
        verify(node, tag)


def verify_all(node: Node) -> None:
    """Verify every pending call of this process (the first difference raises)."""
    for tag in list(node.deferred):
        verify(node, tag)


def leave(node: Node, tag: str, record: str) -> None:
    """This process will not verify ``tag``'s pending calls: post them and ``record`` (why)."""
    pending = node.deferred.pop(tag, None)
    channel = node.channel() if pending is None else pending.channel
    left = [{"summary": LEFT, "record": record, "groups": {}}]
    posted = json.dumps(([] if pending is None else _entries(pending.calls)) + left)
    _agreement.leave(node, _agreement.channel_sequence(node, channel), tag, posted)


def _entries(calls: list[Call]) -> list[dict]:
    return [{"summary": c.summary, "record": text(c.record), "groups": c.groups} for c in calls]


def _report(calls: list[Call], outcome: Outcome) -> None:
    """Name the first pending call on which the processes differ (its ``on_outcome`` raises)."""
    posted = {p: _listed(r) for p, r in outcome.records.items()}
    width = max((len(v) for v in posted.values()), default=1)
    i, here, absent = 0, {}, set(outcome.missing)
    for i in range(width):  # stops at the first call that differs, else at the last one
        here = {p: v[i] for p, v in posted.items() if i < len(v)}
        absent = set(outcome.missing) | (posted.keys() - here.keys())
        compared = {
            p: _agreement.Entry("", "", "", e["summary"], "", e["groups"]) for p, e in here.items()
        }
        if absent or not _agreement.same(compared):
            break
    records = {p: e["record"] for p, e in here.items()}
    call = calls[min(i, len(calls) - 1)]
    call.on_outcome(Outcome(False, records, tuple(sorted(absent)), outcome.gave_up, outcome.seq))


def _listed(record: str) -> list[dict]:
    """A process's posted calls; a process that left the program posted its leave record alone."""
    value = json.loads(record)
    return value if isinstance(value, list) else [{"summary": LEFT, "record": record, "groups": {}}]
