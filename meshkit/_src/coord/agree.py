"""Cross-process agreement in O(1) coordination-service round trips per process and call.

Every cross-process check of meshkit (the pieces of `global_array_from_local`, debug mode's
call fingerprints, `make_mesh`, `barrier`, the steps of `global_batches`) asks one question:
*did every process arrive, and do their summaries agree?* This module answers it through the
coordination service of `jax.distributed` (its key-value store and its barriers), never
through a device collective (those are what hang when processes diverge). Three forms, by what
the caller needs:

`check` (make_mesh, barrier): any difference is an error. One barrier wait per
process and call: the barrier is named by the tag and the digest of the summary, so processes
that agree meet there and its passing is the answer (one round trip, no key written). Processes
that differ wait at different barriers; after `PROBE_S` each posts its record and reads the
others', and arrives at every other digest's barrier with a participant list of its own, which
the service refuses to everyone waiting there: all stop at once and name who differs. A
process that does not come is named when the barrier's timeout expires.

`agree` (records that may legitimately differ: the sizes of an uneven batch, host arguments):
every process gets every record whenever they differ. Each process keeps, per tag, the digest
of the summary it gave at its previous agreement. A call is numbered ``seq`` (per tag, per
process, under a lock), and

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
`leave` (`leave_check` for a tag of `check`), so the others learn at once, from its record, why
it will not come.

`agree_later` (the default check of `global_array_from_local`, debug mode's fingerprints):
agreement beside the caller, on *windows* of calls (a thread per tag). Process 0's thread lets a
window fill (up to ``WINDOW`` calls, or the tag's linger, `LINGER_S` by default, after its first
call), then writes how many calls it holds; the others take as many of theirs, and the window
is one agreement on the list of its calls' summaries (`check`'s barrier, or `agree` when
replica groups are compared): two or three round trips per process and window however many
calls it holds. A caller that needs a verdict before it goes on (debug mode, for a call unlike
the one 12 calls back) drains its tag: `drain(timeout, tags=[tag])`, then `settle`.
The caller goes on at once, at most ``MAX_PENDING`` calls may be unverified, and a
disagreement is printed when found and raised by this process's next meshkit call (`settle`).

Keys are grouped in blocks of ``BLOCK`` agreements; process 0 deletes a block once every
process is two blocks past it, so the store does not grow in a long run.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError, say
from . import channel as _channel

__all__ = ["Outcome", "agree", "agree_later", "leave", "settle", "stats", "tag_part"]

BLOCK = 64  # calls per key block (one delete per block)
WINDOW = 512  # calls one window of agree_later holds at most
MAX_PENDING = 2 * WINDOW  # unverified calls agree_later allows per tag before the caller waits
# A window stays open this long after its first call for more calls to join it (unless it is
# full, or a waiting agreement drains it): a loop of slow calls (a 64 MiB batch takes
# milliseconds) then shares one agreement among several calls instead of paying one per call.
LINGER_S = 0.1
_SHIFT = 16  # counter layout: arrivals in the low 16 bits, flags above (the store holds int32)
_MAX_PROCESSES = (1 << _SHIFT) - 1
_OK, _CHECK = "ok", "check"
_LEFT = "\0left"  # the summary of a process that left a tag (it makes no call of its own)


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


Record = str | Callable[[], str]  # a record, or a function that makes it (only when shown)


def _text(record: Record) -> str:
    return record if isinstance(record, str) else record()


@dataclass
class _Call:
    seq: int
    flag: bool
    summary: str
    groups: dict[str, tuple[int, str]]
    record: Record
    arrived: float = 0.0  # monotonic time of the increment
    on_outcome: Callable[[Outcome], None] | None = None
    timeout: float = 0.0


@dataclass
class _Tag:
    """One sequence of agreements (a tag), in this process."""

    name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: int = 0  # the next agreement's number (a call of `agree`, a window of `agree_later`)
    last: str | None = None  # digest of the summary of the previous call, None: unknown
    last_summary: str | None = None  # that summary, when it had no groups (a shortcut)
    # agree_later's state (its thread's; guarded by ``cond``, which holds ``lock``):
    cond: threading.Condition | None = None
    queue: deque[_Call] = field(default_factory=deque)  # calls not yet in a window
    inflight: int = 0  # calls in the window being agreed
    draining: int = 0  # callers waiting in `drain`: the thread must not wait for more calls
    # The queue length the thread waits for (0: it does not wait for calls): a caller wakes it
    # only then, so a steady loop wakes no thread per call.
    wanted: int = 0
    linger: float = 0.0  # agree_later: how long a window stays open after its first call
    left: str | None = None  # this process left the tag (`leave`): its record
    left_posted: threading.Event = field(default_factory=threading.Event)
    epoch: int = 0  # `check`'s barrier names: moved on after a failed check
    on_outcome: Callable[[Outcome], None] | None = None  # the latest call's
    threads: list[threading.Thread] = field(default_factory=list)
    # The channel (`meshkit.channel`) of the thread whose calls it queues: a sync point drains
    # only its own channel's tags (another thread's calls keep coming while it waits).
    channel: str | None = None


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


def _changed(state: _Tag, summary: str, groups: Mapping[str, tuple[int, str]]) -> bool:
    """Whether the summary differs from this process's previous one; the caller holds the lock.

    A summary without groups that is the previous one (often the very same string: a layout seen
    before) is not hashed again.
    """
    if not groups and state.last is not None and summary is state.last_summary:
        return False
    digest = _digest(summary, groups)
    flag = digest != state.last
    state.last = digest
    state.last_summary = None if groups else summary
    return flag


def _deadline_ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


def _timed_out(error: BaseException) -> bool:
    return "DEADLINE_EXCEEDED" in str(error)


def _increment(client: Any, key: str, flag: bool, amount: int = 1) -> int:
    stats.rpcs += 1
    return int(client.key_value_increment(key, amount + (int(flag) << _SHIFT)))


_SLICE_S = 2.0  # meshkit's own threads wait in slices this long, to stop at exit
_stopping = threading.Event()  # set at exit: meshkit's threads leave their waits
_failed = threading.Event()  # a check verified beside the caller failed in this process


def _read(client: Any, key: str, deadline: float) -> str | None:
    """The value of ``key`` once written; None if it is not written before ``deadline``.

    Outside the main thread, waits in slices of `_SLICE_S`, and gives up (None) once the
    process exits (`_stopping`): a thread must not be inside a blocking call then.
    """
    main = threading.current_thread() is threading.main_thread()
    while main or not _stopping.is_set():
        stats.rpcs += 1
        end = deadline if main else min(deadline, time.monotonic() + _SLICE_S)
        try:
            return str(client.blocking_key_value_get(key, _deadline_ms(end)))
        except Exception as e:  # JAX raises its runtime error type for a deadline
            if not _timed_out(e):
                raise
        if main or time.monotonic() >= deadline:
            return None
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
        if len(records) >= arrived or time.monotonic() >= deadline or _stopping.is_set():
            break
        time.sleep(0.05)
    missing = tuple(p for p in range(n) if p not in records)
    posted = {p: json.loads(v) for p, v in records.items()}
    gave_up = tuple(sorted(p for p, v in posted.items() if v.get("gave_up")))
    return {p: v["record"] for p, v in posted.items()}, missing, gave_up


def _posted(
    summary: str, groups: Mapping[str, tuple[int, str]], record: str, **extra: Any
) -> dict[str, Any]:
    """A record as processes post it, and as a window lists its calls: compared, and shown."""
    return {"summary": summary, "groups": groups, "record": record, **extra}


def _write(
    client: Any, tag: str, seq: int, me: int, posted: dict[str, Any], overwrite: bool = False
) -> None:
    """Post this process's record of agreement ``seq`` (read by `_collect` and phase 2)."""
    stats.rpcs += 1
    key = f"{_key(tag, seq, 'r')}/{me}"
    client.key_value_set(key, json.dumps(posted), allow_overwrite=overwrite)


