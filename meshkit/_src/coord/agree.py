"""This process's agreements: the one primitive (`agreement`) on the caller's channel.

A process that will not come calls `leave`; at exit, a process posts its `leave_record` at the
next agreement of every channel it agreed on (fail-fast reads an uncaught error in it).
``agree(..., later=...)`` is the deferred form (``global_array_from_local(check="deferred")``):
the agreement is held back in its channel's sequence and verified, in the caller's thread, with
the others held there: at the `W`-th, at the channel's next agreement, at `drain` (and exit).
docs/coordination.md, "The deferred form".
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Callable, Mapping

from ..core import compat as _compat
from ..core.errors import MeshkitError
from ..core.log import logger, say
from ..lifecycle import exit as _exit
from ..lifecycle import failfast as _failfast
from . import agreement as _agreement
from . import channel as _channel
from . import missing as _missing
from .node import Group, Node, Outcome, RecordText, text
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


def agree(
    tag: str,
    summary: str,
    record: RecordText,
    *,
    timeout: float,
    groups: Mapping[str, Group] | None = None,
    what: str = "",
    channel: str | None = None,
    later: Callable[[Outcome], None] | None = None,
    meet: bool = True,
) -> Outcome:
    """`agreement.agree` on the caller's channel (or ``channel``'s).

    First the channel's deferred checks (``later``) are verified: a difference raises.
    """
    here = node()
    if here is None:
        return Outcome(True, {_compat.distributed_state()[1]: text(record)})
    outcome = _agreement.agree(
        here,
        _agreement.channel_sequence(here, channel),
        tag,
        summary,
        record,
        timeout=timeout,
        groups=groups,
        what=what,
        later=later,
        meet=meet,
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


def leave(tag: str, record: str, *, channel: str | None = None) -> None:
    """Tell the processes at the next agreement (of ``channel``) that this one will not come.

    Its deferred checks not verified yet are posted with ``record`` (`agreement.leave`).
    """
    here = node()
    if here is not None:
        _agreement.leave(here, _agreement.channel_sequence(here, channel), tag, record)


def drain() -> None:
    """Verify every deferred check of this process now (a difference raises)."""
    if _node is not None:
        for sequence in list(_node.sequences):
            _agreement.verify(_node, sequence)


def fail_at_exit(error: BaseException) -> None:
    """A check failed at exit, where no call can raise ``error``: the process ends with status 1."""
    _unraised.append(error)


def _at_exit() -> None:
    """Verify what is held back, let meshkit's waits stop, then leave.

    A process waiting for this one at any channel's next agreement reads why it did not come;
    the calls a failing process held back are posted at the agreement before (the others name
    the first that differs).
    """
    if _node is None:
        return
    try:
        if not _exit.ending():
            drain()
    except Exception as e:
        fail_at_exit(e)
    finally:
        _node.stopping.set()
    record = leave_record(**leaving)
    for sequence in sorted({MAIN, *_node.sequences}):
        state = _node.sequences.get(sequence)
        with contextlib.suppress(Exception):  # leaving anyway: a service that is gone is no news
            if state is not None and state.later:
                _agreement.leave(_node, sequence, "exit", record)  # with the held calls
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
