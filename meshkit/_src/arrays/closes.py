"""Where a `meshkit.global_batches` loop ends early: every process must end it at the same step.

The processes' helper threads agree on each step ahead of their callers, so when one process
closes its iterator after step k (a ``break``, ``close()``, the end of a ``with`` block), the
others may already hold step k + 1, agreed with that process's helper. Nothing per step tells
them that its caller will never take it: that would be a round trip per step in every
``next()``, whose cost grows with the process count. Instead a process that closes early posts
its step count once, under the iterator's key (`post`), and every process compares:

- **a process that closes** reads the others' posts: one that closed after another step is a
  `DivergenceError` (`differs`), raised by ``close()``;
- **a process that goes on** learns of the close from a thread that reads the posts about once
  a second (`Watch`; one request per process and period, none per step), or from the closing
  process's last record in the helpers' agreement. Its next ``next()`` raises instead of
  handing out a step the other will not take; if its caller has taken such a step already, it
  is likely waiting in that step's collective, and the process is ended with the error unless a
  meshkit call raises it within seconds.

Every process that closes after the same step is the common case, and costs two requests per
process at the close.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..coord import absent as _absent
from ..coord.node import Node
from ..core.errors import DivergenceError
from ..lifecycle import failfast as _failfast

__all__ = ["Watch", "differs", "post", "posted", "went_on"]

_WHAT = "meshkit.global_batches"


def _key(tag: str) -> str:
    return f"meshkit/closes/{tag}/"


def posted(node: Node, tag: str) -> dict[int, int]:
    """The step counts posted so far by processes that closed ``tag``'s iterator early."""
    return {int(k.rsplit("/", 1)[1]): int(v) for k, v in node.service.dir_get(_key(tag))}


def post(node: Node, tag: str, steps: int) -> dict[int, int]:
    """Post that this process closed after ``steps`` steps; every post so far, this one's too.

    Of two processes that close at once, at least the later reader sees the other's post.
    """
    node.service.set(_key(tag) + str(node.me), str(steps), overwrite=True)
    return posted(node, tag)


def _after(closers: dict[int, int]) -> str:
    """``"process 0 after step 2"``, ``"processes 0,2 after step 2, process 3 after step 4"``."""
    groups = _absent.by_value({p: str(k) for p, k in closers.items()})
    return ", ".join(f"{_absent.processes(ps)} after step {k}" for k, ps in groups.items())


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
    who = _absent.processes(sorted(early))
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

    First ``tick()`` runs (the caller's position: `meshkit._src.arrays.position`; True ends
    the watch), then the posts are read: ``heard(closers)`` runs in this thread at the first
    non-empty read. A read that fails (the service is gone: the failure watch reports that)
    ends the watch.
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
