"""Failure posts: what a failing process tells the others, and how they look for it.

A process that fails in a multi-process run posts ``{"process": id, "failure": text}`` under
``meshkit/failed/<id>``; every process's failure watch (`meshkit._src.lifecycle.failfast`)
polls that directory and stops when another process posted. The lifecycle layer sits below
coordination, so `meshkit._src.runtime.init` hands it `post` and `poll` at `init` as callables.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .service import Service

__all__ = ["PREFIX", "FailurePost", "poll", "post"]

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
