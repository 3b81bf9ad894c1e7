"""Cross-process agreement in O(1) coordination-service round trips per process and call.

Every cross-process check of meshkit (the pieces of `global_array_from_local`, debug mode's
call fingerprints, `make_mesh`, `barrier`, the steps of `global_batches`) asks one question:
*did every process arrive, and do their summaries agree?* `agree` answers it through the
coordination service's key-value store, never through a device collective (those are what
hang when processes diverge).

The protocol. Each process keeps, per tag, the digest of the summary it gave at its previous
agreement. A call is numbered ``seq`` (per tag, per process, under a lock), and

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
`leave`: it posts its record and arrives, flagged, at both counters, so the others learn at
once, from its record, why it will not come.

Keys are grouped in blocks of ``BLOCK`` calls; process 0 deletes a block once every process is
two blocks past it, so the store does not grow in a long run.

`agree_later` runs the same protocol beside the caller (a submitting thread and a waiting
thread per tag): the caller goes on at once, at most ``MAX_PENDING`` calls may be unverified,
and a disagreement is printed when found and raised by this process's next meshkit call
(`settle`). The waiting thread reads the verdicts of many calls with one directory read.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import sys
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import _compat, _runtime
from ._errors import MeshkitError

__all__ = ["Outcome", "agree", "agree_later", "leave", "settle", "stats", "tag_part"]

BLOCK = 64  # calls per key block (one delete per block)
MAX_PENDING = 16  # unverified calls agree_later allows per tag before the caller waits
_SHIFT = 16  # counter layout: arrivals in the low 16 bits, flags above (the store holds int32)
_MAX_PROCESSES = (1 << _SHIFT) - 1
_OK, _CHECK = "ok", "check"


@dataclass(frozen=True)
class Outcome:
    """What one agreement found.

    Attributes:
        agreed: every process arrived and every summary (and group summary) is equal.
        records: this process's record alone when ``agreed``; otherwise the record of every
            process that arrived (for the caller to name who differs and how).
        missing: processes that did not arrive within the timeout, sorted.
        gave_up: processes that stopped waiting for this call before every process arrived
            (this process arrived late, after their timeout), sorted.
        seq: the call's number under its tag (the same in every process).
    """

    agreed: bool
    records: dict[int, str]
    missing: tuple[int, ...] = ()
    gave_up: tuple[int, ...] = ()
    seq: int = 0


@dataclass
class _Stats:
    """Round trips to the coordination service made by this process (for tests and bench)."""

    rpcs: int = 0
    agreements: int = 0
    slow: int = 0  # agreements that needed phase 2 or 3

    def reset(self) -> None:
        self.rpcs = self.agreements = self.slow = 0


stats = _Stats()


@dataclass
class _Call:
    seq: int
    flag: bool
    summary: str
    groups: dict[str, tuple[int, str]]
    record: str
    arrived: float = 0.0  # monotonic time of the increment
    on_outcome: Callable[[Outcome], None] | None = None
    timeout: float = 0.0


@dataclass
class _Tag:
    """One sequence of agreements (a tag), in this process."""

    name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: int = 0
    last: str | None = None  # digest of the summary of the previous call, None: unknown
    # agree_later's state:
    cond: threading.Condition | None = None
    submitted: deque[_Call] = field(default_factory=deque)  # waiting for their increment
    arrived: deque[_Call] = field(default_factory=deque)  # incremented, verdict unknown
    threads: list[threading.Thread] = field(default_factory=list)


_tags: dict[str, _Tag] = {}
_tags_lock = threading.Lock()
failures: deque[BaseException] = deque()


def _state(tag: str) -> _Tag:
    with _tags_lock:
        state = _tags.get(tag)
        if state is None:
            state = _tags[tag] = _Tag(tag)
        return state


def tag_part(name: str) -> str:
    """``name`` made safe as one component of a tag: distinct names stay distinct."""
    return urllib.parse.quote(name, safe="")


def _key(tag: str, seq: int, part: str) -> str:
    return f"meshkit/{tag}/{seq // BLOCK}/{part}/{seq}"


def _digest(summary: str, groups: Mapping[str, tuple[int, str]]) -> str:
    h = hashlib.blake2b(summary.encode(), digest_size=16)
    for name in sorted(groups):
        h.update(b"\0" + name.encode() + b"\0" + groups[name][1].encode())
    return h.hexdigest()


def _client() -> tuple[Any, int, int]:
    client, me, n = _compat.distributed_state()
    if n > _MAX_PROCESSES:
        raise MeshkitError(
            f"meshkit: {n} processes exceed the {_MAX_PROCESSES} the agreement counters hold."
        )
    return client, me, n


def _number(state: _Tag, summary: str, groups: Mapping[str, tuple[int, str]]) -> tuple[int, bool]:
    """The call's number and whether its summary changed; the caller holds ``state.lock``."""
    digest = _digest(summary, groups)
    seq = state.seq
    state.seq += 1
    flag = digest != state.last
    state.last = digest
    return seq, flag