def _post(client: Any, tag: str, seq: int, me: int, call: _Call, gave_up: bool = False) -> None:
    extra = {"gave_up": True} if gave_up else {}
    _write(client, tag, seq, me, _posted(call.summary, call.groups, _text(call.record), **extra))


def _settle_call(client: Any, tag: str, call: _Call, me: int, n: int, total: int) -> Outcome:
    """Phases 1 (after the increment, whose result is ``total``), 2 and 3 of one call."""
    seq, deadline = call.seq, call.arrived + call.timeout
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
        return Outcome(True, {me: _text(call.record)}, (), (), seq)
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
        return Outcome(True, {me: _text(call.record)}, (), (), seq)
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


def _sync_point(timeout: float) -> tuple[Any, int, int]:
    """Before an agreement the caller waits for: its channel's deferred checks are raised first.

    Only the tags of the caller's channel: a window that waits for no more calls while another
    thread still makes them would be short in this process alone.
    """
    if _live:
        here = _channel.current()
        mine = [t for t in list(_live) if _tags[t].channel == here]
        if mine:
            drain(timeout + 35.0, tags=mine)  # each call waits at most its timeout + phase 3
    settle()
    return _client()


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
    client, me, n = _sync_point(timeout)
    if client is None or n == 1:
        return Outcome(True, {me: record})
    state = _state(tag)
    groups = dict(groups or {})
    with state.lock:
        if state.cond is not None:
            raise AssertionError(f"meshkit: tag {tag!r} is agreed beside the caller (agree_later)")
        seq = state.seq
        state.seq += 1
        flag = _changed(state, summary, groups)
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


