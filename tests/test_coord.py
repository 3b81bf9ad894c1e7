"""The coordination protocols in one process, over the in-process fake of the service.

Each test runs several "processes" as threads of this one, each with its own `Node` over a
`FakeCluster`; the real multi-process runs are in test_multiprocess.py and its neighbours.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit._src.coord import agree, agreement, failures, missing, places
from meshkit._src.coord.node import Node, Outcome
from meshkit._src.coord.service import Barrier, Counted, JaxService, Stats
from meshkit._src.core.errors import DivergenceError
from meshkit._src.lifecycle.failfast import PeerPosts, Unanswered
from meshkit._src.lifecycle.preemption import PreemptionNotice
from meshkit.testing._fake_service import FakeCluster, ServiceGone


def _together(nodes: list[Node], body: Callable[[Node], Any], timeout: float = 30.0) -> list[Any]:
    """``body(node)`` in a thread per process; what each returned (or raised), by process."""
    results: list[Any] = [None] * len(nodes)

    def run(node: Node) -> None:
        try:
            results[node.me] = body(node)
        except BaseException as e:  # reported to the test as a value
            results[node.me] = e

    threads = [threading.Thread(target=run, args=(node,)) for node in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a process is still waiting"
    for node in nodes:
        node.stopping.set()
    return results


# ---- the service interface ----------------------------------------------------------------


class _Refusing:
    """A client of jax.distributed whose calls fail with one gRPC status code."""

    def __init__(self, code: int) -> None:
        self.code = code

    def _fail(self, *args: Any) -> Any:
        error = RuntimeError("the text does not matter")
        error.error_code = self.code  # type: ignore[attr-defined]
        raise error

    blocking_key_value_get = wait_at_barrier = key_value_dir_get = _fail


def test_outcomes_are_told_apart_by_the_status_code_not_the_text():
    assert JaxService(_Refusing(4)).get("k", 0.1) is None  # DEADLINE_EXCEEDED: a timeout
    assert JaxService(_Refusing(4)).barrier("b", 0.1) is Barrier.TIMED_OUT
    assert JaxService(_Refusing(3)).barrier("b", 0.1) is Barrier.REFUSED  # INVALID_ARGUMENT
    with pytest.raises(RuntimeError, match="does not matter"):
        JaxService(_Refusing(14)).get("k", 0.1)  # UNAVAILABLE: not an outcome, an error


def test_the_fake_barrier_refuses_differing_participants_and_times_out_for_everyone():
    cluster = FakeCluster(2)
    one, two = cluster.service(0), cluster.service(1)
    assert one.barrier("x", 0.05, [0]) is Barrier.PASSED  # alone, as the only participant
    assert one.barrier("y", 0.05) is Barrier.TIMED_OUT  # process 1 never came
    assert two.barrier("y", 5.0) is Barrier.TIMED_OUT  # it arrives late: told at once
    cluster.leave(1)
    with pytest.raises(ServiceGone):
        two.get("k", 0.1)


# ---- agreement: the one primitive ---------------------------------------------------------


def _at(node: Node, site: str, summary: str, record: str, timeout: float = 5.0, **kw: Any):
    """One agreement at ``site`` on the node's main sequence."""
    return agreement.agree(node, "main", site, summary, record, timeout=timeout, **kw)


def _agree(summaries: list[str], timeout: float = 5.0, **kw: Any) -> list[Outcome]:
    nodes = FakeCluster(len(summaries)).nodes()
    return _together(
        nodes, lambda node: _at(node, "t", summaries[node.me], f"record {node.me}", timeout, **kw)
    )


def test_agree_agrees_in_one_round_trip_when_every_process_agrees():
    nodes = FakeCluster(3).nodes()

    def body(node: Node) -> list[tuple[bool, int]]:
        seen = []
        for _ in range(agreement.SPAN + 3):
            before = node.stats.rpcs
            outcome = _at(node, "t", "same", f"r{node.me}")
            seen.append((outcome.agreed, node.stats.rpcs - before))
        return seen

    for p, seen in enumerate(_together(nodes, body)):
        assert all(agreed for agreed, _ in seen)
        # Steady (the summary the sequence predicts): one wait at the sequence's barrier; the
        # first calls (nothing to predict yet): one wait at the barrier their digest names.
        assert [cost for _, cost in seen] == [1] * len(seen), (p, seen)