def _deadline_ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


def _timed_out(error: BaseException) -> bool:
    return "DEADLINE_EXCEEDED" in str(error)


def _increment(client: Any, key: str, flag: bool, amount: int = 1) -> int:
    stats.rpcs += 1
    return int(client.key_value_increment(key, amount + (int(flag) << _SHIFT)))


def _read(client: Any, key: str, deadline: float) -> str | None:
    """The value of ``key`` once written; None if it is not written before ``deadline``."""
    stats.rpcs += 1
    try:
        return str(client.blocking_key_value_get(key, _deadline_ms(deadline)))
    except Exception as e:  # JAX raises its runtime error type for a deadline
        if not _timed_out(e):
            raise
        return None


def _conclude(client: Any, tag: str, seq: int, part: str, total: int, n: int) -> str | None:
    """As the last arrival (``total`` counts ``n``), write verdict ``part`` of ``seq``.

    The verdict is ``ok`` when no arrival was flagged, ``check`` otherwise. Returns it, or
    None when this process was not the last to arrive.
    """
    if total & _MAX_PROCESSES != n:
        return None
    verdict = _OK if total >> _SHIFT == 0 else _CHECK
    stats.rpcs += 1
    client.key_value_set(_key(tag, seq, part), verdict)
    return verdict


def _verdict(
    client: Any, tag: str, seq: int, part: str, total: int, n: int, deadline: float
) -> str | None:
    """The verdict of counter ``part`` of ``seq``: written by the last arrival, read by others.

    None: not every process arrived before ``deadline``.
    """
    verdict = _conclude(client, tag, seq, part, total, n)
    return verdict if verdict is not None else _read(client, _key(tag, seq, part), deadline)


def _collect(
    client: Any, tag: str, seq: int, n: int, arrived: int, deadline: float
) -> tuple[dict[int, str], tuple[int, ...], tuple[int, ...]]:
    """Every posted record of ``seq``, who posted none, and who gave up waiting.

    Waits (until ``deadline``) for ``arrived`` records.
    """
    prefix = _key(tag, seq, "r") + "/"
    while True:
        stats.rpcs += 1
        entries = client.key_value_dir_get(prefix)
        records = {int(k.rsplit("/", 1)[1]): v for k, v in entries}
        if len(records) >= arrived or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    missing = tuple(p for p in range(n) if p not in records)
    posted = {p: json.loads(v) for p, v in records.items()}
    gave_up = tuple(sorted(p for p, v in posted.items() if v.get("gave_up")))
    return {p: v["record"] for p, v in posted.items()}, missing, gave_up


def _post(client: Any, tag: str, seq: int, me: int, call: _Call, gave_up: bool = False) -> None:
    posted: dict[str, Any] = {"summary": call.summary, "groups": call.groups, "record": call.record}
    if gave_up:
        posted["gave_up"] = True
    value = json.dumps(posted)
    stats.rpcs += 1
    client.key_value_set(f"{_key(tag, seq, 'r')}/{me}", value)