def leave(tag: str, record: str, *, later: bool = False, wait: float | None = None) -> None:
    """Tell the processes at ``tag``'s next agreement that this one will not come, and why.

    Posts ``record`` and arrives, flagged, at both counters of the next call, so the others
    find the record (`Outcome.records`) instead of waiting for this process. ``later``: the tag
    is agreed beside the caller (`agree_later`); its thread arrives for the first call this
    process will not make, and this call waits until it has (at most ``wait`` seconds, default
    the check timeout; a record not posted by then leaves the others to their timeout).
    """
    client, me, n = _client()
    if client is None or n == 1:
        return
    if later:
        state = _windowed(tag)
        assert state.cond is not None
        with state.cond:
            state.left_posted.clear()
            state.left = record
            state.last = None
            state.cond.notify_all()
        state.left_posted.wait(_env.check_timeout() if wait is None else wait)
        return
    state = _state(tag)
    with state.lock:
        seq = state.seq
        state.seq += 1
        state.last = None
    call = _Call(seq, True, _LEFT, {}, record)
    _post(client, tag, seq, me, call)
    _arrive_flagged(client, tag, seq, "c", "d", n)
    _arrive_flagged(client, tag, seq, "c2", "d2", n)


def _arrive_flagged(client: Any, tag: str, seq: int, part: str, verdict_part: str, n: int) -> None:
    """Arrive at counter ``part`` with a flag; as the last arrival, write the verdict."""
    _conclude(client, tag, seq, verdict_part, _increment(client, _key(tag, seq, part), True), n)


# ---- check: one barrier per call when any difference is an error ------------------------------

PROBE_S = 0.2  # a check still waiting after this long compares records (then 2x, up to 5 s)
_PROBE_MAX_S = 5.0