def test_a_steady_pattern_of_several_sites_agrees_in_one_round_trip():
    # A loop that agrees at three sites in turn (a batch, a step, a metric) is steady too: the
    # sequence predicts the entry one period back.
    nodes = FakeCluster(2).nodes()
    pattern = [("batch", "float32[8]"), ("step", "jit(f)"), ("metric", "float32[]")]

    def body(node: Node) -> list[int]:
        costs = []
        for i in range(agreement.SPAN + 4 * len(pattern)):
            site, summary = pattern[i % len(pattern)]
            before = node.stats.rpcs
            assert _at(node, site, summary, "r").agreed
            costs.append(node.stats.rpcs - before)
        return costs

    for costs in _together(nodes, body):
        steady = agreement.SPAN + len(pattern)  # the pattern holds over SPAN agreements
        assert costs[steady:] == [1] * (len(costs) - steady), costs


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=12), st.integers(2, 40))
def test_the_prediction_of_a_periodic_history_is_its_entry_one_period_back(unit, length):
    history = [unit[i % len(unit)] for i in range(length)]
    predicted, period = agreement.predict(history)
    if predicted is not None:  # a period was read from the history: it holds, and predicts
        assert history[-period:] == history[-2 * period : -period]
        assert predicted == history[-period]
    if length >= 2 * max(len(unit), agreement.SPAN):
        assert predicted == unit[length % len(unit)]  # the history goes on as it repeats


def test_agree_on_a_mismatch_gives_every_record():
    outcomes = _agree(["a", "a", "b"])
    for outcome in outcomes:
        assert not outcome.agreed
        assert outcome.records == {0: "record 0", 1: "record 1", 2: "record 2"}
        assert outcome.missing == ()


def test_a_change_in_one_process_after_steady_calls_is_a_mismatch_at_once():
    nodes = FakeCluster(3).nodes()

    def body(node: Node) -> tuple[list[bool], float]:
        agreed = [_at(node, "t", "a", f"r{node.me}").agreed for _ in range(agreement.SPAN + 2)]
        start = time.monotonic()
        last = _at(node, "t", "b" if node.me == 2 else "a", f"last {node.me}", timeout=20.0)
        return [*agreed, last.agreed], time.monotonic() - start, last.records

    for agreed, waited, records in _together(nodes, body):
        assert agreed == [True] * (agreement.SPAN + 2) + [False]
        assert waited < 5.0  # decided when the last process arrived, not at the timeout
        assert records == {0: "last 0", 1: "last 1", 2: "last 2"}


def _steady_then(body_last: Callable[[Node], Any], n: int = 2) -> list[Any]:
    """Each process agrees steadily (until the barrier serves), then runs ``body_last``."""

    def body(node: Node) -> Any:
        for _ in range(agreement.SPAN + 2):
            assert _at(node, "t", "a", f"r{node.me}").agreed
        before = node.stats.rpcs
        assert _at(node, "t", "a", "r").agreed
        assert node.stats.rpcs - before == 1
        start = time.monotonic()
        return body_last(node), time.monotonic() - start

    return _together(FakeCluster(n).nodes(), body)


def test_a_change_after_steady_calls_breaks_the_barrier_so_nobody_waits_there():
    # The processes whose summary changed are flagged: they break the barrier the others wait
    # at, and meet at the one their digest names; the counted path decides when those differ,
    # after that barrier's wait at most, not at the timeout.
    results = _steady_then(lambda node: _at(node, "t", "b" if node.me else "a", "x", 20.0), 3)
    for outcome, waited in results:
        assert not outcome.agreed
        assert waited < agreement.FAST_S + 2.0


def test_a_change_every_process_makes_agrees_in_two_round_trips():
    # A new layout on every process in a steady loop (an evaluation step, a last short batch):
    # each breaks the predicted barrier and meets the others at the one its digest names.
    def changed(node: Node) -> tuple[bool, int]:
        before = node.stats.rpcs
        agreed = _at(node, "t", "b", "x").agreed
        return agreed, node.stats.rpcs - before

    for (agreed, cost), _ in _steady_then(changed, 3):
        assert (agreed, cost) == (True, 2)


