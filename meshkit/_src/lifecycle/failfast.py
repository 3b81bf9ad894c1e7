"""Fail fast, everywhere: a process that fails ends soon, and the others learn why.

Registered with the owner of exit (`meshkit._src.lifecycle.exit`) by `meshkit.init` when it
joins a multi-process program (``MESHKIT_FAIL_FAST=0`` leaves Python's and JAX's defaults alone).
Each failure also leaves a `failed` event for ``meshkit launch`` (`meshkit._src.core.events`):

- **An uncaught exception** prints its traceback, meshkit's explanation when it is one of JAX's
  cross-process timeouts (`meshkit._src.core.diagnosis`), posts the failure for the other
  processes, runs the ``atexit`` handlers for at most ``MESHKIT_FAIL_FAST_GRACE`` seconds (JAX's
  own, which waits at a shutdown barrier for every process, is skipped), and exits with status 1.
- **SIGTERM** is not a failure: it is a preemption notice (`meshkit._src.lifecycle.preemption`).
- **The failure watch** (the fail-fast path; `meshkit._src.lifecycle.service_thread` runs it): the
  service thread waits in the coordination service on this process's alarm key, which a
  process that posts its failure or a preemption notice writes for every other (an idle wait
  is one request per ``slice_s`` seconds, no polling). Woken, it reads every post in one
  listing. A failure of another process ends this one at once: it prints ``meshkit: process P
  failed: ...`` and exits with status 1 (`meshkit._src.lifecycle.exit.now`), instead of waiting
  in a collective for ever or dying in the coordination service's C++ abort (``another task
  died``). A coordination service that is gone (two reads in a row, ``poll_period`` apart,
  answered with a status code that says so) ends it the same way, naming process 0, which hosts
  it; after a preemption notice, as preempted. A notice is taken as this process's own
  (`meshkit._src.lifecycle.preemption.receive`). These are the only ways a failure found by
  the service thread ends a process; nothing found there surfaces later in another call.
- **At a normal end**, the watch stops (the thread leaves the coordination client before the
  interpreter ends), and a process that JAX's shutdown barrier holds for 3 s says it reached
  the end of its program while others still run (evidence for ``meshkit launch``'s report),
  and leaves an `ended` event.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ..core import compat as _compat
from ..core import diagnosis as _diagnose
from ..core import env as _env
from ..core import events as _events
from ..core.errors import DivergenceError
from ..core.log import logger, say
from . import exit as _exit
from . import preemption as _preemption
from . import service_thread as _service_thread

_LOG = logger("guards")

__all__ = [
    "ENV_FAIL_FAST", "ENV_FAIL_FAST_GRACE", "end_for", "install", "peer_failed", "poll_period",
    "settings",
]  # fmt: skip

ENV_FAIL_FAST = "MESHKIT_FAIL_FAST"
ENV_FAIL_FAST_GRACE = "MESHKIT_FAIL_FAST_GRACE"
_DEFAULT_GRACE_S = 10.0
_ENDED_AFTER_S = 3.0
_POST_WAIT_S = 2.0  # how long JAX's error at a lost peer waits for that peer's failure post
_EXIT_MARGIN_S = 0.5  # process 0, ending for a peer's failure, outlives the peer's exit by this
_READ_S = 5.0  # how long process 0 stays up, after its failure post, for the others to read it
_LOST_AFTER = 2  # failed polls in a row before the coordination service counts as gone


def settings() -> float | None:
    """The seconds exit handlers get when a failure ends a process; None: fail-fast is off.

    Raises:
        MeshkitError: ``MESHKIT_FAIL_FAST`` or ``MESHKIT_FAIL_FAST_GRACE`` holds a value that
            is not accepted (named with the accepted ones).
    """
    if not _env.flag(ENV_FAIL_FAST, where="meshkit.init()", on="on, the default", blank=True):
        return None
    grace = _env.seconds(ENV_FAIL_FAST_GRACE, where="meshkit.init()", positive=False)
    return _DEFAULT_GRACE_S if grace is None else grace


# How failures travel between processes: the coordination layer (above this one) owns the
# format and the service; `meshkit._src.runtime.init` hands its functions in at `install`.
Post = Callable[[str], None]  # post this process's failure (the first line of the error)


@dataclass(frozen=True)
class Unanswered:
    """A poll the coordination service did not answer.

    Attributes:
        lost: whether the service's status code says it is gone (its host exited or failed),
            rather than slow or refusing this one request.
        error: the service's error, for the message that ends this process.
    """

    lost: bool
    error: str


@dataclass(frozen=True)
class PeerPosts:
    """What the other processes posted so far, as one poll of the failure watch found it.

    Attributes:
        failures: their failures, as ``(process, failure)`` pairs, by process.
        notices: their preemption notices, the first one first.
    """

    failures: list[tuple[int, str]]
    notices: list[_preemption.PreemptionNotice]


# One look at the others' posts; None once this process is no longer joined.
Poll = Callable[[], PeerPosts | Unanswered | None]
# Waits at most that long for this process's alarm key: True once written (or not joined).
Wait = Callable[[float], bool]
# Takes the failure a deferred check found (or another process told) and kept for this
# process's next meshkit call, if one waits: it is then no longer waiting to be raised.
Kept = Callable[[], BaseException | None]
# Adds to the count of processes that read a failure post and stopped for it; returns the count.
Read = Callable[[int], int]
_post_failure: Post | None = None
_read: Read | None = None
_kept: Kept | None = None
_watch: _Watch | None = None  # the failure watch, read once more by an uncaught exception
_grace: float | None = None  # the exit handlers' seconds; None: fail-fast is off


def install(
    grace: float | None,
    me: int,
    n: int,
    *,
    post: Post,
    poll: Poll,
    wait: Wait,
    nudge: Callable[[], None],
    kept: Kept | None = None,
    read: Read | None = None,
) -> None:
    """Register what this module describes, for process ``me`` of ``n``.

    Called once, by `meshkit.init` when it joined ``n > 1`` processes.

    Args:
        grace: seconds the exit handlers may run before a failing process exits (None: fail-fast
            is off).
        me: this process's id.
        n: the number of processes.
        post: posts this process's failure (and writes the others' alarm keys).
        poll: what the other processes posted (None: not joined anymore).
        wait: waits for this process's alarm key.
        nudge: writes this process's alarm key (wakes its own wait).
        kept: takes the failure kept for this process's next meshkit call, if any.
        read: adds to (and returns) the count of processes that read a failure post.
    """
    global _post_failure, _kept, _watch, _read, _grace
    _post_failure, _kept, _read, _grace = post, kept, read, grace
    if grace is None:
        return
    _watch = _Watch(me, n, poll, wait)
    _exit.on_exception(
        "fail-fast: end the process",
        lambda kind, value, tb: _on_exception(grace, kind, value, tb),
        order=_exit.REPORT,
    )
    _service_thread.watch(_watch.look, nudge)
    _exit.on_exit(
        "fail-fast: stop the watch, arm the end note", lambda: _at_exit(me), order=_exit.STOP
    )


# ---- ending this process --------------------------------------------------------------------


def _on_exception(
    grace: float, kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    text = f"{kind.__name__}: {value}"
    notice = _preemption.past_deadline()
    if notice is not None:
        _preemption.end_preempted(
            notice,
            f"the other processes ended at the deadline ({text.splitlines()[0][:200]})",
        )
        return
    diagnosis = _diagnose.diagnose(text)
    if diagnosis is not None and _end_with_known_cause(grace):
        return
    if diagnosis is not None:
        say(_LOG, logging.ERROR, _diagnose.explain(diagnosis) + "\n")
    _events.emit(_events.FAILED, **_failure_fields(value, diagnosis))
    _end(
        f"{text.splitlines()[0][:300]}",
        "uncaught exception in a multi-process run",
        grace,
        status=1,
    )


def peer_failed(p: int, failure: str) -> None:
    """Process ``p`` ended by ``failure`` (learned from its record at an agreement): end too.

    The same words and status as the failure watch (`_Watch.failed`), which may not have read
    the post yet; nothing with fail-fast off.
    """
    if _watch is not None and not _exit.ending():
        _watch.failed(p, failure)


def end_for(error: BaseException, why: str) -> bool:
    """End this process for ``error``, found beside a caller that cannot return; False if off.

    For a caller waiting in a computation that ``error`` says will never complete (a step of
    `meshkit.global_batches` that the other processes will not take): no call of its own is
    left to raise it. Says the error (``why`` first), posts it for the others, and exits with
    status 1, the way an uncaught exception does; with fail-fast off it does nothing (False).
    """
    if _grace is None or _exit.ending():
        return False
    _end_saying(error, f"meshkit: {why}.\n", "this process cannot go on", _grace)
    return True


def _end_saying(error: BaseException, header: str, why: str, grace: float) -> None:
    """Say ``header`` and ``error``, leave its `failed` event, end as `_end` does (status 1)."""
    say(_LOG, logging.ERROR, f"{header}{type(error).__name__}: {error}\n")
    _events.emit(_events.FAILED, **_failure_fields(error, None))
    first = (str(error).splitlines() or [""])[0][:300]
    _end(f"{type(error).__name__}: {first}", why, grace, status=1)


def _end_with_known_cause(grace: float) -> bool:
    """End this process with the failure that caused JAX's error, if it knows it: True if so.

    JAX's error at a collective or wait whose peer is gone follows a failure found first: a
    cross-process check kept for this process's next meshkit call (found here, or told by the
    process that found it), or another process's posted failure that the watch has not read
    yet. The process that found it may end first; its peers then see gloo's or the service's
    words, and would name no cause. Each is said as it would have been without JAX's error.
    """
    kept = None if _kept is None else _kept()
    if kept is not None:
        header = "meshkit: the error above follows a cross-process check that failed first:\n"
        _end_saying(kept, header, "a failed cross-process check", grace)
        return True
    posted = _peer_failures()
    if posted is None:
        return False
    p, failure = min(posted.failures)
    assert _watch is not None
    say(_LOG, logging.ERROR, "meshkit: the error above follows another process's failure.\n")
    _watch.failed(p, failure)
    return True


def _peer_failures() -> PeerPosts | None:
    """The others' posts once one names a failure; None if none does within `_POST_WAIT_S`.

    A peer posts its failure after its exit handlers, which may already have closed its side of
    a collective: one wait on this process's alarm key (which a post writes) covers that gap.
    """
    for look in range(2):
        if _watch is None or _exit.ending():
            return None
        posted = _watch.poll()
        if isinstance(posted, PeerPosts) and posted.failures:
            return posted
        if look == 0 and (_watch.wait is None or not _call_quietly(_watch.wait, _POST_WAIT_S)):
            return None
    return None


def _call_quietly(wait: Wait, timeout: float) -> bool:
    try:
        return wait(timeout)
    except Exception:  # the service is gone: no post will come
        return False


def _raised_at(value: BaseException) -> str:
    """``file:line`` where ``value`` was raised (its traceback's innermost frame), or ""."""
    tb = value.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return "" if tb is None else f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"


def _failure_fields(value: BaseException, diagnosis: _diagnose.Diagnosis | None) -> dict[str, Any]:
    """The `failed` event's fields for an exception: its type, else what its text says."""
    error = type(value).__name__
    if isinstance(value, DivergenceError):  # every process raises it: it names who differs
        return {"cause": "divergence", "error": error, "processes": value.processes,
                "field": value.field}  # fmt: skip
    if diagnosis is None:
        return {"cause": "exception", "error": error, "where": _raised_at(value)}
    # "timeout": one of JAX's cross-process waits ran out; "lost": another process, or the
    # coordination service it hosted, is gone: that one failed first.
    cause = "timeout" if diagnosis.kind == "timeout" else "peer"
    return {"cause": cause, "error": error, "system": diagnosis.system,
            "process": diagnosis.process}  # fmt: skip


def _end(failure: str, why: str, grace: float, *, status: int) -> None:
    """Run the exit handlers for at most ``grace`` s, post ``failure``, exit with ``status``.

    The failure is posted after the handlers, so that this process is normally the first to
    exit (a launcher then names it); the process that hosts the coordination service then
    stays up until the others' failure watch has read it.
    """
    _exit.end(
        status,
        grace=grace,
        announce=(
            f"meshkit: {why}; running exit handlers (at most {grace:g} s), then exiting without "
            f"waiting for the other processes ({ENV_FAIL_FAST}=0 waits).\n"
        ),
        late=(
            f"meshkit: exit handlers still running after {grace:g} s; exiting now "
            f"({ENV_FAIL_FAST_GRACE} gives them longer).\n"
        ),
        final=lambda: _post(failure),
    )


def _post(failure: str) -> None:
    """Post ``failure`` for the others' failure watch."""
    _, me, n = _compat.distributed_state()
    if _post_failure is not None and n > 1:
        try:
            _post_failure(failure)
        except Exception:  # the service may be gone already: nothing to tell
            pass
        else:
            if me == 0:  # it hosts the coordination service: let the others read it
                _wait_until_read(n)


def _wait_until_read(n: int) -> None:
    """Until every other process read the failure post or posted its own (at most `_READ_S`)."""

    def all_read() -> bool:
        read = 0 if _read is None else _read(0)
        posted = _watch.poll() if _watch is not None else None
        others = len(posted.failures) if isinstance(posted, PeerPosts) else 0
        return _read is None or read + others >= n - 1

    _until(all_read, _READ_S)


def _until(done: Callable[[], bool | None], seconds: float) -> bool | None:
    """Ask ``done`` every 50 ms for at most ``seconds``: True once it says so, False at the end.

    None when ``done`` gives up (returns None) or the service fails under it (it raises).
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            answer = done()
        except Exception:  # the service failed: nobody answers any more
            return None
        if answer is None or answer:
            return answer
        time.sleep(0.05)
    return False


# ---- the failure watch ----------------------------------------------------------------------


def poll_period(n: int) -> float:
    """Seconds between two looks of a watch that each of ``n`` processes runs.

    The failure watch after a read left unanswered, and `global_batches`' close watch: at most
    500 requests per second at the coordinator, whatever the process count.
    """
    return max(1.0, n / 500)


class _Watch:
    """Waits for the other processes' failures and preemption notices (in the service thread)."""

    def __init__(self, me: int, n: int, poll: Poll, wait: Wait | None = None) -> None:
        self.me, self.n, self.poll, self.wait = me, n, poll, wait
        self.lost = 0  # reads in a row the service answered as gone

    def look(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for a post, then act on the posts; False: watch no more."""
        woken = True
        if self.wait is not None:
            try:
                woken = self.wait(timeout)
            except Exception:  # the read tells whether the service is gone
                woken = True
        if not woken:
            return True
        going_on = self.check()
        if self.lost:
            time.sleep(poll_period(self.n))  # two reads, a period apart, before it counts
        return going_on

    def check(self) -> bool:
        """Read the posts once and act on them; False once this process is no longer joined."""
        if _exit.ending():
            return False
        posted = self.poll()
        if isinstance(posted, Unanswered):  # only a service that is gone counts
            self.lost = self.lost + 1 if posted.lost else 0
            if self.lost >= _LOST_AFTER:
                self._lost(posted.error)
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
        """End this process (status 1, no exit handler) for process ``p``'s ``failure``.

        Counts itself among the processes that read a failure post first (`_wait_until_read`).
        Process 0, which hosts the coordination service, first lets process ``p`` post its
        failure and exit (`_outlive`): a process whose service goes while it runs its exit
        handlers dies in the service's C++ abort instead of its own status.
        """
        if _read is not None and not _exit.ending():
            with contextlib.suppress(Exception):  # the service is gone: nobody waits for it
                _read(1)
        if self.me == 0 and not _exit.ending():
            self._outlive(p)
        self._exit(
            {"process": p, "system": "meshkit", "error": failure.split(":")[0]},
            f"meshkit: process {p} failed: {failure}\n"
            f"Process {self.me} stops too (status 1): the program cannot go on without "
            f"process {p} (a collective would wait for it for ever). Process {p}'s output "
            "holds the cause.\n",
        )

    def _outlive(self, p: int) -> None:
        """Until process ``p`` posted its failure (its last step before it exits), then a margin.

        At most `_READ_S`; at once when the service no longer answers.
        """

        def posted() -> bool | None:
            posts = self.poll()
            return any(q == p for q, _ in posts.failures) if isinstance(posts, PeerPosts) else None

        if _until(posted, _READ_S) is not None:
            time.sleep(_EXIT_MARGIN_S)

    def _lost(self, error: str) -> None:
        notice = _preemption.notice()
        if notice is not None:  # process 0 ended for the notice too, at the same deadline
            _preemption.end_preempted(
                notice, "process 0, which hosts the coordination service, has ended"
            )
            return
        self._exit(
            {"process": 0, "system": "the coordination service"},
            f"meshkit: lost the coordination service, which process 0 hosts ({error.strip()}).\n"
            f"Process 0 has exited or failed; process {self.me} stops too (status 1). Process "
            "0's output holds the cause.\n",
        )

    def _exit(self, fields: dict[str, Any], text: str) -> None:
        if _exit.ending():
            return
        _events.emit(_events.FAILED, cause="peer", **fields)
        _exit.now(1, text)


# ---- at a normal end ------------------------------------------------------------------------


def _at_exit(me: int) -> None:
    """Stop the watch; say, a while later, that this process still waits for the others.

    Runs before JAX's own exit handler (registered earlier), where the process waits at a
    shutdown barrier for every other process: one that waits long reached the end of its
    program while others did not, the usual sign of processes that took different paths.
    """
    _service_thread.watch(None)
    if not _exit.ending():
        _service_thread.at(
            "fail-fast: the end note", _ENDED_AFTER_S, lambda: _end_note(me), nudge=False
        )


def _end_note(me: int) -> None:
    say(
        _LOG,
        logging.WARNING,
        f"meshkit: process {me} {_diagnose.ENDED_MARK} {_ENDED_AFTER_S:g} s ago and "
        "waits at JAX's shutdown barrier for the other processes (one still running, or "
        "stuck in a computation this one never joined).\n",
    )
    _events.emit(_events.ENDED)
