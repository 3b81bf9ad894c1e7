"""`agree`: every process gets every record whenever they differ, through atomic counters.

Each process keeps, per tag, the digest of the summary it gave at its previous agreement. A call
is numbered ``seq`` (per tag, per process, under a lock), and

1. **Arrival, one atomic increment.** The process adds ``1 + CHANGED * flag`` to the counter
   of ``(tag, seq)``, where ``flag`` says whether its summary differs from its own previous one
   (always true at the first call). The increment returns the new total: the process that makes
   the count reach ``N`` is the last, and it writes the verdict, ``ok`` when no process
   changed, ``check`` otherwise. The others read the verdict with one blocking get (which also
   bounds the wait: a process that does not come within the timeout is named). In a steady loop
   that is two round trips per process and call, 2N at the coordinator, whatever N is.
   ``ok`` is exact, not probabilistic: the summaries were equal at the previous call (by
   induction), and none changed.
2. **Comparison with a reference, only when something changed.** Each process posts its full
   record and reads the record of process 0 (and of the reference process of each replica
   group it belongs to), compares exactly, and adds its verdict to a second counter; the last
   writes ``ok`` or ``check`` again. Still O(1) round trips per process.
3. **Full records, only to explain a difference.** One directory read returns every process's
   record, so the caller can name who differs and how.

A process that leaves a sequence of agreements (a failure, an iterator closed early) calls
`leave`, so the others learn at once, from its record, why it will not come.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from .node import (
    CHECK,
    LEFT,
    MAX_PROCESSES,
    OK,
    SHIFT,
    Call,
    Group,
    Node,
    Outcome,
    Posted,
    changed,
    key,
    text,
)

__all__ = ["agree", "leave", "settle_call"]


def increment(node: Node, key_: str, flag: bool, amount: int = 1) -> int:
    return node.service.increment(key_, amount + (int(flag) << SHIFT))


def conclude(node: Node, tag: str, seq: int, part: str, total: int) -> str | None:
    """As the last arrival (``total`` counts ``n``), write verdict ``part`` of ``seq``.

    The verdict is ``ok`` when no arrival was flagged, ``check`` otherwise. Returns it, or
    None when this process was not the last to arrive.
    """
    if total & MAX_PROCESSES != node.n:
        return None
    verdict = OK if total >> SHIFT == 0 else CHECK
    node.service.set(key(tag, seq, part), verdict)
    return verdict


def verdict(node: Node, tag: str, seq: int, part: str, total: int, deadline: float) -> str | None:
    """The verdict of counter ``part`` of ``seq``: written by the last arrival, read by others.

    None: not every process arrived before ``deadline``.
    """
    found = conclude(node, tag, seq, part, total)
    return found if found is not None else node.read(key(tag, seq, part), deadline)


def post(node: Node, tag: str, call: Call, gave_up: bool = False) -> None:
    node.write(tag, call.seq, Posted(call.summary, text(call.record), call.groups, gave_up))


def settle_call(node: Node, tag: str, call: Call, total: int) -> Outcome:
    """Phases 1 (after the increment, whose result is ``total``), 2 and 3 of one call."""
    seq, deadline, me, n = call.seq, call.arrived + call.timeout, node.me, node.n
    first = verdict(node, tag, seq, "d", total, deadline)
    if first is None:
        # Not every process arrived in time. Say so on the counter (a flag, no arrival): if the
        # count is complete after all, the last process arrived just now and its verdict is on
        # the way; otherwise late arrivals will find this process's record marked as gave up.
        total = increment(node, key(tag, seq, "c"), True, amount=0)
        if total & MAX_PROCESSES == n:
            first = node.read(key(tag, seq, "d"), time.monotonic() + call.timeout)
        if first is None:
            node.stats.slow += 1
            post(node, tag, call, gave_up=True)
            arrive_flagged(node, tag, seq, "c2", "d2")
            return explain(node, tag, seq, total & MAX_PROCESSES, call.timeout)
    if first == OK:
        return Outcome(True, {me: text(call.record)}, (), (), seq)
    node.stats.slow += 1
    post(node, tag, call)
    # Phase 2: compare exactly with process 0 and with each replica group's reference.
    same = True
    for ref in sorted({0} | {ref for ref, _ in call.groups.values()} - {me}):
        value = node.read(f"{key(tag, seq, 'r')}/{ref}", deadline)
        if value is None:
            same = False
            break
        theirs = Posted.from_json(value)
        if ref == 0 and theirs.summary != call.summary:
            same = False
        for name, (group_ref, summary) in call.groups.items():
            if group_ref == ref and theirs.groups.get(name, (None, None))[1] != summary:
                same = False
    total2 = increment(node, key(tag, seq, "c2"), not same)
    second = verdict(node, tag, seq, "d2", total2, deadline)
    if second == OK:
        return Outcome(True, {me: text(call.record)}, (), (), seq)
    # Phase 3: every record, to explain the difference (or name who did not come).
    arrived = n if second is not None else total2 & MAX_PROCESSES
    return explain(node, tag, seq, arrived, call.timeout)


def explain(node: Node, tag: str, seq: int, arrived: int, timeout: float) -> Outcome:
    """Phase 3: the records of every process that arrived, and those that did not."""
    records, missing, gave_up = node.collect(
        tag, seq, arrived, time.monotonic() + min(timeout, 30.0)
    )
    return Outcome(False, records, missing, gave_up, seq)


def arrive_flagged(node: Node, tag: str, seq: int, part: str, verdict_part: str) -> None:
    """Arrive at counter ``part`` with a flag; as the last arrival, write the verdict."""
    conclude(node, tag, seq, verdict_part, increment(node, key(tag, seq, part), True))


def agree(
    node: Node,
    tag: str,
    summary: str,
    record: str,
    *,
    timeout: float,
    groups: Mapping[str, Group] | None = None,
    what: str = "",
) -> Outcome:
    """Agree with every other process on ``summary``; the caller's thread waits for the answer.

    Processes must call it the same number of times per ``tag``, in the same order.

    Args:
        node: this process at the coordination service.
        tag: names the sequence of agreements, e.g. ``"make_mesh"`` (no ``//``).
        summary: what must be equal in every process.
        record: what to show (JSON text, say) when summaries differ; not compared.
        timeout: seconds to wait for the other processes.
        groups: replica groups this process belongs to: name -> (the group's reference
            process, this process's summary for the group); processes sharing a group name
            must give equal group summaries.
        what: the agreement in words, for a message naming processes that wait at different
            agreements (`meshkit._src.coord.waits`; default the tag).

    Returns:
        An `Outcome`; ``agreed`` False with every arrived process's record when anything
        differs, ``missing`` naming processes that did not arrive in time.

    Raises:
        DivergenceError: the processes wait at different agreements (`Node.probe_waits`).
    """
    state = node.tag(tag)
    groups = dict(groups or {})
    with state.lock:
        if state.window is not None:
            raise AssertionError(f"meshkit: tag {tag!r} is agreed beside the caller (agree_later)")
        seq = state.seq
        state.seq += 1
        flag = changed(state, summary, groups)
    call = Call(seq, flag, summary, groups, record, timeout=timeout)
    node.stats.agreements += 1
    node.collect_garbage(tag, seq)
    with node.waited(tag, seq, what):
        total = increment(node, key(tag, seq, "c"), flag)
        call.arrived = time.monotonic()
        outcome = settle_call(node, tag, call, total)
    if not outcome.agreed:
        with state.lock:
            state.counter.last = None  # the next call compares again
    return outcome


def leave(node: Node, tag: str, record: str) -> None:
    """Tell the processes at ``tag``'s next agreement that this one will not come, and why.

    Posts ``record`` and arrives, flagged, at both counters of the next call, so the others
    find the record (`Outcome.records`) instead of waiting for this process.
    """
    state = node.tag(tag)
    with state.lock:
        seq = state.seq
        state.seq += 1
        state.counter.last = None
    post(node, tag, Call(seq, True, LEFT, {}, record))
    arrive_flagged(node, tag, seq, "c", "d")
    arrive_flagged(node, tag, seq, "c2", "d2")