def test_an_exchange_whose_records_differ_decides_without_waiting_at_a_barrier():
    # Uneven batches' rows (global_batches' last step with pad=True) are exchanged, not checked:
    # a new digest goes straight to the counted path. A check meets first at the barrier its
    # digest names, which the others (other digests) never reach: it waits that barrier out.
    for meet in (False, True):
        nodes = FakeCluster(3).nodes()

        def body(node: Node, meet: bool = meet) -> tuple[Outcome, float, int]:
            start, before = time.monotonic(), node.stats.rpcs
            outcome = _at(node, "t", f"rows {node.me}", f"r{node.me}", 20.0, meet=meet)
            return outcome, time.monotonic() - start, node.stats.rpcs - before

        for outcome, waited, cost in _together(nodes, body):
            assert not outcome.agreed
            assert outcome.records == {0: "r0", 1: "r1", 2: "r2"}
            if meet:
                assert waited >= agreement.FAST_S, waited
            else:
                assert waited < agreement.FAST_S / 2, waited
                assert cost <= 5, cost  # post, count, the records and the verdict, the records


def test_after_processes_differ_a_digest_they_met_at_is_named_anew():
    # Processes 1 and 2 meet at the barrier of "b" while process 0 does not come: the counted
    # path finds the difference. The next time all three agree on "b" they meet at once, at a
    # barrier no process used alone before (its uses are counted per process).
    nodes = FakeCluster(3).nodes()

    def body(node: Node) -> list[tuple[bool, int]]:
        seen = []
        for summary in ("b" if node.me else "a", "b", "b"):
            before = node.stats.rpcs
            seen.append((_at(node, "t", summary, "x", 20.0).agreed, node.stats.rpcs - before))
        return seen

    for seen in _together(nodes, body):
        assert [agreed for agreed, _ in seen] == [False, True, True], seen
        assert [cost for _, cost in seen[1:]] == [1, 1], seen


def test_a_leave_after_steady_calls_breaks_the_barrier_too():
    def last(node: Node) -> Outcome | None:
        if node.me == 1:
            agreement.leave(node, "main", "t", "closed")
            return None
        return _at(node, "t", "a", "r0", 20.0)

    (outcome, waited), _ = _steady_then(last)
    assert not outcome.agreed
    assert outcome.records[1] == "closed"
    assert waited < agreement.FAST_S


def test_a_process_later_than_the_barrier_wait_still_agrees():
    # The barrier times out for process 0; the counted path agrees once process 1 arrives.
    def last(node: Node) -> bool:
        if node.me == 1:
            time.sleep(agreement.FAST_S * 1.5)
        agreed = _at(node, "t", "a", "r", 20.0).agreed
        return agreed and _at(node, "t", "a", "r", 20.0).agreed  # and the next one too

    assert [agreed for agreed, _ in _steady_then(last)] == [True, True]


def test_agree_compares_replica_groups():
    groups = [{"g": (0, "x")}, {"g": (0, "y")}]
    nodes = FakeCluster(2).nodes()
    outcomes = _together(nodes, lambda node: _at(node, "t", "s", "r", groups=groups[node.me]))
    # Equal summaries, one replica group whose summaries differ: not agreed, everyone's record
    # given, nobody missing.
    for outcome in outcomes:
        assert not outcome.agreed
        assert outcome.records == {0: "r", 1: "r"}
        assert (outcome.missing, outcome.gave_up) == ((), ())
    # The same call with equal group summaries agrees: the groups made the difference.
    same = _together(
        FakeCluster(2).nodes(), lambda node: _at(node, "t", "s", "r", groups=groups[0])
    )
    assert [o.agreed for o in same] == [True, True]


def test_agree_names_the_process_that_did_not_come():
    cluster = FakeCluster(3)
    nodes = cluster.nodes()
    outcomes = _together(nodes[:2], lambda node: _at(node, "t", "s", f"r{node.me}", 0.3))
    for outcome in outcomes[:2]:
        assert not outcome.agreed
        assert outcome.missing == (2,)
        assert set(outcome.records) == {0, 1}


def test_agree_with_a_process_that_left_the_service_times_out_naming_it():
    cluster = FakeCluster(2)
    cluster.leave(1)
    outcome = _together(cluster.nodes()[:1], lambda node: _at(node, "c", "s", "r", 0.3))[0]
    assert outcome.missing == (1,)