def _settle_call(client: Any, tag: str, call: _Call, me: int, n: int, total: int | None) -> Outcome:
    """Phases 1 (after the increment), 2 and 3 of one call.

    ``total`` is the increment's result; None when another thread made the increment (the
    verdict is then read).
    """
    seq, deadline = call.seq, call.arrived + call.timeout
    if total is None:
        verdict = _read(client, _key(tag, seq, "d"), deadline)
    else:
        verdict = _verdict(client, tag, seq, "d", total, n, deadline)
    if verdict is None:
        # Not every process arrived in time. Say so on the counter (a flag, no arrival): if the
        # count is complete after all, the last process arrived just now and its verdict is on
        # the way; otherwise late arrivals will find this process's record marked as gave up.
        total = _increment(client, _key(tag, seq, "c"), True, amount=0)
        if total & _MAX_PROCESSES == n:
            verdict = _read(client, _key(tag, seq, "d"), time.monotonic() + call.timeout)
        if verdict is None:
            stats.slow += 1
            _post(client, tag, seq, me, call, gave_up=True)
            _arrive_flagged(client, tag, seq, "c2", "d2", n)
            return _explain(client, tag, seq, n, total & _MAX_PROCESSES, call.timeout)
    if verdict == _OK:
        return Outcome(True, {me: call.record}, (), (), seq)
    stats.slow += 1
    _post(client, tag, seq, me, call)
    # Phase 2: compare exactly with process 0 and with each replica group's reference.
    same = True
    for ref in sorted({0} | {ref for ref, _ in call.groups.values()} - {me}):
        value = _read(client, f"{_key(tag, seq, 'r')}/{ref}", deadline)
        if value is None:
            same = False
            break
        theirs = json.loads(value)
        if ref == 0 and theirs["summary"] != call.summary:
            same = False
        for name, (group_ref, summary) in call.groups.items():
            if group_ref == ref and theirs["groups"].get(name, [None, None])[1] != summary:
                same = False
    total2 = _increment(client, _key(tag, seq, "c2"), not same)
    verdict2 = _verdict(client, tag, seq, "d2", total2, n, deadline)
    if verdict2 == _OK:
        return Outcome(True, {me: call.record}, (), (), seq)
    # Phase 3: every record, to explain the difference (or name who did not come).
    arrived = n if verdict2 is not None else total2 & _MAX_PROCESSES
    return _explain(client, tag, seq, n, arrived, call.timeout)


def _explain(client: Any, tag: str, seq: int, n: int, arrived: int, timeout: float) -> Outcome:
    """Phase 3: the records of every process that arrived, and those that did not."""
    records, missing, gave_up = _collect(
        client, tag, seq, n, arrived, time.monotonic() + min(timeout, 30.0)
    )
    return Outcome(False, records, missing, gave_up, seq)


def _collect_garbage(client: Any, tag: str, seq: int, me: int) -> None:
    """Process 0 deletes the key block two blocks behind, which every process has left."""
    if me == 0 and seq % BLOCK == 0 and seq >= 2 * BLOCK:
        stats.rpcs += 1
        with contextlib.suppress(Exception):  # a failed delete only leaves keys behind
            client.key_value_delete(f"meshkit/{tag}/{seq // BLOCK - 2}/")