def check(tag: str, summary: str, record: Record, *, timeout: float) -> Outcome:
    """`agree` for checks, where any difference between processes is an error: one round trip.

    Every process waits at the coordination service's barrier named by ``tag`` and the digest of
    its ``summary``, its n-th wait there meeting the n-th of the others: when every summary is
    equal, they all meet, and the barrier passing is the answer. When summaries differ, the
    processes wait at different barriers; each one still waiting after `PROBE_S` posts its
    record and reads the others' (`_Prober`), and on finding another digest arrives at that
    digest's barrier with a participant list of its own, which the service refuses to every
    process waiting there: all of them stop at once, and read every record to name who
    differs. A process that does not come is named when the barrier's timeout expires. A
    barrier so spoiled is not used again: every process moves to a new *epoch* of barrier
    names after a failed check.

    The summaries of a tag take any number of distinct values without cost (a loop that
    alternates functions alternates barriers); no key is written while processes agree.
    ``record`` may be a function that makes it: it is made only when shown (and an agreed
    `Outcome` then has no records).
    """
    client, me, n = _sync_point(timeout)
    if client is None or n == 1:
        return Outcome(True, {me: record if isinstance(record, str) else record()})
    state = _state(tag)
    digest = _digest(summary, {})
    with state.lock:
        seq = state.seq
        state.seq += 1
        state.last = digest
        epoch = state.epoch
    stats.agreements += 1
    _collect_garbage(client, tag, seq, me)
    deadline = time.monotonic() + timeout
    return _meet(state, client, seq, epoch, digest, summary, record, deadline, me, n)


def _meet(
    state: _Tag,
    client: Any,
    seq: int,
    epoch: int,
    digest: str,
    summary: str,
    record: Record,
    deadline: float,
    me: int,
    n: int,
) -> Outcome:
    """`check`'s protocol for agreement ``seq`` of ``state``'s tag, once numbered."""
    tag = state.name
    waiter = _Waiter(client, tag, seq, epoch, digest, summary, record, me)
    start = time.monotonic()
    _prober.add(waiter)
    timed_out = False
    try:
        stats.rpcs += 1
        client.wait_at_barrier(_barrier_id(tag, epoch, digest), _deadline_ms(deadline))
        return Outcome(True, {me: record} if isinstance(record, str) else {}, (), (), seq)
    except Exception as e:  # JAX's runtime error: a timeout, a refused (spoiled) barrier, ...
        timed_out = _timed_out(e)
    finally:
        _prober.remove(waiter)
    with state.lock:
        state.epoch = max(state.epoch, epoch + 1)
        state.last = None
    stats.slow += 1
    # A process that arrives after the others' timeout is refused at once: it did not give up.
    waited = time.monotonic() - start
    gave_up_here = timed_out and waited >= min(0.5, max(deadline - start, 0.0) / 2)
    waiter.post(gave_up=gave_up_here)
    if not timed_out:
        # Refused: another process found a difference. Those waiting at other barriers (which
        # this process's probes may not have seen yet) are refused now, by this one.
        with contextlib.suppress(Exception):
            waiter.probe()
    grace = 1.0 if timed_out else min(max(deadline - time.monotonic(), 1.0), 10.0)
    records, missing, gave_up = _collect(client, tag, seq, n, n, time.monotonic() + grace)
    if gave_up_here:  # missing: every process that was not waiting when the barrier expired
        missing, gave_up = tuple(p for p in range(n) if p not in gave_up), ()
    return Outcome(False, records, missing, gave_up, seq)


def leave_check(tag: str, record: str) -> None:
    """`leave` for a tag of `check`: post ``record`` and spoil the barrier the others wait at.

    The others, if they wait for this process at the barrier of the tag's last summary (a
    steady loop), are refused at once and find ``record``; never waits.
    """
    client, me, n = _client()
    if client is None or n == 1:
        return
    state = _state(tag)
    with state.lock:
        seq = state.seq
        state.seq += 1
        epoch, last = state.epoch, state.last
        state.epoch += 1
        state.last = None
    waiter = _Waiter(client, tag, seq, epoch, "", _LEFT, record, me)
    waiter.post()
    if last is not None:
        _spoil(client, _barrier_id(tag, epoch, last), me)


def _barrier_id(tag: str, epoch: int, digest: str) -> str:
    return f"meshkit/{tag}/b{epoch}/{digest}"