def test_agree_finds_the_record_of_a_process_that_left():
    nodes = FakeCluster(2).nodes()

    def body(node: Node) -> Outcome | None:
        if node.me == 1:
            agreement.leave(node, "main", "t", "closed")
            return None
        return _at(node, "t", "s", "r0", 20.0)

    start = time.monotonic()
    outcome = _together(nodes, body)[0]
    assert time.monotonic() - start < 5.0  # at once, not after the timeout
    assert not outcome.agreed
    assert outcome.records[1] == "closed"
    assert outcome.missing == ()


def test_a_late_arrival_learns_who_stopped_waiting():
    cluster = FakeCluster(2)
    nodes = cluster.nodes()
    gave_up = threading.Event()

    def body(node: Node) -> Outcome:
        if node.me == 1:  # after process 0's timeout: a sleep alone is a race on a busy machine
            assert gave_up.wait(30.0), "process 0 did not return"
        outcome = _at(node, "t", "s", f"r{node.me}", 0.3)
        if node.me == 0:
            gave_up.set()
        return outcome

    early, late = _together(nodes, body)
    assert not early.agreed
    assert early.missing == (1,)
    assert not late.agreed
    assert late.gave_up == (0,)
    assert late.missing == ()


@settings(max_examples=15, deadline=None)
@given(
    summaries=st.lists(st.sampled_from(["a", "b"]), min_size=2, max_size=4),
    order=st.randoms(use_true_random=False),
    steady=st.integers(0, 3),
)
def test_random_arrival_orders_give_the_sequential_verdict(summaries, order, steady):
    cluster = FakeCluster(len(summaries))
    nodes = cluster.nodes()
    delays = [order.random() * 0.05 for _ in nodes]

    def body(node: Node) -> Outcome:
        for _ in range(steady):  # agreed calls before: some processes then arrive unflagged
            assert _at(node, "t", "a", "a").agreed
        time.sleep(delays[node.me])
        return _at(node, "t", summaries[node.me], summaries[node.me])

    outcomes = _together(nodes, body)
    agreed = len(set(summaries)) == 1  # the sequential reference: compare them all at once
    assert all(o.agreed == agreed for o in outcomes)
    if not agreed:
        assert all(o.records == dict(enumerate(summaries)) for o in outcomes)


# ---- the deferred form: agreements held back -----------------------------------------------


class _Differ(Exception):
    """What a pending call's ``on_outcome`` raises: its number, the outcome at it, and where."""

    def __init__(self, number: int, outcome: Outcome) -> None:
        super().__init__(number, outcome)
        self.number, self.outcome = number, outcome
        self.thread = threading.current_thread()
        self.at = -1  # the call that raised it (-1: a verification outside any call)


def _calls(node: Node, summaries: list[str], timeout: float = 5.0) -> _Differ | None:
    """Defer one call per summary, in this thread; what the call that raised, if any, raised."""
    for i, summary in enumerate(summaries):

        def on_outcome(outcome: Outcome, i: int = i) -> None:
            raise _Differ(i, outcome)

        try:
            _at(node, "w", summary, f"{node.me}:{i}", timeout, later=on_outcome)
        except _Differ as e:
            e.at = i
            return e
    return None


def _verified(node: Node) -> _Differ | None:
    try:
        agreement.verify(node, "main")
    except _Differ as e:
        return e
    return None


def test_equal_deferred_calls_agree_once_per_w_calls_and_at_the_drain():
    nodes = FakeCluster(2).nodes()

    def body(node: Node) -> tuple[Any, Any, int]:
        return _calls(node, ["a"] * (2 * agreement.W + 5)), _verified(node), node.stats.agreements

    assert _together(nodes, body) == [(None, None, 3)] * 2  # at calls W and 2 W, then the drain
    assert [node.sequences["main"].later for node in nodes] == [[], []]


def test_the_w_th_call_raises_in_the_callers_thread_naming_the_first_call_that_differs():
    nodes = FakeCluster(2).nodes()
    before = set(threading.enumerate())
    started: list[str] = []

    def body(node: Node) -> _Differ | None:
        summaries = ["a"] * agreement.W
        if node.me == 1:
            summaries[5:7] = ["b", "c"]
        raised = _calls(node, summaries)
        started.extend(t.name for t in set(threading.enumerate()) - before)
        return raised

    for e in _together(nodes, body):
        assert isinstance(e, _Differ), e
        assert e.at == agreement.W - 1  # every call returned but the W-th, which verified
        assert e.number == 5  # the first call that differs
        assert e.outcome.records == {0: "0:5", 1: "1:5"}
        assert e.thread.name.startswith("Thread-")  # the caller's (`_together`'s) own thread
    assert all(name.startswith("Thread-") for name in started), started  # no thread of ours