def agree(
    tag: str,
    summary: str,
    record: str,
    *,
    timeout: float,
    groups: Mapping[str, tuple[int, str]] | None = None,
) -> Outcome:
    """Agree with every other process on ``summary``; the caller's thread waits for the answer.

    Processes must call it the same number of times per ``tag``, in the same order.

    Args:
        tag: names the sequence of agreements, e.g. ``"make_mesh"`` (no ``//``).
        summary: what must be equal in every process.
        record: what to show (JSON text, say) when summaries differ; not compared.
        timeout: seconds to wait for the other processes.
        groups: replica groups this process belongs to: name -> (the group's reference
            process, this process's summary for the group); processes sharing a group name
            must give equal group summaries.

    Returns:
        An `Outcome`; ``agreed`` False with every arrived process's record when anything
        differs, ``missing`` naming processes that did not arrive in time.
    """
    if _live:  # a waiting agreement is a sync point: earlier deferred checks are raised first
        drain(timeout + 35.0)  # each pending call waits at most its timeout, plus phase 3
    settle()
    client, me, n = _client()
    if client is None or n == 1:
        return Outcome(True, {me: record})
    state = _state(tag)
    groups = dict(groups or {})
    with state.lock:
        seq, flag = _number(state, summary, groups)
    call = _Call(seq, flag, summary, groups, record, timeout=timeout)
    stats.agreements += 1
    _collect_garbage(client, tag, seq, me)
    total = _increment(client, _key(tag, seq, "c"), flag)
    call.arrived = time.monotonic()
    outcome = _settle_call(client, tag, call, me, n, total)
    if not outcome.agreed:
        with state.lock:
            state.last = None  # the next call compares again
    return outcome


def leave(tag: str, record: str) -> None:
    """Tell the processes at ``tag``'s next agreement that this one will not come, and why.

    Posts ``record`` and arrives, flagged, at both counters of the next call, so the others
    find the record (`Outcome.records`) instead of waiting for this process.
    """
    client, me, n = _client()
    if client is None or n == 1:
        return
    state = _state(tag)
    with state.lock:
        seq = state.seq
        state.seq += 1
        state.last = None
    call = _Call(seq, True, "\0left", {}, record)
    _post(client, tag, seq, me, call)
    _arrive_flagged(client, tag, seq, "c", "d", n)
    _arrive_flagged(client, tag, seq, "c2", "d2", n)


def _arrive_flagged(client: Any, tag: str, seq: int, part: str, verdict_part: str, n: int) -> None:
    """Arrive at counter ``part`` with a flag; as the last arrival, write the verdict."""
    _conclude(client, tag, seq, verdict_part, _increment(client, _key(tag, seq, part), True), n)


# ---- agree_later: the same protocol beside the caller ------------------------------------------


def agree_later(
    tag: str,
    summary: str,
    record: str,
    *,
    timeout: float,
    on_outcome: Callable[[Outcome], None],
    groups: Mapping[str, tuple[int, str]] | None = None,
) -> None:
    """`agree`, verified beside the caller: returns at once.

    ``on_outcome`` runs in meshkit's waiting thread when the processes did not agree; what it
    raises is printed at once and raised by this process's next meshkit call (`settle`). At
    most `MAX_PENDING` calls per tag are unverified; a further call waits. Calls numbered before
    a disagreement was found compare with the summaries of the call that disagreed (the
    induction behind ``ok`` assumes it agreed), so a disagreement that persists is raised once,
    for its first call; calls numbered after it compare afresh.
    """
    settle()
    client, _, n = _client()
    if client is None or n == 1:
        return
    state = _state(tag)
    groups = dict(groups or {})
    with state.lock:
        if state.cond is None:  # the tag's first deferred call starts its two threads
            state.cond = threading.Condition(state.lock)
            for target, role in ((_submitter, "submit"), (_waiter, "wait")):
                thread = threading.Thread(
                    target=target, args=(state,), name=f"meshkit-agree-{role}:{tag}", daemon=True
                )
                thread.start()
                state.threads.append(thread)
            _live.add(tag)
        cond = state.cond
    stats.agreements += 1
    with cond:
        while len(state.submitted) + len(state.arrived) >= MAX_PENDING and not failures:
            cond.wait(0.1)
        # Numbered and queued together: the submitting thread arrives in number order.
        seq, flag = _number(state, summary, groups)
        call = _Call(seq, flag, summary, groups, record, on_outcome=on_outcome, timeout=timeout)
        state.submitted.append(call)
        cond.notify_all()
    settle()


_live: set[str] = set()