def _spoil(client: Any, barrier: str, me: int) -> None:
    """Arrive at ``barrier`` as its only participant: the service refuses it to its waiters."""
    stats.rpcs += 1
    with contextlib.suppress(Exception):  # refused (others wait there), or passed alone
        client.wait_at_barrier(barrier, 1, [me])


@dataclass(eq=False)
class _Waiter:
    """A `check` in progress: what its probes post and compare."""

    client: Any
    tag: str
    seq: int
    epoch: int
    digest: str
    summary: str
    make_record: Record
    me: int
    posted: bool = False
    spoiled: set[str] = field(default_factory=set)

    @functools.cached_property
    def record(self) -> str:
        return _text(self.make_record)

    def post(self, gave_up: bool = False) -> None:
        if self.posted and not gave_up:
            return
        extra = {"gave_up": True} if gave_up else {}
        posted = _posted(
            self.summary, {}, self.record, digest=self.digest, epoch=self.epoch, **extra
        )
        _write(self.client, self.tag, self.seq, self.me, posted, overwrite=self.posted)
        self.posted = True

    def probe(self) -> None:
        """Post this record, read the others'; spoil the barriers of other digests."""
        self.post()
        stats.rpcs += 1
        entries = self.client.key_value_dir_get(_key(self.tag, self.seq, "r") + "/")
        for _, value in entries:
            theirs = json.loads(value)
            digest = theirs.get("digest", "")
            if theirs.get("epoch") != self.epoch or digest in ("", self.digest):
                continue
            if digest not in self.spoiled:
                self.spoiled.add(digest)
                _spoil(self.client, _barrier_id(self.tag, self.epoch, digest), self.me)


class _Prober(threading.Thread):
    """Probes the checks that wait longer than `PROBE_S` (one thread for the process).

    While checks come, it looks every ``PROBE_S / 4``; `add` wakes it only from a long sleep
    (no check for a while), so a steady loop of checks wakes no thread per call.
    """

    def __init__(self) -> None:
        super().__init__(name="meshkit-check-probe", daemon=True)
        self.cond = threading.Condition()
        self.waiting: dict[_Waiter, tuple[float, float]] = {}  # -> (next probe, period)
        self.asleep = True  # in a long sleep: the next `add` wakes the thread
        self.last_add = 0.0

    def add(self, waiter: _Waiter) -> None:
        now = time.monotonic()
        with self.cond:
            self.waiting[waiter] = (now + PROBE_S, PROBE_S)
            self.last_add = now
            if self.asleep:
                self.asleep = False
                if not self.is_alive():
                    self.start()
                self.cond.notify()

    def remove(self, waiter: _Waiter) -> None:
        with self.cond:
            self.waiting.pop(waiter, None)

    def run(self) -> None:
        tick = PROBE_S / 4
        while not _stopping.is_set():
            with self.cond:
                now = time.monotonic()
                due = [w for w, (t, _) in self.waiting.items() if t <= now]
                for w in due:
                    period = min(self.waiting[w][1] * 2, _PROBE_MAX_S)
                    self.waiting[w] = (now + period, period)
                if not due:
                    if not self.waiting and now - self.last_add > 50 * tick:
                        self.asleep = True
                        self.cond.wait(_SLICE_S)
                    else:
                        self.cond.wait(tick)
                    continue
            for w in due:
                with contextlib.suppress(Exception):  # a probe that fails leaves the timeout
                    w.probe()


_prober = _Prober()


# ---- agree_later: the same protocol beside the caller, a window of calls at a time ----------


