"""Every process's value in, one answer back to every process: `gather` and `sync_step`.

Examples:
    >>> import threading
    >>> from meshkit._src.coord.fake import FakeCluster
    >>> sync_step(FakeCluster(1).service(0), 0, 1, answered=7, timeout=1.0,
    ...           stop=threading.Event())
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
from .service import Barrier, JaxService, Service

SLICE_S = 0.5  # `sync_step`'s longest wait in one request: the thread stops within it at exit
_PREFIX = "meshkit/preemption/"


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
) -> Gathered:
    """Gather every process's ``value`` at process 0, and give each the answer of ``combine``.

    Each of the ``n`` processes calls it once per ``tag`` (unique in the session): it writes its
    value and waits at one barrier; process 0 runs ``combine`` on the values by process (one
    directory read) and writes the answer the others read. Three round trips per process.

    Examples:
        >>> from meshkit._src.coord.fake import FakeCluster
        >>> gather(FakeCluster(1).service(0), 0, 1, "t", "a", lambda v: ",".join(v.values()),
        ...        timeout=1.0)
        Gathered(answer='a', missing=())
    """
    deadline = time.monotonic() + timeout
    values, answer = f"meshkit/{tag}/v/", f"meshkit/{tag}/answer"
    service.set(f"{values}{me}", value)
    if service.barrier(f"meshkit/{tag}/b", timeout) is not Barrier.PASSED:
        arrived = _values(service, values)
        return Gathered(None, tuple(p for p in range(n) if p not in arrived))
    if me == 0:
        combined = combine(dict(sorted(_values(service, values).items())))
        service.set(answer, combined)
        service.delete(values)
        return Gathered(combined)
    got = service.get(answer, max(deadline - time.monotonic(), 0.001))
    return Gathered(got) if got is not None else Gathered(None, (0,))


def sync_step(
    service: Service,
    me: int,
    n: int,
    *,
    answered: int | None,
    timeout: float,
    stop: threading.Event,
) -> Synced:
    """The step at which every process saves after a preemption notice, once per run.

    It is the one after the highest step any program ``answered`` (the last step this process's
    program answered; None: none yet), or, if none did, the first step each asks about. Each
    process writes its step and counts itself in; the last to count writes the answer, which the
    others wait for in slices of `SLICE_S` (a barrier could not stop at exit) until ``stop``
    (set when this process ends).
    """
    deadline = time.monotonic() + timeout
    steps, answer = _PREFIX + "answered/", _PREFIX + "step"
    service.set(f"{steps}{me}", json.dumps(answered))
    if service.increment(_PREFIX + "count", 1) == n:  # the last to come: every step is there
        sent = [json.loads(v) for v in _values(service, steps).values()]
        highest = max((s for s in sent if s is not None), default=None)
        step = None if highest is None else highest + 1
        service.set(answer, json.dumps(step))
        return Synced(step)
    while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        got = service.get(answer, min(SLICE_S, left))
        if got is not None:
            return Synced(json.loads(got))
    if stop.is_set():
        return Synced(None, agreed=False)
    came = _values(service, steps)
    return Synced(None, agreed=False, missing=tuple(p for p in range(n) if p not in came))


def syncer(me: int) -> Callable[[int | None, float, threading.Event], Synced]:
    """`sync_step` for process ``me`` over the real service (`alone` when not joined)."""

    def sync(answered: int | None, timeout: float, stop: threading.Event) -> Synced:
        client, _, n = _compat.distributed_state()
        if client is None or n == 1:
            return alone(answered, timeout, stop)
        return sync_step(JaxService(client), me, n, answered=answered, timeout=timeout, stop=stop)

    return sync