def test_the_next_agreement_of_the_sequence_verifies_the_held_calls_first():
    nodes = FakeCluster(2).nodes()

    def body(node: Node) -> tuple[Any, Any]:
        returned = _calls(node, ["a", "b" if node.me else "a", "a"])
        try:
            _at(node, "make_mesh", "s", "r")
        except _Differ as e:
            return returned, e.number
        return returned, None

    assert _together(nodes, body) == [(None, 1)] * 2  # every call returned; call #1 named


def test_a_deferred_check_names_the_process_that_did_not_come():
    nodes = FakeCluster(2).nodes()
    [(returned, e)] = _together(
        nodes[:1], lambda node: (_calls(node, ["a"], timeout=0.3), _verified(node))
    )
    assert returned is None
    assert isinstance(e, _Differ)
    assert e.outcome.missing == (1,)


def test_a_deferred_check_finds_the_record_of_a_process_that_left():
    nodes = FakeCluster(2).nodes()

    def body(node: Node) -> _Differ | None:
        if node.me == 1:  # it made the first call, then failed instead of the second
            _calls(node, ["a"])
            agreement.leave(node, "main", "w", json.dumps({"status": "closed"}))
            assert node.sequences["main"].later == []
            return None
        return _calls(node, ["a", "a"]) or _verified(node)

    e = _together(nodes, body)[0]
    assert isinstance(e, _Differ)
    assert e.number == 1
    assert json.loads(e.outcome.records[1]) == {"status": "closed"}


def test_a_process_that_leaves_after_the_calls_held_here_is_named_not_this_one():
    nodes = FakeCluster(2).nodes()

    def body(node: Node) -> _Differ | None:
        _calls(node, ["a"])
        if node.me == 1:  # it made the call too, then failed before another agreement
            agreement.leave(node, "main", "check", json.dumps({"status": "error"}))
            return None
        return _verified(node)

    e = _together(nodes, body)[0]
    assert isinstance(e, _Differ)
    assert (e.number, e.outcome.missing) == (0, ())
    assert json.loads(e.outcome.records[1]) == {"status": "error"}


def test_a_deferred_check_names_a_process_that_left_the_program():
    nodes = FakeCluster(2).nodes()
    ended = json.dumps({"left": True, "status": "exit"})

    def body(node: Node) -> _Differ | None:
        if node.me == 1:
            agreement.leave(node, "main", "exit", ended)
            return None
        return _calls(node, ["a"]) or _verified(node)

    e = _together(nodes, body)[0]
    assert isinstance(e, _Differ)
    assert e.number == 0
    assert e.outcome.records == {0: "0:0", 1: ended}


# ---- processes at different agreements of one sequence ------------------------------------


def _wait_at(node: Node, site: str, what: str, timeout: float = 30.0) -> Outcome:
    """An agreement at ``site`` on the node's main sequence."""
    return agreement.agree(node, "main", site, "s", "r", timeout=timeout, what=what)


def test_processes_at_different_agreements_are_named_at_once():
    nodes = FakeCluster(2).nodes()
    places = {0: ("programs", "the first run of step"), 1: ("batches", "step 3 of the batches")}

    def body(node: Node) -> Any:
        site, what = places[node.me]
        start = time.monotonic()
        try:
            _wait_at(node, site, what)
        except DivergenceError as e:
            return e, time.monotonic() - start
        return "agreed"

    source, first = inspect.getsourcelines(_wait_at)
    line = first + next(i for i, text in enumerate(source) if "agreement.agree(" in text)
    results = _together(nodes, body)
    for error, waited in results:
        assert waited < 5.0, results  # when the last arrived: the same key, not a timeout
        assert error.processes == [0, 1], error
        assert error.field == "order", error
        assert str(error).startswith(
            "meshkit: the processes wait at different agreements of their main thread, and none "
            f"can go on: process 0 at tests/test_coord.py:{line} in _wait_at (the "
            f"first run of step); process 1 at tests/test_coord.py:{line} in _wait_at "
            "(step 3 of the batches).\n"
        ), str(error)


