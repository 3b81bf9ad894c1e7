"""The step at which every process saves after a preemption notice, agreed once per run.

The sync step is the one after the highest step any program answered (or, if none did, the
first step each asks about). Each preemption thread writes its step and counts itself in; the
last to count writes the answer, which the others wait for in slices of `SLICE_S`.

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
from collections.abc import Callable

from ..core import compat as _compat
from ..lifecycle.preemption import Synced, alone
from .service import JaxService, Service

SLICE_S = 0.5  # the longest wait in one request: the thread stops within it at exit
_PREFIX = "meshkit/preemption/"


def sync_step(
    service: Service,
    me: int,
    n: int,
    *,
    answered: int | None,
    timeout: float,
    stop: threading.Event,
) -> Synced:
    """Agree with the other ``n - 1`` processes on the sync step (see the module).

    ``answered``: the last step this process's program answered (None: none yet); ``stop``: set
    when this process ends, the wait stops within `SLICE_S`.
    """
    deadline = time.monotonic() + timeout
    steps, answer = _PREFIX + "answered/", _PREFIX + "step"
    service.set(f"{steps}{me}", json.dumps(answered))
    if service.increment(_PREFIX + "count", 1) == n:  # the last to come: every step is there
        sent = [json.loads(v) for _, v in service.dir_get(steps)]
        highest = max((s for s in sent if s is not None), default=None)
        step = None if highest is None else highest + 1
        service.set(answer, json.dumps(step))
        return Synced(step)
    while not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        got = service.get(answer, min(SLICE_S, left))
        if got is not None:
            return Synced(json.loads(got))
    if stop.is_set():
        return Synced(None, agreed=False)
    came = {int(k.rsplit("/", 1)[1]) for k, _ in service.dir_get(steps)}
    return Synced(None, agreed=False, missing=tuple(p for p in range(n) if p not in came))


def syncer(me: int) -> Callable[[int | None, float, threading.Event], Synced]:
    """`sync_step` for process ``me`` over the real service (`alone` when not joined)."""

    def sync(answered: int | None, timeout: float, stop: threading.Event) -> Synced:
        client, _, n = _compat.distributed_state()
        if client is None or n == 1:
            return alone(answered, timeout, stop)
        return sync_step(JaxService(client), me, n, answered=answered, timeout=timeout, stop=stop)

    return sync
