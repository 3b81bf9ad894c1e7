"""Where a `meshkit.global_batches` loop ends early: every process must end it at the same step.

The processes' helper threads agree on each step ahead of their callers, so when one process
closes its iterator after step k (a ``break``, ``close()``, the end of a ``with`` block), the
others may already hold step k + 1, agreed with that process's helper. Nothing per step tells
them that its caller will never take it: that would be a round trip per step in every
``next()``, whose cost grows with the process count. Instead each process says once, when its
loop ends, how it left it (`leave`: closed after step k, its data ended after step k, it took
step k + 1 or asks for it, it failed), under the iterator's key, and:

- **a process that closes** waits until every process has said how it left (`confirm`: one
  wait, answered when the last process says it) and compares (`left_error`): a process that
  closed after another step, or went on, is a `DivergenceError` raised by ``close()`` before
  the caller computes anything after its loop (which could meet another process's step);
- **a process that goes on** learns of the close from a thread that reads the posts about once
  a second (`Watch`; one request per process and period, none per step), or from the closing
  process's last record in the helpers' agreement. Its next ``next()`` raises instead of
  handing out a step the other will not take; if its caller has taken such a step already, it
  is likely waiting in that step's collective, and the process is ended with the error unless a
  meshkit call raises it within seconds. Either way it says so first (`leave`), which answers
  the closing processes.

Every process that closes after the same step is the common case, and costs one wait at the
close (four requests per process: the post, the count, the wait, the read).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..coord import missing as _missing
from ..coord.node import Node
from ..core import env as _env
from ..core.errors import DivergenceError, MeshkitError
from ..lifecycle import failfast as _failfast

__all__ = ["CLOSED", "Watch", "confirm", "differs", "leave", "left_error", "posted", "went_on"]

_WHAT = "meshkit.global_batches"

# How a process left its loop (`leave`), with the steps its caller took then.
CLOSED = "closed"  # it closed its iterator
ENDED = "ended"  # its data ended (for every process: the end is agreed)
TOOK = "took"  # it took a step past a process that closed
ASKS = "asks"  # it asked for a step past a process that closed
FAILED = "failed"  # its loop failed (a loader's error, a check)


def _key(tag: str) -> str:
    return f"meshkit/closes/{tag}/"


def _count_key(tag: str) -> str:
    return f"meshkit/closes-count/{tag}"


def _all_key(tag: str) -> str:
    return f"meshkit/closes-all/{tag}"


def _read(node: Node, tag: str) -> dict[int, tuple[str, int]]:
    """How each process that said so left its loop: (how, steps its caller took)."""
    out = {}
    for k, v in node.service.dir_get(_key(tag)):
        how, _, steps = v.partition(" ")
        out[int(k.rsplit("/", 1)[1])] = (how, int(steps))
    return out


def posted(node: Node, tag: str) -> dict[int, int]:
    """The step counts posted so far by processes that closed ``tag``'s iterator early."""
    return {p: k for p, (how, k) in _read(node, tag).items() if how == CLOSED}


def leave(node: Node, tag: str, how: str, steps: int) -> None:
    """Say how this process left ``tag``'s loop (once per loop): ``how`` after ``steps`` steps.

    The process that says it last marks every process as said (`confirm` waits for that).
    """
    node.service.set(_key(tag) + str(node.me), f"{how} {steps}", overwrite=True)
    if node.service.increment(_count_key(tag), 1) == node.n:
        node.service.set(_all_key(tag), "1", overwrite=True)


def confirm(node: Node, tag: str, timeout: float) -> dict[int, tuple[str, int]]:
    """Wait until every process has said how it left ``tag``'s loop (`leave`), or ``timeout``.

    Returns what each process said by then.
    """
    node.read(_all_key(tag), time.monotonic() + timeout)
    return _read(node, tag)


def _did(how: str, steps: int) -> str:
    return {
        CLOSED: f"closed its iterator after step {steps}",
        ENDED: f"reached the end of its data after step {steps}",
        TOOK: f"took step {steps}",
        ASKS: f"asks for step {steps + 1}",
    }.get(how, f"failed at step {steps + 1}")


