"""This process's agreements: the one primitive (`agreement`) on the caller's channel.

A process that will not come calls `leave`; at exit, a process posts its `leave_record` at the
next agreement of every channel it agreed on (fail-fast reads an uncaught error in it).
`agree_later` is the deferred form (``global_array_from_local(check="deferred")``): a call
appends its summary to its tag's pending list and returns; the caller verifies the list, in its
own thread, with one agreement of its channel's sequence: at the tag's `W`-th pending call (the
same call in every process), at the channel's next waiting agreement (`sync_point`), at
`verify_all` (the explicit drain, and exit). docs/coordination.md, "The deferred form".
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..core import compat as _compat
from ..core.errors import MeshkitError
from ..core.log import logger, say
from ..lifecycle import exit as _exit
from ..lifecycle import failfast as _failfast
from . import agreement as _agreement
from . import channel as _channel
from . import missing as _missing
from .node import LEFT, Group, Node, Outcome, RecordText, text
from .places import MAIN
from .service import JaxService, Stats

stats = Stats()  # this process's round trips (tests and benchmarks read them)
_node: Node | None = None
_client: object = None  # the client `_node` talks through
tag_part = _channel.tag_part
_LOG = logger("coord")
_unraised: list[BaseException] = []  # checks that failed at exit, where no call can raise them
leaving: dict[str, str] = {}  # more fields of this process's leave record (debug mode: "last")


def node() -> Node | None:
    """This process at the coordination service; None when it runs alone (no agreement)."""
    global _node, _client
    client, me, n = _compat.distributed_state()
    if client is None or n == 1:
        return None
    if _node is None or _client is not client:
        if _node is None:  # at first use, never at import
            _exit.on_exit("agreements: verify, then leave", _at_exit, order=_exit.DRAIN)
            _exit.on_exit("agreements: end after a failed check", _end, order=_exit.FLUSH - 1)
        _node, _client = Node(JaxService(client), me, n, stats=stats), client
    return _node


def counts() -> dict[str, int]:
    """The steps taken per iterator (`places.Moving`) in this process; {} before any."""
    return {} if _node is None else dict(_node.counts)  # one copy, under the GIL


def in_step() -> None:
    """Every process finished its work: start every channel's sequence again, under new keys."""
    if _node is not None:
        with _node.lock:
            for name, state in list(_node.sequences.items()):
                _node.sequences[name] = _agreement.Sequence(epoch=state.epoch + 1)


def agree(
    tag: str,
    summary: str,
    record: RecordText,
    *,
    timeout: float,
    groups: Mapping[str, Group] | None = None,
    what: str = "",
    channel: str | None = None,
) -> Outcome:
    """`agreement.agree` on the caller's channel (or ``channel``'s).

    First the channel's deferred checks (`agree_later`) are verified: a difference raises.
    """
    here = node()
    if here is None:
        return Outcome(True, {_compat.distributed_state()[1]: text(record)})
    sync_point(here)
    outcome = _agreement.agree(
        here,
        _agreement.channel_sequence(here, channel),
        tag,
        summary,
        record,
        timeout=timeout,
        groups=groups,
        what=what,
    )
    if not outcome.agreed:
        for p, error in sorted(_left(outcome).items()):
            if error is not None:  # it ended by an uncaught exception
                _failfast.peer_failed(p, error)
    return outcome


def check(tag: str, summary: str, record: RecordText, *, timeout: float, what: str = "") -> Outcome:
    """`agree`; a `MeshkitError` when a process left the program instead of coming."""
    outcome = agree(tag, summary, record, timeout=timeout, what=what)
    left = _left(outcome) if not outcome.agreed else {}
    if left:
        raise MeshkitError(_missing.left_program(what or tag, left))
    return outcome


def leave_record(**fields: object) -> str:
    """The record of a process that leaves the program: ``"left": true``, how, and ``fields``.

    ``"status"``: ``"error"`` (its first line in ``"message"``) after an uncaught exception.
    """
    error = getattr(sys, "last_value", None)
    how: dict[str, object] = {"left": True, "status": "exit"}
    if isinstance(error, BaseException):
        first = (str(error).splitlines() or [""])[0][:300]
        how.update(status="error", message=f"{type(error).__name__}: {first}")
    return json.dumps({**how, **fields})


def _left(outcome: Outcome) -> dict[int, str | None]:
    """The processes that left the program (`leave_record`): each one's error, or None."""
    left: dict[int, str | None] = {}
    for p, value in outcome.records.items():
        try:
            record = json.loads(value)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("left") is True:
            failed = record.get("status") == "error"
            left[p] = str(record.get("message") or "(no message)") if failed else None
    return left


def agree_later(
    tag: str,
    summary: str,
    record: RecordText,
    *,
    timeout: float,
    on_outcome: Callable[[Outcome], None],
    groups: Mapping[str, Group] | None = None,
) -> None:
    """`defer` for this process: the call is verified by a later one (which may raise).

    A tag is either agreed in the call (`agree`) or after it returns (`agree_later`), never both.
    """
    here = node()
    if here is not None:
        defer(here, tag, summary, record, timeout=timeout, on_outcome=on_outcome, groups=groups)


def leave(
    tag: str,
    record: str,
    *,
    later: bool = False,
    channel: str | None = None,
) -> None:
    """Tell the processes at the next agreement (of ``channel``) that this one will not come.

    ``later``: the tag is agreed after the call returns (`agree_later`): its pending calls are
    posted with ``record``.
    """
    here = node()
    if here is None:
        return
    if later:
        leave_deferred(here, tag, record)
    else:
        _agreement.leave(here, _agreement.channel_sequence(here, channel), tag, record)


def drain() -> None:
    """Verify every `agree_later` call of this process now (a difference raises)."""
    if _node is not None:
        verify_all(_node)


def fail_at_exit(error: BaseException) -> None:
    """A check failed at exit, where no call can raise ``error``: the process ends with status 1."""
    _unraised.append(error)


def _at_exit() -> None:
    """Verify what is pending (post it, when failing), let meshkit's waits stop, then leave.

    A process waiting for this one at any channel's next agreement reads why it did not come.
    """
    if _node is None:
        return
    try:
        if not _exit.ending():
            verify_all(_node)
        for tag in list(_node.deferred):  # left by a failing process: the others name it
            with contextlib.suppress(Exception):  # it ends anyway
                leave_deferred(_node, tag, leave_record())
    except Exception as e:
        fail_at_exit(e)
    finally:
        _node.stopping.set()
    record = leave_record(**leaving)
    for sequence in sorted({MAIN, *_node.sequences}):
        with contextlib.suppress(Exception):  # leaving anyway: a service that is gone is no news
            _agreement.leave(_node, sequence, "exit", record)


def _end() -> None:
    """After the leaves are posted: a check that failed at exit ends the process with status 1."""
    if _unraised and not _exit.ending():
        error = _unraised[0]
        say(
            _LOG, logging.ERROR,
            "meshkit: exiting with status 1: a cross-process check failed after this process's "
            f"last meshkit call, so nothing raised it:\n{type(error).__name__}: {error}\n",
        )  # fmt: skip
        _exit.now(1)


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


def defer(
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


def leave_deferred(node: Node, tag: str, record: str) -> None:
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