def test_three_processes_two_of_which_wait_at_one_agreement():
    nodes = FakeCluster(3).nodes()

    def body(node: Node) -> Any:
        site, what = ("gather", "a gather") if node.me != 1 else ("mesh", "make_mesh")
        try:
            _wait_at(node, site, what)
        except DivergenceError as e:
            return str(e).splitlines()[0], e.processes
        return "agreed"

    for message, processes in _together(nodes, body, timeout=10.0):
        assert "process 1 at" in message, message
        assert "(make_mesh)" in message, message
        assert "processes 0,2 at" in message, message
        assert "in _wait_at (a gather)" in message, message
        assert processes == [0, 1, 2], message


@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from("abc"), min_size=2, max_size=5), st.integers(0, 3))
def test_random_orders_agree_or_name_the_difference_in_every_process(program, swap):
    """Against the sequences themselves: an error iff the processes' orders differ."""
    other = list(program)
    k = swap % (len(program) - 1)
    other[k], other[k + 1] = other[k + 1], other[k]  # process 1 swaps two neighbours
    nodes = FakeCluster(2).nodes()

    def body(node: Node) -> Any:
        try:
            for site in program if node.me == 0 else other:
                _wait_at(node, site, f"an agreement at {site}", timeout=20.0)
        except DivergenceError as e:
            return e.field, e.processes
        return "agreed"

    results = _together(nodes, body)
    if other == program:
        assert results == ["agreed", "agreed"]
    else:
        assert results == [("order", [0, 1])] * 2, (program, other, results)


def test_a_late_process_and_another_sequence_are_no_difference():
    """Agreements that pass once a slow process comes, or on another channel, raise nothing."""
    nodes = FakeCluster(2).nodes()

    def body(node: Node) -> Any:
        def loader() -> None:  # agrees at "y" on a sequence of its own
            time.sleep(1.5 if node.me == 0 else 0.0)
            agreement.agree(node, "c:loader", "y", "s", "r", timeout=30.0)

        helper = threading.Thread(target=loader)
        helper.start()
        if node.me == 1:
            time.sleep(1.0)  # late: process 0's main sequence waits at "x" meanwhile
        outcome = _wait_at(node, "x", "x")
        helper.join()
        return outcome.agreed

    assert _together(nodes, body) == [True, True]


# ---- failure posts and the "did not arrive" words ------------------------------------------


def test_failure_posts_are_seen_by_the_others_only():
    cluster = FakeCluster(3)
    failures.post(cluster.service(2), 2, "ValueError: boom")
    assert failures.poll(cluster.service(2), 2) == PeerPosts([], [])
    assert failures.poll(cluster.service(0), 0) == PeerPosts([(2, "ValueError: boom")], [])


def test_preemption_notices_travel_with_the_failures_in_one_listing():
    cluster = FakeCluster(3)
    late = PreemptionNotice(process=2, received=20.0, deadline=45.0, own=True)
    first = PreemptionNotice(process=1, received=10.0, deadline=35.0, own=True)
    failures.post_notice(cluster.service(2), late)
    failures.post_notice(cluster.service(1), first)
    failures.post(cluster.service(2), 2, "ValueError: boom")
    service = Counted(cluster.service(0), Stats())
    posted = failures.poll(service, 0)
    assert service.stats.rpcs == 1  # one directory listing for both
    # Taken as told by another process, the first notice first; never one's own.
    assert posted.notices == [
        dataclasses.replace(first, own=False),
        dataclasses.replace(late, own=False),
    ]
    assert posted.failures == [(2, "ValueError: boom")]
    assert failures.poll(cluster.service(1), 1).notices == [dataclasses.replace(late, own=False)]


def test_a_failure_poll_left_unanswered_says_by_the_status_code_whether_the_service_is_gone():
    cluster = FakeCluster(2)
    failures.post(cluster.service(1), 1, "ValueError: boom")
    assert failures.poll(cluster.service(0), 0) == PeerPosts([(1, "ValueError: boom")], [])
    cluster.leave(0)  # as the real client when its service is gone: UNAVAILABLE
    assert failures.poll(cluster.service(0), 0) == Unanswered(
        lost=True, error="process 0 has left the fake coordination service"
    )
    for code, lost in [(14, True), (10, True), (4, False), (5, False), (3, False)]:
        answered = failures.poll(JaxService(_Refusing(code)), 0)
        assert answered == Unanswered(lost=lost, error="the text does not matter"), code