def agree_later(
    tag: str,
    summary: str,
    record: Record,
    *,
    timeout: float,
    on_outcome: Callable[[Outcome], None],
    groups: Mapping[str, tuple[int, str]] | None = None,
    linger: float = LINGER_S,
) -> None:
    """`agree`, verified beside the caller: returns at once.

    A tag is either agreed at once (`agree`) or beside the caller (`agree_later`), never both.
    Calls are verified in *windows*: meshkit's thread for the tag in process 0 lets a window
    fill for up to ``linger`` seconds after its first call (default `LINGER_S`; the tag's last
    call sets it) or until it holds `WINDOW` calls, then writes how many calls it holds; the
    other processes' threads read that and take as many of theirs. Each window is one
    agreement on the list of the window's summaries (`check`'s barrier; `agree`'s protocol when
    the calls have replica groups): two (three) round trips per process and window, however
    many calls it holds. A process that must go on before its window is full (a waiting
    agreement, a process leaving the tag) arrives with the calls it has, and the others find
    which call it did not make. ``record`` (or the function that makes it) is only made when
    shown.

    ``on_outcome`` runs in meshkit's thread for the first call of a window on which the
    processes did not agree; what it raises is printed at once and raised by this process's next
    meshkit call (`settle`). At most `MAX_PENDING` calls per tag are unverified; a further call
    waits. Calls after a disagreement in the same window are not reported (the first names it).
    """
    settle()
    client, _, n = _client()
    if client is None or n == 1:
        return
    state = _windowed(tag)
    groups = dict(groups or {})
    cond = state.cond
    assert cond is not None
    stats.agreements += 1
    with cond:
        while len(state.queue) + state.inflight >= MAX_PENDING and not failures:
            cond.wait(0.1)
        flag = _changed(state, summary, groups)
        state.queue.append(
            _Call(-1, flag, summary, groups, record, time.monotonic(), on_outcome, timeout)
        )
        state.on_outcome = on_outcome
        state.linger = linger
        if 0 < state.wanted <= len(state.queue):
            cond.notify_all()
    settle()


_live: set[str] = set()


def _windowed(tag: str) -> _Tag:
    """The state of a tag agreed beside the caller; its first use starts its thread."""
    state = _tags.get(tag)  # a plain read first: after the first call, no lock is needed
    if state is not None and state.cond is not None:
        return state
    state = _state(tag)
    with state.lock:
        if state.cond is None:
            state.channel = _channel.current()
            state.cond = threading.Condition(state.lock)
            thread = threading.Thread(
                target=_window_thread, args=(state,), name=f"meshkit-agree:{tag}", daemon=True
            )
            thread.start()
            state.threads.append(thread)
            _live.add(tag)
    return state


def _window_thread(state: _Tag) -> None:
    """Agree on each window of queued calls, in order, for as long as the process runs."""
    client, me, n = _client()
    cond = state.cond
    assert cond is not None
    tag = state.name
    while True:
        with cond:
            state.wanted = 1
            while not state.queue and state.left is None and not _stopping.is_set():
                cond.wait()
            if me == 0:
                _linger(state)
            state.wanted = 0
            if _stopping.is_set():
                return
            seq = state.seq
            state.seq += 1
            head = state.queue[0] if state.queue else None
            offer = min(len(state.queue), WINDOW)
        calls: list[_Call] = []
        left = None
        try:
            _collect_garbage(client, tag, seq, me)
            decided = _decide(client, tag, seq, me, offer, head)
            if _stopping.is_set():
                return  # the process exits
            calls, left = _take(state, decided)
            window = _window(seq, calls, left, decided, head)
            if window.groups:  # replica groups are compared per group: the counter protocol
                total = _increment(client, _key(tag, seq, "c"), window.flag)
                outcome = _settle_call(client, tag, window, me, n, total)
            else:  # one barrier per window, named by its summaries (as `check`)
                with state.lock:
                    epoch = state.epoch
                digest = _digest(window.summary, {})
                end = window.arrived + window.timeout
                outcome = _meet(
                    state, client, seq, epoch, digest, window.summary, window.record, end, me, n
                )
            if _stopping.is_set():
                return  # the process exits: its last window is not reported
            if not outcome.agreed:
                with state.lock:
                    state.last = None  # the next call compares again
                _report(state, calls, outcome, me)
        except Exception as e:  # a disagreement, or the coordination service failed
            # A caller draining the tag raises it in a moment: no notice needed.
            _fail(e, head.timeout if head is not None else None, quiet=state.draining > 0)
        with cond:
            state.inflight -= len(calls)
            if left is not None:
                state.left = None
                state.left_posted.set()
            cond.notify_all()