def _submitter(state: _Tag) -> None:
    """Arrive (increment) for each submitted call, in order; the last arrival writes verdicts."""
    client, me, n = _client()
    cond = state.cond
    assert cond is not None
    while True:
        with cond:
            while not state.submitted:
                cond.wait()
            call = state.submitted[0]
        try:
            _collect_garbage(client, state.name, call.seq, me)
            total = _increment(client, _key(state.name, call.seq, "c"), call.flag)
            call.arrived = time.monotonic()
            _conclude(client, state.name, call.seq, "d", total, n)
        except Exception as e:  # the coordination service failed: reported by settle()
            _fail(e)
            with cond:
                state.submitted.popleft()
                cond.notify_all()
            continue
        with cond:
            state.submitted.popleft()
            state.arrived.append(call)
            cond.notify_all()


def _waiter(state: _Tag) -> None:
    """Settle every arrived call in order; verdicts of many calls come in two round trips.

    When the newest call's verdict is written, so is every older one's (each process arrives in
    order, and the last arrival of a call writes its verdict before arriving at the next), so
    one blocking get of the newest and one directory read per key block give them all.
    """
    client, me, n = _client()
    cond = state.cond
    assert cond is not None
    tag = state.name
    while True:
        with cond:
            while not state.arrived:
                cond.wait()
            calls = list(state.arrived)
        verdicts: dict[int, str] = {}
        newest = calls[-1]
        try:
            verdict = _read(client, _key(tag, newest.seq, "d"), newest.arrived + newest.timeout)
            if verdict is not None and len(calls) > 1:
                for block in sorted({c.seq // BLOCK for c in calls[:-1]}):
                    stats.rpcs += 1
                    for key, value in client.key_value_dir_get(f"meshkit/{tag}/{block}/d/"):
                        verdicts[int(key.rsplit("/", 1)[1])] = value
            if verdict is not None:
                verdicts[newest.seq] = verdict
        except Exception as e:  # the coordination service failed: reported by settle()
            verdicts.clear()
            _fail(e)
        for call in calls:
            try:
                if verdicts.get(call.seq) == _OK:
                    outcome = Outcome(True, {me: call.record}, (), (), call.seq)
                else:
                    outcome = _settle_call(client, tag, call, me, n, None)
                if not outcome.agreed:
                    with state.lock:
                        state.last = None
                    assert call.on_outcome is not None
                    call.on_outcome(outcome)
            except Exception as e:  # a disagreement (or a failed service): raised by settle()
                _fail(e)
            with cond:
                state.arrived.popleft()
                cond.notify_all()


def _fail(error: BaseException) -> None:
    """Keep ``error`` for `settle`, say so now, and end the process if it is never raised.

    A process whose main thread does not come back to meshkit within the check timeout is
    likely blocked in a computation on the inputs that disagree (a collective that will not
    complete); it exits with status 1 so that the launcher ends the run instead of a hang.
    """
    failures.append(error)
    grace = _runtime.check_timeout()
    _say(
        f"meshkit: a cross-process check failed; this process's next meshkit call raises it (if "
        f"none comes within {grace:g} s, the process exits):\n{type(error).__name__}: {error}\n"
    )

    def exit_if_unraised() -> None:
        if any(e is error for e in failures):
            _say(
                f"meshkit: exiting with status 1: the failed check above was not raised within "
                f"{grace:g} s ({_runtime.ENV_CHECK_TIMEOUT} sets the wait).\n"
            )
            os._exit(1)

    timer = threading.Timer(grace, exit_if_unraised)
    timer.daemon = True
    timer.start()


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(text)
        sys.stderr.flush()


def settle() -> None:
    """Raise the first disagreement `agree_later` found since the last call, if any."""
    if failures:
        raise failures.popleft()


def drain(timeout: float) -> bool:
    """Wait until every `agree_later` call of this process is verified (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    for name in list(_live):
        state = _tags[name]
        assert state.cond is not None
        with state.cond:
            while (state.submitted or state.arrived) and not failures:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                state.cond.wait(min(left, 0.1))
    return True


@atexit.register
def _drain_at_exit() -> None:
    if _live:
        drain(5.0)
