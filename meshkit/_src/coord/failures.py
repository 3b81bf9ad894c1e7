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
from .service import JaxService, Service

__all__ = ["PREFIX", "FailurePost", "poll", "post", "poster", "watcher"]

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


def _joined() -> Service | None:
    client, _, n = _compat.distributed_state()
    return None if client is None or n == 1 else JaxService(client)


def poster(me: int) -> Callable[[str], None]:
    """`post` for process ``me`` over the real service (nothing when not joined)."""

    def post_failure(failure: str) -> None:
        service = _joined()
        if service is not None:
            post(service, me, failure)

    return post_failure


def watcher(me: int) -> Callable[[], list[tuple[int, str]] | None]:
    """`poll` for process ``me`` over the real service, as ``(process, failure)`` pairs.

    The function returns None once this process is no longer joined (the watch then ends).
    """

    def poll_failures() -> list[tuple[int, str]] | None:
        service = _joined()
        if service is None:
            return None
        return [(f.process, f.failure) for f in poll(service, me)]

    return poll_failures
