"""Cross-process agreement in O(1) coordination-service round trips per process and call.

Every cross-process check of meshkit (the pieces of `global_array_from_local`, debug mode's
call fingerprints, `make_mesh`, `barrier`, the steps of `global_batches`) asks one question:
*did every process arrive, and do their summaries agree?* This module answers it for the
calling process, through the coordination service of `jax.distributed` (`service.JaxService`),
never through a device collective (those are what hang when processes diverge). Three forms, by
what the caller needs, each a protocol of its own module over `service.Service`:

- `check` (`barrier`): any difference is an error; one barrier wait per process and call.
- `agree` (`counter`): records that may legitimately differ (the sizes of an uneven batch, host
  arguments); every process gets every record whenever they differ.
- `agree_later` (`window`): `agree` verified beside the caller on windows of calls, by a
  thread per tag; a disagreement is raised by this process's next meshkit call (`settle`).

A process that leaves a sequence of agreements calls `leave` (`leave_check` for a tag of
`check`), so the others learn at once, from its record, why it will not come.

Keys are grouped in blocks of ``BLOCK`` agreements; process 0 deletes a block once every
process is two blocks past it, so the store does not grow in a long run.
"""

from __future__ import annotations

import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from ..core import compat as _compat
from ..core import env as _env
from ..lifecycle import exit as _exit
from . import barrier as _barrier
from . import counter as _counter
from . import window as _window
from .node import BLOCK, Group, Node, Outcome, Record
from .service import JaxService, Stats

__all__ = [
    "BLOCK",
    "LINGER_S",
    "MAX_PENDING",
    "PERIOD",
    "PROBE_S",
    "WINDOW",
    "Outcome",
    "agree",
    "agree_later",
    "check",
    "drain",
    "in_step",
    "leave",
    "leave_check",
    "settle",
    "stats",
    "tag_part",
]

WINDOW = _window.WINDOW
PERIOD = _window.PERIOD
MAX_PENDING = _window.MAX_PENDING
LINGER_S = _window.LINGER_S
PROBE_S = _barrier.PROBE_S

stats = Stats()  # this process's round trips (tests and benchmarks read them)
failures: deque[BaseException] = deque()  # disagreements found beside the caller, for `settle`
_node: Node | None = None
_client: object = None  # the client `_node` talks through


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


def tag_part(name: str) -> str:
    """``name`` made safe as one component of a tag: distinct names stay distinct."""
    return urllib.parse.quote(name, safe="")


def settle() -> None:
    """Raise the first disagreement `agree_later` found since the last call, if any."""
    if failures:
        if _node is not None:
            _node.settle()  # an out-of-step error stays, for its channel (`Node.settle`)
        else:
            raise failures.popleft()


def in_step() -> None:
    """Forget that processes went out of step (`Node.in_step`): every process finished its work."""
    if _node is not None:
        _node.in_step()


def agree(
    tag: str,
    summary: str,
    record: str,
    *,
    timeout: float,
    groups: Mapping[str, Group] | None = None,
    what: str = "",
) -> Outcome:
    """`counter.agree` for this process (see there); first raises what `agree_later` found."""
    here = node()
    if here is not None:
        _window.sync_point(here, timeout)
    settle()
    if here is None:
        return Outcome(True, {_compat.distributed_state()[1]: record})
    return _counter.agree(here, tag, summary, record, timeout=timeout, groups=groups, what=what)


def check(tag: str, summary: str, record: Record, *, timeout: float, what: str = "") -> Outcome:
    """`barrier.check` for this process (see there); first raises what `agree_later` found."""
    here = node()
    if here is not None:
        _window.sync_point(here, timeout)
    settle()
    if here is None:
        me = _compat.distributed_state()[1]
        return Outcome(True, {me: record if isinstance(record, str) else record()})
    return _barrier.check(here, tag, summary, record, timeout=timeout, what=what)


def agree_later(
    tag: str,
    summary: str,
    record: Record,
    *,
    timeout: float,
    on_outcome: Callable[[Outcome], None],
    groups: Mapping[str, Group] | None = None,
    linger: float = LINGER_S,
    verdict_on_change: bool = False,
    repeat_returns: bool = False,
    what: str = "",
) -> None:
    """`window.agree_later` for this process (see there).

    Returns at once, unless ``verdict_on_change`` and the call is a change: then it returns once
    the call is verified, and raises what differs. A tag is either agreed at once (`agree`) or
    beside the caller (`agree_later`), never both. ``record`` (or the function that makes it) is
    only made when shown.
    """
    settle()
    here = node()
    if here is None:
        return
    _window.agree_later(
        here, tag, summary, record, timeout=timeout, on_outcome=on_outcome, groups=groups,
        linger=linger, verdict_on_change=verdict_on_change, repeat_returns=repeat_returns,
        what=what,
    )  # fmt: skip
    settle()


def leave(tag: str, record: str, *, later: bool = False, wait: float | None = None) -> None:
    """Tell the processes at ``tag``'s next agreement that this one will not come, and why.

    ``later``: the tag is agreed beside the caller (`agree_later`); its thread arrives for the
    first call this process will not make, and this call waits until it has (at most ``wait``
    seconds, default the check timeout; a record not posted by then leaves the others to their
    timeout).
    """
    here = node()
    if here is None:
        return
    if later:
        _window.leave_later(here, tag, record, _env.check_timeout() if wait is None else wait)
    else:
        _counter.leave(here, tag, record)


def leave_check(tag: str, record: str) -> None:
    """`barrier.leave_check` for this process: never waits."""
    here = node()
    if here is not None:
        _barrier.leave_check(here, tag, record)


def drain(timeout: float, tags: Sequence[str] | None = None) -> bool:
    """Wait until every `agree_later` call of this process is verified (or ``timeout``)."""
    return True if _node is None else _node.drain(timeout, tags)


def _drain_at_exit() -> None:
    """Verify what is pending (a few seconds at most), then let meshkit's threads leave."""
    if _node is not None:
        _node.stop()