def _linger(state: _Tag) -> None:
    """Process 0, before it decides a window: let it fill (``state.cond`` held).

    Until it holds `WINDOW` calls, or the tag's linger has passed since its first call; at once when
    a caller drains, the process leaves the tag or exits.
    """
    cond = state.cond
    assert cond is not None
    state.wanted = WINDOW
    while (
        state.queue
        and len(state.queue) < WINDOW
        and state.left is None
        and not state.draining
        and not _stopping.is_set()
    ):
        left = state.queue[0].arrived + state.linger - time.monotonic()
        if left <= 0:
            break
        cond.wait(left)


def _decide(client: Any, tag: str, seq: int, me: int, offer: int, head: _Call | None) -> str | None:
    """How many calls window ``seq`` holds: process 0 says, the others read it.

    ``"left"``: process 0 left the tag. None: process 0 did not say within the timeout.
    """
    if me == 0:
        decided = str(offer) if offer else "left"
        stats.rpcs += 1
        client.key_value_set(_key(tag, seq, "w"), decided)
        return decided
    deadline = head.arrived + head.timeout if head is not None else time.monotonic() + 60.0
    return _read(client, _key(tag, seq, "w"), deadline)


def _take(state: _Tag, decided: str | None) -> tuple[list[_Call], str | None]:
    """This process's calls of the window (fewer when it must not wait), and its left record."""
    cond = state.cond
    assert cond is not None
    with cond:
        if decided is None or decided == "left":
            want = len(state.queue) if decided is None else min(1, len(state.queue))
        else:
            want = int(decided)
            # Wait for the caller to make the window's calls, unless it waits for us (a waiting
            # agreement drains) or left the tag: then the window is short, and flagged.
            state.wanted = want
            while (
                len(state.queue) < want
                and state.left is None
                and not state.draining
                and not _stopping.is_set()
            ):
                cond.wait(0.1)
            state.wanted = 0
        calls = [state.queue.popleft() for _ in range(min(want, len(state.queue)))]
        state.inflight += len(calls)
        left = state.left if len(calls) < max(want, 1) or not calls else None
        return calls, left


def _window(
    seq: int, calls: list[_Call], left: str | None, decided: str | None, head: _Call | None
) -> _Call:
    """One agreement for a window: the list of its calls' summaries, groups and records.

    The summary lists the calls' summaries run by run (``[[summary, count], ...]``: a steady
    loop's window is one run); the record, every call's, is made only when shown.
    """

    def record() -> str:
        entries = [_posted(c.summary, c.groups, _text(c.record)) for c in calls]
        if left is not None:
            entries.append(_posted(_LEFT, {}, left))
        return json.dumps(entries)

    runs: list[list[Any]] = []
    for c in calls:
        if runs and (runs[-1][0] is c.summary or runs[-1][0] == c.summary):
            runs[-1][1] += 1
        else:
            runs.append([c.summary, 1])
    if left is not None:
        runs.append([_LEFT, 1])
    wanted = len(calls) if decided in (None, "left") else int(decided)
    flag = any(c.flag for c in calls) or left is not None or len(calls) < wanted
    flag = flag or decided == "left"
    groups = {f"{i}/{name}": group for i, c in enumerate(calls) for name, group in c.groups.items()}
    summary = json.dumps(runs)
    started = head.arrived if head is not None else time.monotonic()
    timeout = head.timeout if head is not None else (calls[0].timeout if calls else 60.0)
    return _Call(seq, flag, summary, groups, record, started, None, timeout)


