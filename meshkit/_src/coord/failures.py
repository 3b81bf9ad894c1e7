"""Posts: what a process tells all the others at once, its failure or a preemption notice.

`post` writes every other process's alarm key, which wakes its failure watch (`wait_alarm`)
to read both kinds in one listing. `count_ended` counts the processes that ended, so that
process 0, which hosts the service, ends after the others (`meshkit._src.lifecycle.exit`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

from ..core import compat as _compat
from ..lifecycle.failfast import PeerPosts, Unanswered
from ..lifecycle.preemption import PreemptionNotice
from ..lifecycle.progress import ServiceBoard
from .service import GONE, JaxService, Service

PREFIX = "meshkit/posts/"
FAILED = PREFIX + "failed/"  # + the failing process's id
NOTICE = PREFIX + "notice/"  # + the id of the process that received the notice
ALARM = "meshkit/alarm/"  # + the id of the process whose service thread waits on it
ENDED = "meshkit/ended"  # how many processes other than process 0 ended
STALL = "meshkit/stall/"  # + a stalled process's id, or "verdict"
STEPS = "meshkit/steps/"  # + a process's id: its latest window of step times


def post(service: Service, me: int, failure: str, n: int = 0) -> None:
    """Post process ``me``'s ``failure`` (its error's first line; once), then wake the others."""
    service.set(FAILED + str(me), json.dumps({"process": me, "failure": failure}))
    alarm(service, me, n)


def post_notice(service: Service, notice: PreemptionNotice, n: int = 0) -> None:
    """Post a preemption notice that process ``notice.process`` received, then wake the others."""
    service.set(NOTICE + str(notice.process), json.dumps(asdict(notice)))
    alarm(service, notice.process, n)


def alarm(service: Service, me: int, n: int) -> None:
    """Write the alarm key of every process of ``n`` but ``me``: their watch reads the posts."""
    for p in range(n):
        if p != me:
            service.set(ALARM + str(p), "1", overwrite=True)


def poll(service: Service, me: int) -> PeerPosts | Unanswered:
    """What processes other than ``me`` posted so far: failures by process, notices by time.

    An `Unanswered` when the service did not answer (the failure watch tells a lost one by it).
    """
    try:
        posted = service.dir_get(PREFIX)
    except Exception as e:  # JaxRuntimeError: the service did not answer; its code says why
        return Unanswered(lost=_compat.service_error_code(e) in GONE, error=str(e))
    failures: list[tuple[int, str]] = []
    notices: list[PreemptionNotice] = []
    for key, value in posted:
        fields = json.loads(value)
        if fields["process"] == me:
            continue
        if key.startswith(FAILED):
            failures.append((fields["process"], fields["failure"]))
        elif key.startswith(NOTICE):
            notices.append(PreemptionNotice(**{**fields, "own": False}))
    return PeerPosts(
        failures=sorted(failures), notices=sorted(notices, key=lambda n: (n.received, n.process))
    )


def _joined() -> JaxService | None:
    client, _, n = _compat.distributed_state()
    return None if client is None or n == 1 else JaxService(client)


def post_failure(me: int, failure: str) -> None:
    """`post` for process ``me`` over the real service (nothing when not joined)."""
    service = _joined()
    if service is not None:
        post(service, me, failure, _compat.distributed_state()[2])


def count_ended(amount: int) -> int:
    """Adds to the count of processes that ended; the count (0 if not joined)."""
    service = _joined()
    return 0 if service is None else service.increment(ENDED, amount)


def tell(notice: PreemptionNotice) -> None:
    """Tells the others of this process's notice: meshkit's post, then JAX's sync managers."""
    client, _, n = _compat.distributed_state()
    if client is None or n == 1:
        return
    post_notice(JaxService(client), dataclasses.replace(notice, own=False), n)
    _compat.tell_jax_preemption(client, notice.received)


def poll_posts(me: int) -> PeerPosts | Unanswered | None:
    """`poll` for process ``me`` over the real service; None once it is no longer joined."""
    service = _joined()
    return None if service is None else poll(service, me)


def wait_alarm(me: int, timeout: float) -> bool:
    """Waits at most ``timeout`` for process ``me``'s alarm key: True once taken, or not joined."""
    service = _joined()
    if service is None:
        return True
    if service.get(ALARM + str(me), timeout) is None:
        return False
    service.delete(ALARM + str(me))  # a post after this writes it again
    return True


def nudge(me: int) -> None:
    """Writes process ``me``'s own alarm key: its wait ends now (this process needs its thread)."""
    service = _joined()
    if service is not None:
        service.set(ALARM + str(me), "1", overwrite=True)


def board(prefix: str) -> ServiceBoard | None:
    """The texts posted under ``prefix`` (`STALL`, `STEPS`) at the service; None: not joined."""
    service = _joined()
    if service is None:
        return None
    return ServiceBoard(
        post=lambda name, text: service.set(prefix + name, text, overwrite=True),
        read=lambda: {k.removeprefix(prefix): v for k, v in service.dir_get(prefix)},
        drop=lambda name: service.delete(prefix + name),
    )
