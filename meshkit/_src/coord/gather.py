"""Every process's value in, one answer back to every process: `gather` (and the sync step).

Examples:
    >>> sync_step(0, 7, 1.0, threading.Event())  # not joined: alone
    Synced(step=8, agreed=True, missing=())
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core import compat as _compat
from ..lifecycle.preemption import Synced, alone
from .service import JaxService, Service

SLICE_S = 0.5  # a stoppable `gather`'s longest wait in one request: it stops within it at exit


@dataclass(frozen=True)
class Gathered:
    """How one `gather` ended: the combined answer, or (None and) who did not arrive."""

    answer: str | None
    missing: tuple[int, ...] = ()


def _values(service: Service, prefix: str) -> dict[int, str]:
    """The values under ``prefix``, by process (the last component of each key)."""
    return {int(k.rsplit("/", 1)[1]): v for k, v in service.dir_get(prefix)}


def gather(
    service: Service,
    me: int,
    n: int,
    tag: str,
    value: str,
    combine: Callable[[Mapping[int, str]], str],
    *,
    timeout: float,
    stop: threading.Event | None = None,
) -> Gathered:
    """Gather every process's ``value``, and give each the answer of ``combine``.

    Each of the ``n`` processes calls it once per ``tag`` (unique in the session): it writes its
    value and counts itself in; the last to count runs ``combine`` on the values by process (one
    directory read) and writes the answer the others read. Three round trips per process. With
    ``stop`` (set when this process ends), the others read in slices of `SLICE_S` (a blocking
    read could not stop at exit) and give up, naming nobody, once it is set.

    Examples:
        >>> from meshkit.testing._fake_service import FakeCluster
        >>> gather(FakeCluster(1).service(0), 0, 1, "t", "a", lambda v: ",".join(v.values()),
        ...        timeout=1.0)
        Gathered(answer='a', missing=())
    """
    deadline = time.monotonic() + timeout
    values, answer = f"meshkit/{tag}/v/", f"meshkit/{tag}/answer"
    service.set(f"{values}{me}", value)
    if service.increment(f"meshkit/{tag}/count", 1) == n:  # the last to come: every value is there
        combined = combine(dict(sorted(_values(service, values).items())))
        service.set(answer, combined)
        service.delete(values)
        return Gathered(combined)
    while (left := deadline - time.monotonic()) > 0 and not (stop and stop.is_set()):
        got = service.get(answer, left if stop is None else min(SLICE_S, left))
        if got is not None:
            return Gathered(got)
    if stop is not None and stop.is_set():
        return Gathered(None)
    came = _values(service, values)
    late = service.get(answer, 0.001)  # read after the values: the last to come deletes them
    if late is not None:
        return Gathered(late)
    return Gathered(None, tuple(p for p in range(n) if p not in came))


def _next_step(values: Mapping[int, str]) -> str:
    """The step after the highest any process answered; null when none did."""
    highest = max((s for v in values.values() if (s := json.loads(v)) is not None), default=None)
    return json.dumps(None if highest is None else highest + 1)


def sync_step(me: int, answered: int | None, timeout: float, stop: threading.Event) -> Synced:
    """The step at which every process saves after a preemption notice (one `gather` per run).

    It is the one after the highest step any program answered (``answered``: the last step this
    process's program answered; None: none yet), or, if none did, the first step each asks
    about. `alone` when not joined.
    """
    client, _, n = _compat.distributed_state()
    if client is None or n == 1:
        return alone(answered, timeout, stop)
    service, value = JaxService(client), json.dumps(answered)
    got = gather(service, me, n, "preemption", value, _next_step, timeout=timeout, stop=stop)
    if got.answer is None:
        return Synced(None, agreed=False, missing=got.missing)
    return Synced(json.loads(got.answer))