def test_the_failure_watch_ends_the_process_only_for_a_service_that_is_gone(monkeypatch):
    from meshkit._src.lifecycle import failfast

    monkeypatch.setattr(failfast, "poll_period", lambda n: 0.01)

    def watch(answers: list[Any]) -> list[str]:
        ended: list[str] = []
        w = failfast._Watch(1, 2, poll=lambda: answers.pop(0) if answers else None)
        monkeypatch.setattr(w, "_lost", ended.append)
        while w.look(0.0):  # until the answers run out (None: not joined anymore)
            pass
        return ended

    slow = Unanswered(lost=False, error="DEADLINE_EXCEEDED")
    gone = Unanswered(lost=True, error="UNAVAILABLE: socket closed")
    none = PeerPosts([], [])
    assert watch([slow] * 5) == []
    assert watch([gone, none, gone, slow, gone]) == []  # never twice in a row
    assert watch([none, gone, gone]) == ["UNAVAILABLE: socket closed"]


def test_one_wording_for_processes_that_did_not_arrive():
    assert missing.did_not([3], timeout=8) == "process 3 did not arrive within 8 s"
    assert missing.did_not([2, 5], timeout=0.5, arrive="call gather") == (
        "processes 2,5 did not call gather within 0.5 s"
    )
    assert missing.stopped_waiting([0]) == "process 0 stopped waiting"


# ---- places: waits in a channel's order outside its agreements --------------------------------


def test_an_agreement_and_a_caller_inside_a_step_it_has_not_taken_are_a_cycle():
    # Process 1's caller stays inside step 3 of an iterator (it waits in that step's collective);
    # process 0 took 2 steps and waits at an agreement: each waits for the other. Process 0
    # raises at its first look, naming both places, and tells process 1, whose watch reads it.
    nodes = FakeCluster(2).nodes()

    def body(node: Node) -> Any:
        if node.me == 1:
            moving = places.Moving(node, "main", "steps:it", "step {step} of the batches")
            moving.took(3, inspect.currentframe())
            deadline = time.monotonic() + 20.0
            while time.monotonic() < deadline:  # the watch's periods
                told = moving.look()
                if told is not None:
                    return told
                time.sleep(0.1)
            return "not told"
        node.counts["steps:it"] = 2
        start = time.monotonic()
        try:
            _wait_at(node, "programs", "the first compilation")
        except DivergenceError as e:
            return e, time.monotonic() - start
        return "agreed"

    (error, waited), told = _together(nodes, body)
    assert waited < 10.0, waited  # at the first looks, not after the 30 s timeout
    assert (error.processes, error.field) == ([0, 1], "order")
    assert "process 0 at tests/test_coord.py:" in str(error), str(error)
    assert "(the first compilation); process 1 at tests/test_coord.py:" in str(error), str(error)
    assert "(step 3 of the batches)." in str(error), str(error)
    assert isinstance(told, DivergenceError), told
    assert str(told) == str(error)


def test_a_caller_inside_a_step_the_others_took_is_no_cycle():
    # The same, but process 0 has taken step 3 too: process 1 will come to the agreement.
    nodes = FakeCluster(2).nodes()
    mine = places.Place("main", "", 0, "an agreement", "here")
    node = nodes[0]
    node.counts["steps:it"] = 3
    moving = {1: places.Place("main", "steps:it", 2, "step 3", "there")}
    assert places.cycle(node, mine, moving) is None
    other_channel = {1: places.Place("c:loader", "steps:it", 5, "step 6", "there")}
    assert places.cycle(node, mine, other_channel) is None
    node.counts["steps:it"] = 2
    assert places.cycle(node, mine, moving) is not None
    for n in nodes:
        n.stopping.set()


