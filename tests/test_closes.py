"""`meshkit.global_batches`' close notices (`meshkit._src.arrays.ends`), in one process.

Processes are `Node`s over the in-process fake of the coordination service; the real runs (a
process that goes on past another's close, closes after different steps) are in
test_global_multiprocess.py and test_threads.py. The watch, a task of the service thread, is
`GlobalBatches._watch`, run here on a stand-in for the iterator.
"""

from __future__ import annotations

import json
import threading
import time
import types
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshkit._src.arrays import batches, ends
from meshkit._src.coord import places
from meshkit._src.core.errors import DivergenceError, MeshkitError
from meshkit._src.lifecycle.failfast import poll_period
from meshkit.testing._fake_service import FakeCluster


def test_posts_are_read_by_every_process_and_name_the_steps():
    nodes = FakeCluster(3).nodes()
    assert ends.posted(nodes[2], "gb/0") == {}
    ends.leave(nodes[1], "gb/0", ends.CLOSED, 4)
    assert ends.posted(nodes[2], "gb/0") == {1: 4}
    ends.leave(nodes[0], "gb/0", ends.CLOSED, 4)
    ends.leave(nodes[2], "gb/0", ends.TOOK, 5)  # not a close: the watch does not hear it
    assert ends.posted(nodes[2], "gb/0") == {0: 4, 1: 4}
    assert ends.posted(nodes[2], "gb/1") == {}  # another iterator
    assert ends.left_error({0: (ends.CLOSED, 4), 1: (ends.CLOSED, 4)}, 2, 0, 10) is None


def test_a_close_waits_until_every_process_says_how_it_left():
    nodes = FakeCluster(3).nodes()
    ends.leave(nodes[0], "gb/0", ends.CLOSED, 4)
    threading.Timer(0.3, ends.leave, (nodes[1], "gb/0", ends.CLOSED, 4)).start()
    threading.Timer(0.5, ends.leave, (nodes[2], "gb/0", ends.ENDED, 4)).start()
    start = time.monotonic()
    said = ends.confirm(nodes[0], "gb/0", timeout=10)
    assert 0.4 < time.monotonic() - start < 5
    assert said == {0: ("closed", 4), 1: ("closed", 4), 2: ("ended", 4)}
    assert ends.left_error(said, 3, 0, 10) is None  # every process left after step 4


def test_a_close_names_the_processes_that_went_on_or_did_not_say():
    said = {0: ("closed", 3), 1: ("took", 4), 2: ("asks", 3), 3: ("closed", 3)}
    error = ends.left_error(said, 4, 0, 10)
    assert isinstance(error, DivergenceError)
    assert str(error).splitlines()[0] == (
        "meshkit.global_batches: the processes left their loops at different steps: this "
        "process (process 0) closed its iterator after step 3, but process 1 took step 4, "
        "process 2 asks for step 4."
    )
    assert (error.processes, error.field) == ([1, 2], "steps")
    assert str(error).splitlines()[1].startswith("Every process must take the same number")
    assert str(error).splitlines()[2].startswith("Consider deciding when to stop")
    late = ends.left_error({0: ("closed", 3), 2: ("closed", 3)}, 3, 0, 10)
    assert isinstance(late, MeshkitError)
    assert not isinstance(late, DivergenceError)  # a slow process is not a divergent one
    assert str(late).splitlines()[0] == (
        "meshkit.global_batches: this process (process 0) closed its iterator after step 3, "
        "and process 1 did not leave the loop within 10 s (no close, no end of data, no "
        "further step asked for)."
    )
    assert "MESHKIT_CHECK_TIMEOUT sets the wait" in str(late)


def test_closing_after_different_steps_names_the_others():
    error = ends.left_error({p: (ends.CLOSED, k) for p, k in {0: 2, 1: 3, 2: 2}.items()}, 3, 0, 10)
    assert error is not None
    assert str(error).splitlines()[0] == (
        "meshkit.global_batches: the processes left their loops at different steps: process 1 "
        "after step 3, this process (process 0) after step 2."
    )
    assert (error.processes, error.field) == ([1], "steps")


def test_going_on_names_the_processes_that_closed_before():
    asks = ends.went_on({0: 2, 2: 5}, 1, 2, took=False)
    assert str(asks).splitlines()[0] == (
        "meshkit.global_batches: the processes left their loops at different steps: process 0 "
        "after step 2 closed its iterator, but this process (process 1) asks for step 3, which "
        "process 0 will not take."
    )
    took = ends.went_on({0: 2, 2: 2}, 1, 3, took=True)
    assert str(took).splitlines()[0] == (
        "meshkit.global_batches: the processes left their loops at different steps: processes "
        "0,2 after step 2 closed their iterators, but this process (process 1) took step 3 "
        "already: its computations at that step wait for processes 0,2, which will not join "
        "them."
    )
    assert took.processes == [0, 2]


