"""Goodput: where a run's wall time went (joining, compiling, steps, checkpoints, restarts,
steps redone), per attempt in the launcher's report and `meshkit.LaunchResult`, and so far in a
process (`meshkit.RuntimeInfo.goodput`).

The arithmetic on hand-made events first; then one real run under the launcher: 2 processes,
process 1 fails after step 5 of 8, the group restarts from the checkpoint of step 4.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import require
from hypothesis import given
from hypothesis import strategies as st
from ranks.preloads import ECOSYSTEM

import meshkit
from meshkit._src.core import events as _events
from meshkit._src.launch import goodput as _goodput
from meshkit._src.launch.report import LaunchResult
from meshkit._src.launch.restarts import attempt_of, closing, extended
from meshkit._src.lifecycle import progress, stragglers
from meshkit.testing._forks import starter

PROGRAM = Path(__file__).parent / "ranks" / "goodput.py"
PARTS = ("joining", "compiling", "steps", "saving", "restoring", "restarts", "redone")


def _event(rank: int, kind: str, time: float = 0.0, **fields: object) -> _events.Event:
    return _events.Event(rank, kind, time, dict(fields))


def _attempt(number, code, records, *, started_at, elapsed, stopped_s=None, ranks=(0, 1)):
    result = LaunchResult(code, [], 1 if code else None, False, [], elapsed, "x" if code else "")
    return attempt_of(number, result, records, ranks=list(ranks), started_at=started_at,
                      stopped_s=stopped_s, restartable=bool(code))  # fmt: skip


def _steps(rank, time, steps, step_ms, aside=0.0):
    return _event(rank, _events.STEPS, time, process=rank, steps=steps, step_ms=step_ms,
                  data_ms=0.0, loader_ms=0.0, host_ms=0.0, wait_ms=0.0, aside=aside)  # fmt: skip


# ---- the arithmetic ---------------------------------------------------------------------------


def test_parts_that_add_up_to_more_than_the_wall_give_way_steps_first():
    g = _events.Goodput.of(10.0, joining=2.0, compiling=3.0, steps=8.0, saving=-1.0)
    assert (g.joining, g.compiling, g.steps, g.saving) == (2.0, 3.0, 5.0, 0.0)
    assert g.other == 0.0  # never negative
    g = _events.Goodput.of(4.0, joining=3.0, compiling=3.0, steps=1.0)
    assert (g.joining, g.compiling, g.steps) == (3.0, 1.0, 0.0)
    g = _events.Goodput.of(10.0, joining=1.0, steps=6.0)
    assert (g.other, g.ratio) == (3.0, 0.6)
    assert _events.Goodput(0.0).ratio == 0.0
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepz'"):
        _events.Goodput.of(1.0, stepz=1.0)


@given(
    st.floats(0, 1e6),
    st.lists(st.floats(-10.0, 1e6), min_size=len(PARTS), max_size=len(PARTS)),
)
def test_the_parts_never_exceed_the_wall_and_with_other_make_it(wall, values):
    g = _events.Goodput.of(wall, **dict(zip(PARTS, values, strict=True)))
    parts = [getattr(g, p) for p in PARTS]
    assert all(p >= 0 for p in parts)
    assert sum(parts) <= wall * (1 + 1e-12) + 1e-9
    assert sum(parts) + g.other == pytest.approx(wall, rel=1e-9, abs=1e-9)
    assert 0.0 <= g.ratio <= 1.0 + 1e-12
    assert all(getattr(g, p) <= max(v, 0.0) for p, v in zip(PARTS, values, strict=True))


def test_an_attempt_is_split_from_its_ranks_records():
    records = [
        _event(0, _events.JOINED, 101.0),
        _event(1, _events.JOINED, 102.0),
        _event(0, _events.COMPILED, 103.0, seconds=0.5, programs=2, hits=0),
        _event(1, _events.COMPILED, 103.0, seconds=1.0, programs=2, hits=0, tracing=0.5),  # slowest
        _event(0, _events.SAVED, 104.0, step=3, seconds=0.25),
        _event(0, _events.SAVED, 105.0, step=6, seconds=0.5),
        _event(1, _events.SAVED, 105.0, step=6, seconds=1.25, compiling=0.25),  # the slowest
        _steps(0, 106.0, 7, 500.0, aside=1.0),  # 3.5 s of steps, of which 1 s compiles and saves
        _steps(1, 106.0, 6, 600.0),
    ]
    a = _attempt(0, 1, records, started_at=100.0, elapsed=8.0, stopped_s=0.5)
    assert (a.joined_s, a.steps, a.started_at) == (2.0, 7, 100.0)
    assert a.goodput == _events.Goodput(8.0, joining=2.0, compiling=1.5, steps=2.5, saving=1.0,
                                        restarts=0.5)  # fmt: skip
    assert a.goodput.other == pytest.approx(0.5)


def test_a_restart_counts_the_gap_and_the_steps_past_the_restored_checkpoint_as_lost():
    first = [_event(r, _events.JOINED, 101.0) for r in (0, 1)]
    first += [_steps(r, 109.0, 8, 250.0) for r in (0, 1)]  # 8 steps of 0.25 s: 2 s
    a0 = _attempt(0, 1, first, started_at=100.0, elapsed=10.0, stopped_s=1.0)
    second = [_event(r, _events.JOINED, 114.0) for r in (0, 1)]
    second += [_event(r, _events.RESTORED, 115.0, step=6, seconds=0.75) for r in (0, 1)]
    second += [_steps(r, 117.0, 6, 250.0) for r in (0, 1)]
    a1 = _attempt(1, 0, second, started_at=112.0, elapsed=6.0)
    settled, last = extended([a0], [a1])
    assert last == a1  # the last attempt: nothing known after it
    g = settled.goodput
    assert g.wall == 12.0  # until the next attempt started: 2 s of the launcher between them
    assert g.restarts == 3.0  # 1 s stopping, 2 s until the next start
    assert (g.redone, g.steps) == (0.5, 1.5)  # steps 7 and 8 of 8 taken again
    assert last.goodput.restoring == 0.75
    assert (last.goodput.redone, last.goodput.restarts) == (0.0, 0.0)
    total = LaunchResult(0, [], None, False, [], 6.0, "", attempts=[settled, last]).goodput
    assert total.wall == 18.0  # from the first start to the last end
    assert total.steps == 1.5 + 1.5
    assert total.ratio == pytest.approx(3.0 / 18.0)
    # A next attempt that neither restored nor stepped says nothing of what was kept.
    never = _attempt(1, 1, [], started_at=112.0, elapsed=3.0, stopped_s=0.5)
    assert extended([a0], [never])[0].goodput.redone == 0.0
    # One that started again from nothing redoes every step.
    fresh = _attempt(1, 0, second[:2] + second[4:], started_at=112.0, elapsed=6.0)
    assert extended([a0], [fresh])[0].goodput.redone == 2.0


def test_an_attempt_that_never_joined_spent_its_time_joining():
    a = _attempt(0, 1, [_event(0, _events.JOINED, 101.0)], started_at=100.0, elapsed=30.0,
                 stopped_s=2.0)  # fmt: skip
    assert a.joined_s is None
    assert (a.goodput.joining, a.goodput.restarts, a.goodput.other) == (28.0, 2.0, 0.0)


def test_the_report_ends_with_the_table_only_when_ranks_took_steps():
    quiet = _attempt(0, 0, [_event(0, _events.JOINED, 101.0)], started_at=100.0, elapsed=5.0,
                     ranks=[0])  # fmt: skip
    assert _goodput.table([quiet]) == ""
    assert closing("", [quiet], 0) == ""
    assert closing("failed.\n", [quiet], 0) == "failed.\n"
    records = [_event(0, _events.JOINED, 101.0), _steps(0, 104.0, 10, 200.0)]
    one = _attempt(0, 0, records, started_at=100.0, elapsed=5.0, ranks=[0])
    assert closing("", [one], 0) == (
        "Where the time went (seconds):\n"
        "             run\n"
        "  joining    1.0\n"
        "  compiling    -\n"
        "  steps      2.0\n"
        "  saving       -\n"
        "  restoring    -\n"
        "  restarts     -\n"
        "  redone       -\n"
        "  other      2.0\n"
        "  wall       5.0\n"
        "  goodput    40%\n"
    )
    assert str(one.goodput).splitlines()[0] == "             seconds"
    again = _attempt(1, 0, records, started_at=106.0, elapsed=5.0, ranks=[0])
    text = closing("", extended([_attempt(0, 1, records, started_at=100.0, elapsed=5.0,
                                          ranks=[0])], [again]), 1)  # fmt: skip
    assert text.splitlines()[0] == "meshkit launch: 1 restart (at most 1):"
    table = text.split("Where the time went (seconds):\n", 1)[1].splitlines()
    assert table[0] == "             attempt 0  attempt 1        run"
    assert table[7] == "  redone           2.0          -        2.0"  # all 10 steps: none restored
    assert table[-1] == "  goodput           0%        40%        18%"


def test_a_process_counts_compiles_and_checkpoints_between_its_batches_aside(monkeypatch):
    monkeypatch.setattr(progress, "steps", progress.Steps())
    monkeypatch.setattr(_events, "totals", dict.fromkeys(_events.totals, 0.0))
    _events.count(seconds=4.0, programs=1)  # before the first batch: not in the steps' wall
    _events.count(tracing=1.0)
    progress.step(1, 0.0, 1.0)
    _events.count(seconds=0.25, programs=1)
    since = stragglers.clock()
    _events.count(saving=0.5)
    progress.step(2, 2.0, 3.0)
    progress.step(3, 3.0, 4.0)
    _events.count(saving=0.5)  # after the last batch: outside the steps' wall
    assert stragglers.steps_s() == 3.0 - 0.75
    assert stragglers.spent() == {"compiling": 5.25, "saving": 1.0, "restoring": 0.0}
    _events.count(tracing=0.5)  # a compile inside a restore counts as compiling
    assert stragglers.checkpointed("restoring", since)["compiling"] == 0.5
    assert stragglers.spent()["compiling"] == 5.75
    assert 0.0 <= stragglers.spent()["restoring"] < 1.0


# ---- a real run -------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_a_restarted_run_says_where_its_time_went(tmp_path, marker, monkeypatch):
    require("orbax.checkpoint", "orbax")
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)
    result = meshkit.launch(
        [str(PROGRAM), str(tmp_path / "ckpt")], num_processes=2, devices_per_process=2,
        platform="cpu", timeout=60, stream=False, keep_output=True, grace=1.0, max_restarts=1,
        starter=starter(None, "tests/test_goodput.py", ECOSYSTEM),
    )  # fmt: skip
    assert result.returncode == 0, result.report
    a0, a1 = result.attempts
    assert (a0.restored_step, a1.restored_step) == (None, 4), result.report
    assert a0.steps in (5, 6), result.report  # rank 0 may have taken step 6
    assert a1.steps == 4, result.report
    g0, g1, total = a0.goodput, a1.goodput, result.goodput
    # Redone: attempt 0's steps past step 4, at its mean step time (each step sleeps 50 ms).
    assert g0.redone == pytest.approx((a0.steps - 4) * (g0.steps + g0.redone) / a0.steps)
    assert g0.steps + g0.redone >= 0.05 * (a0.steps - 1) * 0.99
    assert g1.steps >= 0.05 * (a1.steps - 1) * 0.99
    assert min(g0.joining, g1.joining, g0.compiling, g0.saving, g1.saving, g1.restoring) > 0
    assert (g0.restoring, g1.restarts, g1.redone) == (0.0, 0.0, 0.0)
    assert a0.stopped_s is not None
    assert g0.restarts >= a0.stopped_s > 0
    # Attempt 0 lasts until attempt 1 started; the two make the run's wall time.
    assert g0.wall == pytest.approx(a1.started_at - a0.started_at)
    assert total.wall == pytest.approx(a1.started_at + a1.elapsed - a0.started_at)
    for g in (g0, g1, total):
        assert sum(getattr(g, p) for p in PARTS) + g.other == pytest.approx(g.wall)
    table = result.report.split("Where the time went (seconds):\n", 1)[1].splitlines()
    assert table[0].split() == ["attempt", "0", "attempt", "1", "run"]
    rows = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert rows["redone"] == [f"{g0.redone:.1f}", "-", f"{total.redone:.1f}"]
    assert rows["goodput"] == [f"{g.ratio:.0%}" for g in (g0, g1, total)]
    # In process 0 of attempt 1, its own figures so far (nothing of restarts or redone steps).
    said = [x for x in result.ranks[0].stdout.splitlines() if x.startswith("GOODPUT ")]
    mine = _events.Goodput(**json.loads(said[0].split(" ", 1)[1]))
    assert mine.steps >= 0.05 * (a1.steps - 1) * 0.99
    assert min(mine.restoring, mine.saving, mine.joining, mine.compiling) > 0
    assert (mine.restarts, mine.redone) == (0.0, 0.0)
    assert mine.wall < a1.elapsed
    assert dataclasses.asdict(mine).keys() == dataclasses.asdict(g1).keys()
