"""`agree_later`: agreement after the call returns, on windows of calls (a thread per tag in use).

For ``global_array_from_local(check="deferred")``; the protocol: docs/coordination.md, "The
deferred form: windows".
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Mapping

from . import agreement as _agreement
from . import channel as _channel
from .node import LEFT, Call, Group, Node, Outcome, RecordText, WindowState, key, text

WINDOW = 512  # calls one window of agree_later holds at most
MAX_PENDING = 2 * WINDOW  # unverified calls agree_later allows per tag before the caller waits
# A window stays open this long after its first call: a loop of slow calls then shares one
# agreement among several calls instead of paying one per call.
LINGER_S = 0.1
VERDICT_EXTRA_S = 35.0  # a drain waits the timeout and this: the phase naming who is missing
_LEFT_WINDOW = "left"  # what process 0 writes for a window when it left the tag
IDLE_S = 1.0  # a tag's thread leaves after this long without a call


def agree_later(
    node: Node,
    tag: str,
    summary: str,
    record: RecordText,
    *,
    timeout: float,
    on_outcome: Callable[[Outcome], None],
    groups: Mapping[str, Group] | None = None,
) -> None:
    """`agree`, verified after the call returns: returns at once.

    ``on_outcome`` runs in the tag's thread for the first call of a window that differs; what it
    raises is kept for this process's next meshkit call.
    """
    window = windowed(node, tag)
    groups = dict(groups or {})
    node.stats.agreements += 1
    with window.cond:
        while len(window.queue) + window.inflight >= MAX_PENDING and not node.failures:
            window.cond.wait(0.1)
        window.queue.append(Call(summary, groups, record, time.monotonic(), timeout, on_outcome))
        window.on_outcome = on_outcome
        _ensure_thread(node, window)
        if 0 < window.wanted <= len(window.queue):
            window.cond.notify_all()


def windowed(node: Node, tag: str) -> WindowState:
    """The state of a tag agreed after the call returns."""
    window = node.tags.get(tag)
    if window is None:  # the tag's first call (setdefault is atomic: two first calls share one)
        window = node.tags.setdefault(tag, WindowState(tag, node.channel()))
    return window


def _ensure_thread(node: Node, window: WindowState) -> None:
    """After a call or a leave is queued (``window.cond`` held): a thread must take it."""
    if window.thread is None and not node.stopping.is_set():
        window.thread = threading.Thread(
            target=_run, args=(node, window), name=f"meshkit-agree:{window.name}", daemon=True
        )
        window.thread.start()


def leave_later(node: Node, tag: str, record: str, wait: float) -> None:
    """`leave` for a deferred tag; waits (at most ``wait`` s) until its thread posted it."""
    window = windowed(node, tag)
    with window.cond:
        window.left_posted.clear()
        window.left = record
        _ensure_thread(node, window)
        window.cond.notify_all()
    window.left_posted.wait(wait)


def _run(node: Node, window: WindowState) -> None:
    """Agree on each window of queued calls, in order, for as long as the process runs."""
    cond, tag, me, stopping = window.cond, window.name, node.me, node.stopping
    while True:
        with cond:
            window.wanted = 1
            if not cond.wait_for(
                lambda: window.queue or window.left is not None or stopping.is_set(), IDLE_S
            ):
                window.wanted = 0  # idle: the tag's next call starts a thread again
                window.thread = None
                return
            if me == 0 and window.queue:  # let the window fill for `LINGER_S`
                _await_calls(node, window, WINDOW, window.queue[0].arrived + LINGER_S)
            window.wanted = 0
            if stopping.is_set():
                return
            seq = window.seq
            window.seq += 1
            head = window.queue[0] if window.queue else None
            offer = min(len(window.queue), WINDOW)
        taken: list[Call] = []
        left = None
        try:
            node.collect_garbage(tag, seq)
            decided = _decide(node, tag, seq, offer, head)
            if stopping.is_set():
                return  # the process exits
            taken, left = _take(node, window, decided)
            agreement = _window(taken, left, decided, head)
            outcome = _agreement.agree(
                node,
                "w:" + _channel.tag_part(tag),
                tag,
                agreement.summary,
                agreement.record,
                timeout=max(agreement.arrived + agreement.timeout - time.monotonic(), 0.001),
                groups=agreement.groups,
            )
            if stopping.is_set():
                return  # the process exits: its last window is not reported
            if not outcome.agreed:
                _report(window, taken, outcome, me)
        except Exception as e:  # a disagreement, or the coordination service failed
            # A caller draining the tag raises it in a moment: no notice needed.
            grace = head.timeout if head is not None else None
            node.fail(e, grace, quiet=window.draining > 0)
        with cond:
            window.inflight -= len(taken)
            if left is not None:
                window.left = None
                window.left_posted.set()
            cond.notify_all()


def _await_calls(node: Node, window: WindowState, want: int, until: float | None = None) -> None:
    """Wait (``window.cond`` held) until the caller made ``want`` calls, or ``until`` passed.

    A caller that waits for us (a waiting agreement drains) or left the tag makes no more.
    """
    window.wanted = want
    while (
        len(window.queue) < want
        and window.left is None
        and not window.draining
        and not node.stopping.is_set()
    ):
        remaining = 0.1 if until is None else until - time.monotonic()
        if remaining <= 0:
            break
        window.cond.wait(remaining)
    window.wanted = 0


def _decide(node: Node, tag: str, seq: int, offer: int, head: Call | None) -> str | None:
    """How many calls window ``seq`` holds (process 0 says), `_LEFT_WINDOW`, or None (no word)."""
    if node.me == 0:
        decided = str(offer) if offer else _LEFT_WINDOW
        node.service.set(key(tag, seq, "w"), decided)
        return decided
    deadline = head.arrived + head.timeout if head is not None else time.monotonic() + 60.0
    return node.read(key(tag, seq, "w"), deadline)


def _take(node: Node, window: WindowState, decided: str | None) -> tuple[list[Call], str | None]:
    """This process's calls of the window (fewer when it must not wait), and its left record."""
    with window.cond:
        if decided is None or decided == _LEFT_WINDOW:
            want = len(window.queue) if decided is None else min(1, len(window.queue))
        else:
            want = int(decided)
            _await_calls(node, window, want)  # if it stops short, the window is short, flagged
        taken = [window.queue.popleft() for _ in range(min(want, len(window.queue)))]
        window.inflight += len(taken)
        left = window.left if len(taken) < max(want, 1) or not taken else None
        return taken, left


