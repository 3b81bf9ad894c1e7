"""Fail fast: a process that fails ends soon, and the others learn why.

An uncaught exception posts the failure, runs the exit handlers for at most
``MESHKIT_FAIL_FAST_GRACE`` s and exits 1. The failure watch (in the service thread) ends this
process when another failed or the coordination service is gone. At a normal end a process
held long at JAX's shutdown barrier says so. ``MESHKIT_FAIL_FAST=0`` turns it off.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ..core import env as _env
from ..core import events as _events
from ..core.errors import DivergenceError
from ..core.log import logger, say
from . import exit as _exit
from . import preemption as _preemption

_LOG = logger("guards")

ENV_FAIL_FAST = "MESHKIT_FAIL_FAST"
ENV_FAIL_FAST_GRACE = "MESHKIT_FAIL_FAST_GRACE"
_ENDED_AFTER_S = 3.0
_POST_WAIT_S = 2.0  # how long JAX's error at a lost peer waits for that peer's failure post
_LOST_AFTER = 2  # failed polls in a row before the coordination service counts as gone


def settings() -> float | None:
    """The seconds exit handlers get when a failure ends a process; None: fail-fast is off."""
    if not _env.flag(ENV_FAIL_FAST, where="meshkit.init()", on="on, the default", blank=True):
        return None
    return _env.seconds(ENV_FAIL_FAST_GRACE, where="meshkit.init()", positive=False, default=10.0)


# What the coordination layer hands in at `install`:
Post = Callable[[str], None]  # post this process's failure (the first line of the error)


@dataclass(frozen=True)
class Unanswered:
    """A poll the coordination service did not answer."""

    lost: bool
    error: str


@dataclass(frozen=True)
class PeerPosts:
    """What the other processes posted so far, as one poll of the failure watch found it."""

    failures: list[tuple[int, str]]
    notices: list[_preemption.PreemptionNotice]


Poll = Callable[[], PeerPosts | Unanswered | None]
Wait = Callable[[float], bool]
_post_failure: Post | None = None
_watch: _Watch | None = None  # the failure watch, read once more by an uncaught exception
_grace = 10.0  # the exit handlers' seconds when a failure ends this process


def install(
    grace: float, me: int, n: int, *, post: Post, poll: Poll, wait: Wait,
    nudge: Callable[[], None],
) -> None:  # fmt: skip
    """Register what this module describes, for process ``me`` of ``n``."""
    global _post_failure, _watch, _grace
    _post_failure, _grace = post, grace
    _watch = _Watch(me, n, poll, wait)
    _exit.on_exception("fail-fast: end the process", _on_exception)
    _exit.watch(_watch.look, nudge)
    _exit.on_exit("fail-fast: arm the end note", lambda: _at_exit(me), order=_exit.STOP)


def _on_exception(
    kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    text = f"{kind.__name__}: {value}"
    notice = _preemption.past_deadline()
    if notice is not None:
        why = f"the other processes ended at the deadline ({text.splitlines()[0][:200]})"
        _preemption.end_preempted(notice, why)
        return
    diagnosis = _events.diagnose(text)
    if diagnosis is not None and _end_with_known_cause():
        return
    said = "" if diagnosis is None else _events.explain(diagnosis) + "\n"
    if not _fail(value, diagnosis, said, "uncaught exception in a multi-process run"):
        _exit.await_end()  # another path ends this process (a peer's failure): its record stands


def peer_failed(p: int, failure: str) -> None:
    """Process ``p`` ended by ``failure`` (learned from its record at an agreement): end too."""
    if _watch is not None and not _exit.ending():
        _watch.failed(p, failure)


def end_for(error: BaseException, why: str) -> bool:
    """End this process for ``error``, found beside a caller that cannot return; False if off."""
    if _watch is None or _exit.ending():  # fail-fast is off, or the process ends already
        return False
    said = f"meshkit: {why}.\n{type(error).__name__}: {error}\n"
    _fail(error, None, said, "this process cannot go on")  # False: another path ends it
    return True


def _fail(error: BaseException, diagnosis: _events.Diagnosis | None, said: str, why: str) -> bool:
    """Claim the end, say ``said``, record the failure, end; False: another path ends it."""
    if not _exit.claim():
        return False
    if said:
        say(_LOG, logging.ERROR, said)
    _events.emit(_events.FAILED, **_failure_fields(error, diagnosis))
    _end(f"{type(error).__name__}: {error}".splitlines()[0][:300], why)
    return True


def _end_with_known_cause() -> bool:
    """End this process for a posted failure that caused JAX's error (waits for one): True if so."""
    for look in range(2):
        if _watch is None or not _exit.claim():  # the main thread claimed the end before this
            return False
        posted = _watch.poll()
        if isinstance(posted, PeerPosts) and posted.failures:
            said = "meshkit: the error above follows another process's failure.\n"
            say(_LOG, logging.ERROR, said)
            _watch.failed(*min(posted.failures))
            return True
        try:
            if look == 0 and (_watch.wait is None or not _watch.wait(_POST_WAIT_S)):
                return False
        except Exception:  # the service is gone: no post will come
            return False
    return False


