"""Failure posts: what a failing process tells the others, and how they look for it.

A process that fails in a multi-process run posts ``{"process": id, "failure": text}`` under
``meshkit/failed/<id>``; every process's failure watch (`meshkit._src.lifecycle.failfast`)
polls that directory and stops when another process posted. The lifecycle layer sits below
coordination, so `meshkit._src.runtime.init` hands it `poster` and `watcher` at `init`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..core import compat as _compat
from ..lifecycle.failfast import Unanswered
from .service import JaxService, Service

__all__ = ["PREFIX", "FailurePost", "answer", "poll", "post", "poster", "watcher"]

PREFIX = "meshkit/failed/"  # + the failing process's id


@dataclass(frozen=True)
class FailurePost:
    """What one process posted of its failure."""

    process: int
    failure: str  # the first line of the error, for the other processes' messages


def post(service: Service, me: int, failure: str) -> None:
    """Post process ``me``'s ``failure`` (once: a second post is an error of the service)."""
    service.set(PREFIX + str(me), json.dumps(asdict(FailurePost(me, failure))))


def poll(service: Service, me: int) -> list[FailurePost]:
    """The failures other processes than ``me`` posted so far, by process id."""
    found = [FailurePost(**json.loads(value)) for _, value in service.dir_get(PREFIX)]
    return sorted((f for f in found if f.process != me), key=lambda f: f.process)


def answer(service: Service, me: int) -> list[tuple[int, str]] | Unanswered:
    """`poll` as the failure watch sees it: ``(process, failure)`` pairs, or an `Unanswered`."""
    try:
        posts = poll(service, me)
    except Exception as e:  # JaxRuntimeError: the service did not answer; its code says why
        return Unanswered(lost=JaxService.gone(e), error=str(e))
    return [(f.process, f.failure) for f in posts]


def _joined() -> JaxService | None:
    client, _, n = _compat.distributed_state()
    return None if client is None or n == 1 else JaxService(client)


def poster(me: int) -> Callable[[str], None]:
    """`post` for process ``me`` over the real service (nothing when not joined)."""

    def post_failure(failure: str) -> None:
        service = _joined()
        if service is not None:
            post(service, me, failure)

    return post_failure


def watcher(me: int) -> Callable[[], list[tuple[int, str]] | Unanswered | None]:
    """`poll` for process ``me`` over the real service, as ``(process, failure)`` pairs.

    The function returns None once this process is no longer joined (the watch then ends), and
    an `Unanswered` when the service did not answer, told by its status code whether it is gone.
    """

    def poll_failures() -> list[tuple[int, str]] | Unanswered | None:
        service = _joined()
        return None if service is None else answer(service, me)

    return poll_failures