def _window(taken: list[Call], left: str | None, decided: str | None, head: Call | None) -> Call:
    """One agreement for a window: its calls' summaries run by run, groups, and records."""

    def record() -> str:
        entries = [
            {"summary": c.summary, "record": text(c.record), "groups": c.groups} for c in taken
        ]
        if left is not None:
            entries.append({"summary": LEFT, "record": left, "groups": {}})
        return json.dumps(entries)

    runs = [(s, len(list(run))) for s, run in itertools.groupby(c.summary for c in taken)]
    if left is not None:
        runs.append((LEFT, 1))
    wanted = len(taken) if decided in (None, _LEFT_WINDOW) else int(decided)
    groups = {f"{i}/{name}": group for i, c in enumerate(taken) for name, group in c.groups.items()}
    if len(runs) == 1 and runs[0][1] == wanted:  # one run of the window's size: the same
        summary = json.dumps([{"summary": runs[0][0], "count": "all"}])  # every window
    else:
        summary = json.dumps([{"summary": s, "count": count} for s, count in runs])
    started = head.arrived if head is not None else time.monotonic()
    timeout = head.timeout if head is not None else (taken[0].timeout if taken else 60.0)
    return Call(summary, groups, record, started, timeout)


def _report(window: WindowState, taken: list[Call], outcome: Outcome, me: int) -> None:
    """Name the window's first call on which the processes differ (``on_outcome`` raises)."""
    entries = {p: json.loads(r) for p, r in outcome.records.items()}
    width = max((len(v) for v in entries.values()), default=1)

    def at(i: int) -> tuple[dict[int, dict], set[int]]:
        here = {p: v[i] for p, v in entries.items() if i < len(v)}
        return here, set(outcome.missing) | {p for p, v in entries.items() if i >= len(v)}

    def differs(i: int) -> bool:
        here, absent = at(i)
        calls = {
            p: _agreement.Entry("", "", "", e["summary"], "", e["groups"]) for p, e in here.items()
        }
        return bool(absent) or not _agreement.same(calls)

    first = next((i for i in range(width) if differs(i)), width - 1)
    here, absent = at(first)
    if me in here and here[me]["summary"] == LEFT:
        return  # this process left the tag: it raised its own error
    on_outcome = taken[first].on_outcome if first < len(taken) else window.on_outcome
    assert on_outcome is not None
    records = {p: e["record"] for p, e in here.items()}
    missing = tuple(sorted(absent))
    on_outcome(Outcome(False, records, missing, outcome.gave_up, outcome.seq))


def sync_point(node: Node, timeout: float) -> None:
    """Before an agreement the caller waits for: its channel's deferred checks are raised first.

    Only its own channel's: another thread's window, drained, would be short in this process.
    """
    if node.tags:
        here = node.channel()
        mine = [w for w in list(node.tags.values()) if w.channel == here]
        node.drain(timeout + VERDICT_EXTRA_S, mine)
    node.settle()