@given(
    st.dictionaries(st.integers(0, 7), st.integers(0, 20), min_size=1, max_size=8),
    st.integers(0, 20),
    st.booleans(),
)
def test_the_processes_named_are_those_past_whose_last_step_this_one_goes(closers, steps, took):
    # Reference: a closer is named when this process goes beyond its last step, by the step
    # taken (took) or by the one asked for.
    beyond = sorted(p for p, k in closers.items() if (steps if took else steps + 1) > k)
    error = ends.went_on(closers, 99, steps, took=took)
    assert (error is None) == (not beyond)
    assert error is None or error.processes == beyond
    said = {p: (ends.CLOSED, k) for p, k in {**closers, 99: steps}.items()}
    mine = ends.left_error(said, 0, 99, 10)  # n=0: no process is missing
    others = sorted(p for p, k in closers.items() if k != steps)
    assert (mine is None) == (not others)
    assert mine is None or mine.processes == others


class _Service:
    """Stands in for the service thread: runs the looks the watch schedules, one at a time."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.due: list[tuple[float, Callable[[], None]]] = []
        monkeypatch.setattr(
            batches._exit, "at", lambda _, delay, call, **__: self.due.append((delay, call))
        )

    def look(self) -> None:
        delay, call = self.due.pop(0)
        assert delay == poll_period(2)  # one look per poll period
        call()


class _Loop:
    """The parts of a `GlobalBatches` its watch (`GlobalBatches._watch`) reads, on a fake node.

    ``look``: the look at the caller (`places.Moving.look`), which returns a cycle it is in.
    """

    def __init__(self, node, look=lambda: None) -> None:
        self._moving = types.SimpleNamespace(node=node, look=look)
        self._tag, self._n, self._gone = "gb/0", 2, None
        self._done, self._lock = threading.Event(), threading.Lock()
        self.heard: list[dict[int, int]] = []
        self.failed: list[DivergenceError] = []
        self._hear, self._fail = self.heard.append, self.failed.append
        self._watch = lambda: batches.GlobalBatches._watch(self)  # type: ignore[arg-type]


def test_the_watch_hears_a_close_and_stops_by_itself(monkeypatch):
    service = _Service(monkeypatch)
    nodes = FakeCluster(2).nodes()
    loop = _Loop(nodes[1])
    loop._watch()
    service.look()
    assert loop.heard == []
    ends.leave(nodes[0], "gb/0", ends.CLOSED, 7)
    service.look()  # the first look after the close hears it
    assert loop.heard == [{0: 7}]
    assert service.due == []  # and the watch ends


def test_a_notice_posted_before_a_close_is_read_after_it(monkeypatch):
    # A process finds a cycle, tells this one (a notice), raises, and its iterator closes: a
    # watch that looked at the caller just before the notice and read the close just after it
    # reads the notice then, whatever the caller waits in, so that the notice, not the close,
    # is the cause it acts on.
    service = _Service(monkeypatch)
    nodes = FakeCluster(2).nodes()
    notice = json.dumps({"message": "meshkit: a cycle", "processes": [0, 1]})

    def look() -> None:  # the notice and the close right after this look
        nodes[0].service.set(places.NOTICE + "1", notice)
        ends.leave(nodes[0], "gb/0", ends.CLOSED, 2)

    loop = _Loop(nodes[1], look)
    loop._watch()
    assert [str(e) for e in loop.failed] == ["meshkit: a cycle"]
    assert (loop.heard, loop._gone, service.due) == ([], loop.failed[0], [])
    # Without a notice the close is what the watch hears.
    nodes = FakeCluster(2).nodes()
    ends.leave(nodes[0], "gb/0", ends.CLOSED, 2)
    loop = _Loop(nodes[1])
    loop._watch()
    assert (loop.heard, loop.failed) == ([{0: 2}], [])


def test_the_watch_ends_at_a_cycle_at_the_loops_end_or_when_the_service_is_gone(monkeypatch):
    service = _Service(monkeypatch)
    cluster = FakeCluster(2)
    nodes = cluster.nodes()
    cycle = DivergenceError("meshkit: a cycle", processes=[0, 1], field="order")
    loop = _Loop(nodes[1], lambda: cycle)  # the caller's place is in a cycle
    loop._watch()
    assert (loop.failed, loop._gone, service.due) == ([cycle], cycle, [])
    loop = _Loop(nodes[1])
    loop._watch()
    loop._done.set()
    service.look()
    assert service.due == []
    loop = _Loop(nodes[1])
    loop._tag = "gb/1"
    loop._watch()
    cluster.leave(1)  # its calls fail, as when the service is gone
    service.look()
    assert (service.due, loop.heard, loop.failed) == ([], [], [])