def left_error(
    said: dict[int, tuple[str, int]], n: int, me: int, timeout: float
) -> MeshkitError | None:
    """The error of process ``me``, which closed its iterator, from what the ``n`` processes said.

    None when every process closed after the same step (or its data ended there).
    """
    mine = said[me][1]
    ahead = {p: hk for p, hk in said.items() if hk[0] not in (CLOSED, ENDED)}
    if ahead:
        groups = _missing.by_value({p: _did(*hk) for p, hk in ahead.items()})
        others = ", ".join(f"{_missing.processes(ps)} {did}" for did, ps in groups.items())
        return DivergenceError(
            f"{_WHAT}: the processes left their loops at different steps: this process "
            f"(process {me}) closed its iterator after step {mine}, but {others}.\n{_ADVICE}",
            processes=sorted(ahead),
            field="steps",
        )
    error = differs({p: k for p, (_, k) in said.items()}, me)
    missing = sorted(set(range(n)) - set(said))
    if error is not None or not missing:
        return error
    return MeshkitError(
        f"{_WHAT}: this process (process {me}) closed its iterator after step {mine}, and "
        f"{_missing.processes(missing)} did not leave the loop within {timeout:g} s (no "
        "close, no end of data, no further step asked for).\n"
        "Every process must leave its loop after the same step.\nConsider looking at those "
        f"processes' output; {_env.ENV_CHECK_TIMEOUT} sets the wait."
    )


def _after(closers: dict[int, int]) -> str:
    """``"process 0 after step 2"``, ``"processes 0,2 after step 2, process 3 after step 4"``."""
    groups = _missing.by_value({p: str(k) for p, k in closers.items()})
    return ", ".join(f"{_missing.processes(ps)} after step {k}" for k, ps in groups.items())


_ADVICE = (
    "Every process must take the same number of batches from its global_batches: a loop that "
    "stops early (break, close(), the end of a with block) must stop after the same step on "
    "every process.\nConsider deciding when to stop from a value every process has (the step "
    "number, a value computed on global arrays), not from one process's own data or clock."
)


def went_on(closers: dict[int, int], me: int, steps: int, *, took: bool) -> DivergenceError:
    """The error of process ``me``, which goes on past the step where ``closers`` closed.

    ``steps``: the steps it has taken; ``took``: it took a step past the closers' already (else
    it asks for step ``steps + 1``).
    """
    early = {p: k for p, k in closers.items() if k < steps + (0 if took else 1)} or closers
    named = _after(early)
    who = _missing.processes(sorted(early))
    if took:
        doing = (
            f"took step {steps} already: its computations at that step wait for "
            f"{who}, which will not join them"
        )
    else:
        doing = f"asks for step {steps + 1}, which {who} will not take"
    return DivergenceError(
        f"{_WHAT}: the processes left their loops at different steps: {named} closed "
        f"{'its iterator' if len(early) == 1 else 'their iterators'}, but this process "
        f"(process {me}) {doing}.\n{_ADVICE}",
        processes=sorted(early),
        field="steps",
    )


def differs(closers: dict[int, int], me: int) -> DivergenceError | None:
    """The error of a process ``me`` that closed, when ``closers`` closed after other steps."""
    mine = closers[me]
    others = {p: k for p, k in closers.items() if k != mine}
    if not others:
        return None
    named = _after(others)
    return DivergenceError(
        f"{_WHAT}: the processes left their loops at different steps: {named}, this process "
        f"(process {me}) after step {mine}.\n{_ADVICE}",
        processes=sorted(others),
        field="steps",
    )


class Watch(threading.Thread):
    """Reads the posts of ``tag`` every `period` until one is found or ``stop`` is set.

    First ``tick()`` runs (the caller's place: `meshkit._src.coord.places.Moving`; True ends
    the watch), then ``heard(closers)`` runs in this thread at the first non-empty read. A
    read that fails
    (the service is gone: the failure watch reports that) ends the watch.
    """

    def __init__(
        self,
        node: Node,
        tag: str,
        heard: Callable[[dict[int, int]], None],
        stop: threading.Event,
        tick: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(name="meshkit-global-batches-watch", daemon=True)
        self.node, self.tag, self.heard, self.stop, self.tick = node, tag, heard, stop, tick

    def run(self) -> None:
        wait = _failfast.poll_period(self.node.n)
        while not self.stop.wait(wait):
            try:
                if self.tick():
                    return
                closers = posted(self.node, self.tag)
            except Exception:  # the service is gone: the failure watch says so
                return
            if closers and not self.stop.is_set():
                self.heard(closers)
                return