def test_a_caller_that_came_to_the_agreement_from_inside_a_step_is_no_cycle():
    # Process 1 is inside step 3 and comes to the agreement (a first compilation inside the
    # step) late, with another program: it waits there while process 0 looks. Its watch posts
    # no place inside a step while it is at the agreement, so process 0 finds no cycle: both
    # learn that their records differ, as the program comparison needs.
    nodes = FakeCluster(2).nodes()

    def body(node: Node) -> Any:
        if node.me == 0:
            node.counts["steps:it"] = 2
            return _wait_at(node, "programs", "the first compilation")
        moving = places.Moving(node, "main", "steps:it", "step {step} of the batches")
        moving.took(3, inspect.currentframe())
        looked, stop = [], threading.Event()

        def watch() -> None:
            while not stop.wait(0.05):
                looked.append(moving.look())

        thread = threading.Thread(target=watch)
        thread.start()
        time.sleep(1.5)  # process 0 is past its barriers and looks while this one arrives
        try:
            return agreement.agree(node, "main", "programs", "another", "r", timeout=30.0)
        finally:
            stop.set()
            thread.join(5.0)
            assert looked, "the watch never looked"
            assert not any(looked), looked

    mine, theirs = _together(nodes, body)
    assert isinstance(mine, Outcome), mine
    assert isinstance(theirs, Outcome), theirs
    assert not mine.agreed
    assert not theirs.agreed
    assert sorted(mine.records) == [0, 1] == sorted(theirs.records)


# ---- a process that left the program ------------------------------------------------------


def test_a_leave_record_says_how_the_process_ends(monkeypatch):

    monkeypatch.delattr("sys.last_value", raising=False)
    assert json.loads(agree.leave_record(last="call #3")) == {
        "left": True, "status": "exit", "last": "call #3"}  # fmt: skip
    monkeypatch.setattr("sys.last_value", RuntimeError("planted\nsecond line"), raising=False)
    assert json.loads(agree.leave_record()) == {
        "left": True, "status": "error", "message": "RuntimeError: planted"}  # fmt: skip


def _left_at(monkeypatch, records: dict[int, str]) -> list[tuple[int, str]]:
    """`agree.agree` over a fake node whose agreement found ``records``; peers ended for."""
    from meshkit._src.lifecycle import failfast

    ended: list[tuple[int, str]] = []
    monkeypatch.setattr(agree, "node", lambda: FakeCluster(2).nodes()[0])
    monkeypatch.setattr(agree._agreement, "agree", lambda *a, **k: Outcome(False, records))
    monkeypatch.setattr(failfast, "peer_failed", lambda p, failure: ended.append((p, failure)))
    return ended


def test_a_process_that_failed_instead_of_coming_ends_this_one_as_its_failure_watch_would(
    monkeypatch,
):

    failed = json.dumps({"left": True, "status": "error", "message": "RuntimeError: planted"})
    ended = _left_at(monkeypatch, {0: '{"mesh": 1}', 1: failed})
    outcome = agree.agree("make_mesh", "s", "r", timeout=1.0)
    assert not outcome.agreed
    assert ended == [(1, "RuntimeError: planted")]


def test_check_names_a_process_that_left_instead_of_coming(monkeypatch):
    from meshkit import MeshkitError

    ended = _left_at(
        monkeypatch, {0: '{"mesh": 1}', 1: json.dumps({"left": True, "status": "exit"})}
    )
    with pytest.raises(MeshkitError) as info:
        agree.check("make_mesh", "s", "r", timeout=1.0, what="meshkit.make_mesh")
    assert str(info.value).splitlines()[0] == (
        "meshkit.make_mesh: process 1 left the program without making this call (process 1 ended)."
    )
    assert ended == []  # a normal end is no failure to end this process for


def test_a_process_that_ends_leaves_every_channel_it_agreed_on(monkeypatch):
    nodes = FakeCluster(2).nodes()
    sequences = ["main", agreement.channel_sequence(nodes[0], "loader")]
    agreed = _together(  # one call on each channel before process 1 ends
        nodes,
        lambda node: [agreement.agree(node, s, "t", "a", "a", timeout=5.0) for s in sequences],
    )
    assert all(o.agreed for outcomes in agreed for o in outcomes)
    monkeypatch.delattr("sys.last_value", raising=False)
    monkeypatch.setattr(agree, "_node", nodes[1])
    monkeypatch.setattr(agree, "leaving", {"last": "call #1 of f"})
    agree._at_exit()
    for sequence in sequences:  # process 0 reads why at once, on either channel
        outcome = agreement.agree(nodes[0], sequence, "t", "a", "a", timeout=30.0)
        assert json.loads(outcome.records[1]) == {
            "left": True, "status": "exit", "last": "call #1 of f"}  # fmt: skip
