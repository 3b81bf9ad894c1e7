"""Step times and stragglers in one process (`meshkit._src.lifecycle.stragglers`): the rule that
names a straggler, against a numpy reference; the windows; the launcher's table. The runs of
several processes (a slow loader named, a healthy loop not) are in test_stall_multiprocess.py.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshkit
from meshkit._src.core import events
from meshkit._src.core.events import StepRow
from meshkit._src.launch.report import Told, straggler_summary
from meshkit._src.lifecycle import progress as _progress
from meshkit._src.lifecycle import stragglers as _stragglers
from meshkit._src.lifecycle.progress import ServiceBoard
from meshkit._src.lifecycle.stragglers import FLOOR_MS, MARGIN


def _row(p, loader, host, step=None, data=None, steps=100):
    """A row whose loader kept its main thread waiting (data) unless told otherwise."""
    step = step if step is not None else max(loader, host) + 5.0
    data = loader / 2 if data is None else data
    return StepRow(p, steps, step, data, loader, host, step - data - host)


def test_a_rank_whose_loader_is_60_ms_slower_is_named_with_its_part():
    rows = [_row(p, 5.0, 3.0, step=70.0) for p in range(8) if p != 5]
    rows.append(_row(5, 65.0, 3.0, step=70.0))
    (found,) = _stragglers.stragglers(rows)
    assert (found.process, found.part, round(found.extra_ms)) == (5, "in its data loader", 60)
    assert found.ratio == pytest.approx(68.0 / 8.0)  # its host work and loader over the median
    assert str(found) == "process 5: 8.5x the median step's own work, +60 ms in its data loader"


def test_a_rank_with_more_host_work_is_named_for_it():
    rows = [_row(0, 1.0, 20.0, step=50.0), _row(1, 1.0, 20.0, step=50.0)]
    rows.append(_row(2, 1.0, 45.0, step=50.0))
    (found,) = _stragglers.stragglers(rows)
    assert (found.process, found.part) == (2, "of host work")


def test_equal_ranks_and_a_slow_loader_hidden_by_prefetching_name_nobody():
    assert _stragglers.stragglers([_row(p, 10.0, 3.0) for p in range(4)]) == []
    # Process 3's loader takes 30 ms where the others take 5, but a step takes 100 ms (the
    # devices): its batches are ready in time (its main thread does not wait), nobody waits.
    rows = [_row(p, 5.0, 3.0, step=100.0, data=0.1) for p in range(3)]
    rows.append(_row(3, 30.0, 3.0, step=100.0, data=0.1))
    assert _stragglers.stragglers(rows) == []
    assert _stragglers.stragglers([_row(0, 90.0, 3.0)]) == []  # alone: no median to compare


_rows = st.lists(
    st.tuples(st.floats(0, 200), st.floats(0, 50), st.floats(0, 8)), min_size=2, max_size=40
)


@given(_rows)
def test_the_rule_names_exactly_the_processes_a_numpy_reference_names(raw):
    rows = [_row(p, loader, host, data=data) for p, (loader, host, data) in enumerate(raw)]
    own = np.array([r.host_ms + (r.loader_ms if r.data_ms >= FLOOR_MS else 0) for r in rows])
    median = np.median(own)
    expected = {p for p, o in enumerate(own) if o >= MARGIN * median and o - median >= FLOOR_MS}
    found = _stragglers.stragglers(rows)
    assert {s.process for s in found} == expected
    assert [s.ratio for s in found] == sorted((s.ratio for s in found), reverse=True)


def test_a_window_is_the_per_step_means_of_what_changed():
    before = (10, 1.0, 0.2, 30, 0.5, 3.0)  # steps, wall, data, loads, loader, main-thread CPU
    now = (20, 2.0, 0.3, 42, 1.1, 3.2)  # 12 batches loaded (ahead) for 10 steps
    row = _stragglers._row(4, 20, before, now)
    assert row == StepRow(4, 20, 100.0, 10.0, 50.0, 20.0, 70.0)
    busy = _stragglers._row(4, 20, before, (20, 2.0, 0.3, 42, 1.1, 9.0))  # CPU beyond the step
    assert busy.host_ms == 90.0  # at most the step's time not spent waiting for the batch
    assert busy.wait_ms == 0.0


def test_steps_and_loads_add_up(monkeypatch):
    totals = _progress.Steps()
    monkeypatch.setattr(_progress, "steps", totals)
    _progress.step(1, 1.0, 1.5)  # the first batch: no step before it to time
    _progress.loaded(0.25)
    _progress.step(2, 2.0, 2.25)
    assert totals.now() == (2, 0.75, 0.75, 1, 0.25)
    assert (totals.number, totals.marks) == (2, 2)  # the step every guard reads


class _Board:
    def __init__(self):
        self.posted: dict[str, str] = {}
        self.reads = 0

    def board(self):
        def read():
            self.reads += 1
            return dict(self.posted)

        return ServiceBoard(post=self.posted.__setitem__, read=read, drop=self.posted.pop)


def test_process_0_names_a_straggler_after_two_windows_once(monkeypatch):
    said = []
    monkeypatch.setattr(_stragglers, "say", lambda log, level, text: said.append(text))
    monkeypatch.setattr(_stragglers._exit, "at", lambda *a, **k: True)
    totals = _progress.Steps()
    monkeypatch.setattr(_progress, "steps", totals)
    fake = _Board()
    windows = _stragglers._Windows(0, fake.board(), 30.0)
    windows.clock = lambda: None  # no CPU clock: host work 0
    slow = json.dumps(_row(1, 70.0, 0.0, step=75.0, data=30.0).__dict__)
    for k in range(4):
        fake.posted["1"] = slow
        totals.taken, totals.wall = 10 * (k + 1), 0.75 * (k + 1)
        totals.data, totals.loads, totals.loader = 0.3 * (k + 1), 10 * (k + 1), 0.05 * (k + 1)
        windows.turn()
    assert len(said) == 1, said  # named at the second window, not again
    assert said[0].startswith("meshkit: slower than the other processes, two windows in a row: ")
    # The median of 5 ms (process 0) and 70 ms (process 1): 37.5 ms.
    assert "process 1: 1.9x the median step's own work, +32 ms in its data loader" in said[0]
    assert json.loads(fake.posted["0"])["loader_ms"] == 5.0
    assert fake.reads == 4  # one listing per window, by process 0 only
    # This process ends (`exit.stop`): no window is posted or due after it.
    monkeypatch.setattr(_stragglers._exit, "stopping", threading.Event())
    _stragglers._exit.stopping.set()
    monkeypatch.setattr(_stragglers._exit, "at", lambda *a, **k: pytest.fail("a window after stop"))
    totals.taken += 10
    windows.turn()
    assert fake.reads == 4


def test_a_window_without_steps_posts_nothing(monkeypatch):
    monkeypatch.setattr(_stragglers._exit, "at", lambda *a, **k: True)
    monkeypatch.setattr(_progress, "steps", _progress.Steps())
    fake = _Board()
    windows = _stragglers._Windows(3, fake.board(), 30.0)
    windows.turn()
    windows.turn()
    assert fake.posted == {}
    assert fake.reads == 0
    assert windows.latest is None


def test_step_times_without_init_is_empty(monkeypatch):
    monkeypatch.setattr(_stragglers, "_windows", None)
    assert meshkit.step_times() == []


def test_the_launcher_ranks_the_runs_rows_and_repeats_what_process_0_said():
    def steps(rank, **fields):
        return events.Event(rank, events.STEPS, 0.0, {"process": rank, **fields})

    told = Told.of(
        [
            steps(0, steps=80, step_ms=65.0, data_ms=50.0, loader_ms=7.0, host_ms=3.0, wait_ms=12.0),
            steps(1, steps=40, step_ms=64.0, data_ms=27.0, loader_ms=62.0, host_ms=3.0, wait_ms=34.0),
            steps(1, steps=80, step_ms=64.0, data_ms=27.0, loader_ms=62.0, host_ms=4.0, wait_ms=33.0),
            events.Event(0, events.STRAGGLER, 0.0, {"processes": [1], "said": ["process 1: x"]}),
        ]
    )  # fmt: skip
    assert [(r.process, r.steps) for r in told.steps] == [
        (1, 80),
        (0, 80),
    ]  # the last, slowest first
    summary = straggler_summary(told)
    head, title, first, second = summary.splitlines()
    assert head == "Slower than the others, as process 0 said during the run: rank 1: x."
    assert title == "Step times per rank over the run, the slowest own work first:"
    assert first.startswith("  rank 1: 80 steps, 64.0 ms per step: 62.0 in the loader, 4.0 host")
    assert second.startswith("  rank 0: 80 steps, 65.0 ms per step: 7.0 in the loader")
    assert straggler_summary(Told.of([])) == ""