def _failure_fields(value: BaseException, diagnosis: _events.Diagnosis | None) -> dict[str, Any]:
    """The `failed` event's fields for an exception: its type, else what its text says."""
    error = type(value).__name__
    if isinstance(value, DivergenceError):  # every process raises it: it names who differs
        return {"cause": "divergence", "error": error, "processes": value.processes,
                "field": value.field}  # fmt: skip
    if diagnosis is None:
        raised = traceback.extract_tb(value.__traceback__, limit=-1)  # the innermost frame
        where = f"{raised[0].filename}:{raised[0].lineno}" if raised else ""
        return {"cause": "exception", "error": error, "where": where}
    cause = "timeout" if diagnosis.kind == "timeout" else "peer"
    return {"cause": cause, "error": error, "system": diagnosis.system,
            "process": diagnosis.process}  # fmt: skip


def _end(failure: str, why: str) -> None:
    """Run the exit handlers for at most `_grace` s, post ``failure``, exit with status 1."""
    announce = (
        f"meshkit: {why}; running exit handlers (at most {_grace:g} s), then exiting without "
        f"waiting for the other processes ({ENV_FAIL_FAST}=0 waits).\n"
    )
    late = (
        f"meshkit: exit handlers still running after {_grace:g} s; exiting now "
        f"({ENV_FAIL_FAST_GRACE} gives them longer).\n"
    )
    post = _post_failure  # the last step; a service gone already is no news (`exit` ignores it)
    final = None if post is None else lambda: post(failure)
    _exit.end(1, grace=_grace, announce=announce, late=late, final=final)


def poll_period(n: int) -> float:
    """Seconds between two looks of a watch that each of ``n`` processes runs."""
    return max(1.0, n / 500)


class _Watch:
    """Waits for the other processes' failures and preemption notices (in the service thread)."""

    def __init__(self, me: int, n: int, poll: Poll, wait: Wait | None = None) -> None:
        self.me, self.n, self.poll, self.wait = me, n, poll, wait
        self.lost = 0  # reads in a row the service answered as gone

    def look(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for a post, then act on the posts; False: watch no more."""
        try:
            woken = self.wait is None or self.wait(timeout)
        except Exception:  # the read tells whether the service is gone
            woken = True
        if not woken:
            return True
        if _exit.ending():
            return False
        posted = self.poll()
        if isinstance(posted, Unanswered):  # only a service that is gone counts
            self.lost = self.lost + 1 if posted.lost else 0
            if self.lost >= _LOST_AFTER:
                self._lost(posted.error)
            elif self.lost:
                time.sleep(poll_period(self.n))  # two reads, a period apart, before it counts
            return True
        self.lost = 0
        if posted is None:
            return False  # not joined anymore: nobody left to watch
        if posted.notices:
            _preemption.receive(posted.notices[0])
        if posted.failures:
            self.failed(*min(posted.failures))
        return True

    def failed(self, p: int, failure: str) -> None:
        """End this process (status 1, no exit handler) for process ``p``'s ``failure``."""
        if not _exit.claim():  # another path ends this process already
            return
        _events.emit(_events.FAILED, cause="peer", process=p, system="meshkit",
                     error=failure.split(":")[0])  # fmt: skip
        _exit.now(
            1,
            f"meshkit: process {p} failed: {failure}\n"
            f"Process {self.me} stops too (status 1): the program cannot go on without "
            f"process {p} (a collective would wait for it for ever). Process {p}'s output "
            "holds the cause.\n",
        )

    def _lost(self, error: str) -> None:
        _exit.count_ends(None)  # nobody is left to count this process's end
        notice = _preemption.notice()
        if notice is not None:  # process 0 ended for the notice too, at the same deadline
            _preemption.end_preempted(
                notice, "process 0, which hosts the coordination service, has ended"
            )
            return
        if not _exit.claim():  # claimed first, so that this record is the one that stands
            return
        _events.emit(_events.FAILED, cause="peer", process=0, system="the coordination service")
        _exit.now(
            1,
            f"meshkit: lost the coordination service, which process 0 hosts ({error.strip()}).\n"
            f"Process 0 has exited or failed; process {self.me} stops too (status 1). Process "
            "0's output holds the cause.\n",
        )


def _at_exit(me: int) -> None:
    """Say, a while later, that this process still waits for the others."""
    if not _exit.ending():
        _exit.at("fail-fast: the end note", _ENDED_AFTER_S, lambda: _end_note(me), nudge=False)


def _end_note(me: int) -> None:
    say(
        _LOG,
        logging.WARNING,
        f"meshkit: process {me} {_events.ENDED_MARK} {_ENDED_AFTER_S:g} s ago and "
        "waits at JAX's shutdown barrier for the other processes (one still running, or "
        "stuck in a computation this one never joined).\n",
    )
    _events.emit(_events.ENDED)
