"""This process's agreements: the one primitive (`agreement`) on the caller's channel.

`agree_later` (`window`) is the deferred form. A process that will not come calls `leave`; one
that leaves the program posts a `leave_record` (fail-fast reads an uncaught error in it).
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Callable, Mapping

from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError
from ..lifecycle import exit as _exit
from ..lifecycle import failfast as _failfast
from . import agreement as _agreement
from . import channel as _channel
from . import missing as _missing
from . import window as _window
from .node import Group, Node, Outcome, RecordText, text
from .service import JaxService, Stats

stats = Stats()  # this process's round trips (tests and benchmarks read them)
# disagreements found after their call returned (check="deferred"), for `settle`
failures: deque[BaseException] = deque()
_node: Node | None = None
_client: object = None  # the client `_node` talks through
tag_part = _channel.tag_part


def node() -> Node | None:
    """This process at the coordination service; None when it runs alone (no agreement)."""
    global _node, _client
    client, me, n = _compat.distributed_state()
    if client is None or n == 1:
        return None
    if _node is None or _client is not client:
        if _node is None:  # at first use, never at import
            _exit.on_exit(
                "agreements: verify what is pending, stop their threads",
                _drain_at_exit,
                order=_exit.DRAIN,
            )
        _node, _client = Node(JaxService(client), me, n, stats=stats, failures=failures), client
    return _node


def settle() -> None:
    """Raise the first disagreement `agree_later` found since the last call, if any."""
    if failures and _node is not None:
        _node.settle()


def take_unraised() -> BaseException | None:
    """Take the failure kept for the next meshkit call, for an uncaught exception it caused."""
    try:
        return failures.popleft()
    except IndexError:  # none (only a node keeps failures), or another thread raised it
        return None


def in_step() -> None:
    """Every process finished its work: restart the sequences (`agreement.restart`)."""
    if _node is not None:
        _agreement.restart(_node)


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

    First the channel's windows (`agree_later`) are verified, and what they found is raised.
    """
    here = node()
    if here is not None:
        _window.sync_point(here, timeout)
    settle()
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
    """`window.agree_later` for this process: returns at once.

    A tag is either agreed in the call (`agree`) or after it returns (`agree_later`), never both.
    """
    settle()
    here = node()
    if here is None:
        return
    _window.agree_later(
        here, tag, summary, record, timeout=timeout, on_outcome=on_outcome, groups=groups
    )
    settle()


def leave(
    tag: str,
    record: str,
    *,
    later: bool = False,
    channel: str | None = None,
) -> None:
    """Tell the processes at the next agreement (of ``channel``) that this one will not come.

    ``later``: the tag is agreed after the call returns (`agree_later`); this call waits (at most
    the check timeout) until its thread has posted ``record``.
    """
    here = node()
    if here is None:
        return
    if later:
        _window.leave_later(here, tag, record, _env.check_timeout())
    else:
        _agreement.leave(here, _agreement.channel_sequence(here, channel), tag, record)


def drain(timeout: float) -> bool:
    """Wait until every `agree_later` call of this process is verified (or ``timeout``)."""
    return True if _node is None else _node.drain(timeout)


def _drain_at_exit() -> None:
    """Verify what is pending (a few seconds at most), then let meshkit's threads leave."""
    if _node is not None:
        _node.stop()