def _report(state: _Tag, calls: list[_Call], outcome: Outcome, me: int) -> None:
    """Name the window's first call on which the processes differ (``on_outcome`` raises)."""
    entries = {p: json.loads(r) for p, r in outcome.records.items()}
    width = max((len(v) for v in entries.values()), default=1)

    def at(i: int) -> tuple[dict[int, dict[str, Any]], set[int]]:
        here = {p: v[i] for p, v in entries.items() if i < len(v)}
        return here, set(outcome.missing) | {p for p, v in entries.items() if i >= len(v)}

    def differs(i: int) -> bool:
        here, absent = at(i)
        by_group: dict[str, set[str]] = {}
        for e in here.values():
            for name, (_, summary) in e["groups"].items():
                by_group.setdefault(name, set()).add(summary)
        return bool(
            absent
            or len({e["summary"] for e in here.values()}) > 1
            or any(len(s) > 1 for s in by_group.values())
            or any(e["summary"] == _LEFT for e in here.values())
        )

    first = next((i for i in range(width) if differs(i)), width - 1)
    here, absent = at(first)
    if me in here and here[me]["summary"] == _LEFT:
        return  # this process left the tag: it raised its own error
    on_outcome = calls[first].on_outcome if first < len(calls) else state.on_outcome
    assert on_outcome is not None
    records = {p: e["record"] for p, e in here.items()}
    on_outcome(Outcome(False, records, tuple(sorted(absent)), outcome.gave_up, outcome.seq))


def _fail(error: BaseException, grace: float | None = None, *, quiet: bool = False) -> None:
    """Keep ``error`` for `settle`, say so (unless ``quiet``), end the process if never raised.

    A process whose main thread does not come back to meshkit within the check timeout is
    likely blocked in a computation on the inputs that disagree (a collective that will not
    complete); it exits with status 1 so that the launcher ends the run instead of a hang.
    """
    failures.append(error)
    _failed.set()
    grace = _env.check_timeout() if grace is None else grace
    if not quiet:
        say(
            f"meshkit: a cross-process check failed; this process's next meshkit call raises it "
            f"(if none comes within {grace:g} s, the process exits):\n{type(error).__name__}: "
            f"{error}\n"
        )

    def exit_if_unraised() -> None:
        if any(e is error for e in failures):
            say(
                f"meshkit: exiting with status 1: the failed check above was not raised within "
                f"{grace:g} s ({_env.ENV_CHECK_TIMEOUT} sets the wait).\n"
            )
            os._exit(1)

    timer = threading.Timer(grace, exit_if_unraised)
    timer.daemon = True
    timer.start()


def settle() -> None:
    """Raise the first disagreement `agree_later` found since the last call, if any."""
    if failures:
        raise failures.popleft()


def drain(timeout: float, tags: Sequence[str] | None = None) -> bool:
    """Wait until every `agree_later` call of this process is verified (or ``timeout``).

    While it waits, the windows of this process do not wait for calls it has not made.
    ``tags``: only the calls of those tags.
    """
    deadline = time.monotonic() + timeout
    for name in list(_live) if tags is None else [t for t in tags if t in _live]:
        state = _tags[name]
        cond = state.cond
        assert cond is not None
        with cond:
            if not (state.queue or state.inflight):
                continue  # nothing to wait for (and no thread to wake)
            state.draining += 1
            cond.notify_all()
            try:
                while (state.queue or state.inflight) and not failures:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    cond.wait(min(left, 0.1))
            finally:
                state.draining -= 1
    return True


@atexit.register
def _drain_at_exit() -> None:
    """Verify what is pending (a few seconds at most), then let meshkit's threads leave.

    A thread still inside a blocking call of the coordination service when the interpreter
    ends aborts the process, so each one is told to stop and given a slice to return.
    """
    if _live and not _failed.is_set():  # after a failed check, the rest is not worth a wait
        drain(5.0)
    _stopping.set()
    with _prober.cond:
        _prober.cond.notify_all()
    for state in list(_tags.values()):
        if state.cond is not None:
            with state.cond:
                state.cond.notify_all()
    threads = [t for s in list(_tags.values()) for t in s.threads]
    threads += [_prober] if _prober.is_alive() else []
    end = time.monotonic() + _SLICE_S + 0.5
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
