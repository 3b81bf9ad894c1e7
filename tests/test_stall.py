"""Stall detection in one process (`meshkit._src.lifecycle.stall`): settings, records, the verdict,
and the detector's protocol over an in-memory board. The runs of several processes (a stuck rank
named and ended, healthy runs never ended) are in test_stalls_multiprocess.py and
test_guarantees.py.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshkit import MeshkitError
from meshkit._src.lifecycle import stall as _stall
from meshkit._src.lifecycle.progress import ServiceBoard
from meshkit._src.lifecycle.stall import DEVICE, MESHKIT, PYTHON, StallRecord

# ---- settings ---------------------------------------------------------------------------------


def test_the_deadline_is_five_minutes_and_the_report_comes_at_a_fifth(monkeypatch):
    monkeypatch.delenv("MESHKIT_STALL_TIMEOUT", raising=False)
    assert _stall.settings() == _stall.Settings(60.0, 300.0)
    monkeypatch.setenv("MESHKIT_STALL_TIMEOUT", "12")
    assert _stall.settings() == _stall.Settings(2.4, 12.0)
    assert _stall.settings().period == 0.6  # a quarter of the report's wait, at most 5 s
    monkeypatch.setenv("MESHKIT_STALL_TIMEOUT", "0")
    assert _stall.settings() is None


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("soon", "is not a number of seconds"),
        ("-5", "must be a finite number of seconds > 0 (0: off)"),
        ("inf", "must be a finite number of seconds > 0 (0: off)"),
    ],
)
def test_a_deadline_that_is_no_number_of_seconds_names_the_variable(monkeypatch, value, rule):
    monkeypatch.setenv("MESHKIT_STALL_TIMEOUT", value)
    with pytest.raises(MeshkitError) as raised:
        _stall.settings()
    text = str(raised.value)
    assert text.startswith("meshkit.init(): "), text
    assert f"MESHKIT_STALL_TIMEOUT={value!r}" in text, text
    assert rule in text, text


def test_init_refuses_a_nonsense_deadline_before_joining():
    code = "import meshkit; meshkit.init()"
    env = {"MESHKIT_STALL_TIMEOUT": "soon", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**env, "PYTHONPATH": ":".join(sys.path)},
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "MeshkitError: meshkit.init(): " in out.stderr, out.stderr
    assert "MESHKIT_STALL_TIMEOUT='soon' is not a number of seconds" in out.stderr, out.stderr


# ---- the verdict ------------------------------------------------------------------------------


def _rec(p, state, where, inner="", step="", idle=61.0, stack=""):
    return StallRecord(p, idle, state, where, inner, step, stack)


def test_the_process_in_python_holds_a_run_whose_others_wait_for_device_results():
    stack = '  File "loader.py", line 37, in load\n    done.wait()\n'
    waiting = {p: _rec(p, DEVICE, "train.py:39 in main", "_value (array.py:696)",
                       "step 6 of global_batches") for p in (0, 2, 3)}  # fmt: skip
    stuck = _rec(1, PYTHON, "loader.py:37 in load", "wait (threading.py:355)",
                 "step 5 of global_batches", idle=64.0, stack=stack)  # fmt: skip
    found = _stall.verdict({**waiting, 1: stuck})
    assert found.holding == (1,)
    assert found.why.startswith("Process 1 holds the run: the others wait for a collective")
    first, second = found.places.splitlines()
    assert first == (
        "  process 1 is in Python at loader.py:37 in load, in wait (threading.py:355), "
        "step 5 of global_batches"
    )
    assert second.startswith("  processes 0, 2, 3 wait for device results at train.py:39 in main")
    assert second.endswith("step 6 of global_batches")
    assert found.stacks == f"Process 1's main thread (most recent call last):\n{stack}"
    assert found.idle == 61.0  # the least idle of the records
    text = found.text(" THEN.")
    assert text.startswith("meshkit: no process has made progress for 61 s. Process 1 holds")
    assert text.index(" THEN.") < text.index("process 1 is in Python")


def test_a_run_whose_every_process_waits_has_nobody_to_blame():
    found = _stall.verdict(
        {0: _rec(0, DEVICE, "train.py:39 in main"), 1: _rec(1, MESHKIT, "train.py:41 in main")}
    )
    assert found.holding == ()
    assert found.why.startswith("Every process waits for the others, so none holds the run")
    assert "jax.process_index()" in found.why
    assert "process 1 waits inside a meshkit call at train.py:41 in main" in found.places
    assert found.stacks == ""


def test_a_run_whose_every_process_is_stuck_in_its_own_code_blames_none():
    found = _stall.verdict(
        {p: _rec(p, PYTHON, "loader.py:37 in load", stack="s\n") for p in range(3)}
    )
    assert found.holding == ()
    assert found.why == (
        "Every process is stuck in its own code; none waits for another or holds the run."
    )
    assert found.places == "  processes 0, 1, 2 are in Python at loader.py:37 in load\n"


_records = st.dictionaries(
    st.integers(0, 40),
    st.tuples(st.sampled_from([DEVICE, MESHKIT, PYTHON]), st.sampled_from(["a.py:1", "b.py:2"])),
    min_size=1,
    max_size=12,
)


@given(_records, st.randoms())
def test_the_verdict_names_every_process_once_and_blames_only_python(raw, rng):
    records = {p: _rec(p, state, where) for p, (state, where) in raw.items()}
    found = _stall.verdict(records)
    named = []
    for line in found.places.splitlines():
        who = line.split(" wait")[0].split(" is ")[0].split(" are ")[0].strip()
        named += [
            int(p) for p in who.removeprefix("processes ").removeprefix("process ").split(", ")
        ]
    assert sorted(named) == sorted(records)  # each once
    python = sorted(p for p, r in records.items() if r.state == PYTHON)
    both = python and len(python) < len(records)
    assert list(found.holding) == (python if both else [])
    shuffled = list(records.items())
    rng.shuffle(shuffled)
    assert _stall.verdict(dict(shuffled)) == found  # what every process says, whatever its order


# ---- the record -------------------------------------------------------------------------------


def _record_of_main(block):
    """The record the service thread would post of the main thread, blocked in ``block``."""
    main, out = threading.main_thread().ident, []
    ready = threading.Event()

    def take():
        ready.wait(10)
        time.sleep(0.2)
        out.append(_stall.record(3, 61.23, main, "step 5 of global_batches"))

    thread = threading.Thread(target=take)
    thread.start()
    ready.set()
    block(thread)
    return out[0]


def test_a_main_thread_blocked_in_its_own_code_is_in_python_at_its_line():
    mine = _record_of_main(lambda t: t.join())  # user line: joins
    assert (mine.process, mine.idle, mine.state) == (3, 61.2, PYTHON)
    assert mine.where.endswith(f"test_stall.py:{_line('joins')} in <lambda>"), mine
    assert mine.inner.startswith("_wait_for_tstate_lock (threading.py:") or mine.inner.startswith(
        "join (threading.py:"
    ), mine
    assert mine.step == "step 5 of global_batches"
    assert "in _record_of_main" in mine.stack, mine.stack
    assert "t.join()" in mine.stack, mine.stack


def _line(mark):
    with open(__file__) as f:
        text = f.read().splitlines()
    (found,) = [i for i, line in enumerate(text, 1) if line.endswith(f"# user line: {mark}")]
    return found


def test_a_checkpoint_on_the_stack_is_progress():
    here = {}
    exec(compile("import sys\ndef f(): return sys._getframe()", "/x/orbax/save.py", "exec"), here)
    assert _stall.in_checkpoint(here["f"]())
    assert not _stall.in_checkpoint(sys._getframe())
    assert not _stall.in_checkpoint(None)


# ---- the detector over an in-memory board ------------------------------------------------------


class _Ended(Exception):
    pass


def _compare(detector, idle):
    """``detector._compare`` in a helper thread, as the service thread runs it (the main
    thread, which the record describes, waits in this file); what it raised, raised here."""
    raised = []

    def run():
        time.sleep(0.1)  # the main thread waits in join by then, not in start
        try:
            detector._compare(idle, "")
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if raised:
        raise raised[0]


@pytest.fixture
def quiet(monkeypatch):
    """What the detector says and whether it ends the process, recorded instead."""
    said, ended = [], []
    monkeypatch.setattr(_stall, "say", lambda log, level, text: said.append(text))
    monkeypatch.setattr(_stall._exit, "claim", lambda: True)

    def now(status):
        ended.append(status)
        raise _Ended

    monkeypatch.setattr(_stall._exit, "now", now)
    return said, ended


def _board():
    posted: dict[str, str] = {}
    board = ServiceBoard(post=posted.__setitem__, read=lambda: dict(posted), drop=posted.pop)
    return posted, board


def _other(posted, p=1, idle=30.0):
    record = _rec(p, DEVICE, "train.py:39 in main", idle=idle)
    posted[str(p)] = json.dumps(record.__dict__)


def test_a_stalled_process_reports_once_when_every_process_has_posted(quiet):
    said, ended = quiet
    posted, board = _board()
    detector = _stall.Detector(0, 2, board, str, _stall.Settings(10.0, 50.0))
    _compare(detector, 12.0)  # process 1 has not posted: it makes progress
    assert said == []
    assert json.loads(posted["0"])["state"] == PYTHON
    _other(posted)
    _compare(detector, 13.0)
    _compare(detector, 14.0)
    assert len(said) == 1
    assert ended == []
    assert said[0].startswith("meshkit: no process has made progress for 13 s. Process 0 holds")
    assert "The run ends if no process moves for 50 s (MESHKIT_STALL_TIMEOUT)." in said[0]


def test_the_deadline_ends_the_run_once_every_record_is_that_old(quiet):
    said, ended = quiet
    posted, board = _board()
    detector = _stall.Detector(1, 2, board, str, _stall.Settings(10.0, 50.0))
    # Its own wait is long enough, process 0's is not: no end; then process 0's is within a
    # period of the deadline. (One line calls both: the main thread is at the same place.)
    for other, own in ((20.0, 51.0), (49.0, 52.0)):
        _other(posted, p=0, idle=other)
        with contextlib.suppress(_Ended):
            _compare(detector, own)
        assert ended == ([] if other == 20.0 else [1])
    assert json.loads(posted["verdict"])["holding"] == [1]
    assert said[-1].startswith("meshkit: still no progress after 49 s (the places above).")
    assert "Process 1 ends with status 1 (MESHKIT_STALL_TIMEOUT=50;" in said[-1]


def test_a_verdict_posted_by_another_process_ends_this_one_with_its_words(quiet):
    said, ended = quiet
    posted, board = _board()
    found = _stall.verdict({0: _rec(0, DEVICE, "a.py:1"), 1: _rec(1, PYTHON, "b.py:2")})
    posted["verdict"] = json.dumps(found.__dict__)
    detector = _stall.Detector(0, 2, board, str, _stall.Settings(10.0, 50.0))
    with pytest.raises(_Ended):
        _compare(detector, 11.0)
    assert ended == [1]
    assert "Process 1 holds the run" in said[-1]
    assert "process 1 is in Python at b.py:2" in said[-1]


def test_a_process_that_moves_again_takes_its_record_back(quiet, monkeypatch):
    posted, board = _board()
    detector = _stall.Detector(0, 2, board, str, _stall.Settings(0.4, None))
    monkeypatch.setattr(_stall, "_detector", detector)  # installed
    monkeypatch.setattr(_stall._exit, "at", lambda *a, **k: True)  # turns run by hand here

    class Still:
        def moved(self, interval):
            return None

    detector.sampler = Still()  # type: ignore[assignment]
    detector.progress -= 1.0
    detector._turn()
    assert "0" in posted
    detector.steps = lambda: "step 1 of global_batches"  # a step counted: progress
    detector._turn()
    assert "0" not in posted
    assert not detector.posted
    # This process ends (`exit.stop`): no turn reads or posts, none is due after it.
    monkeypatch.setattr(_stall._exit, "stopping", threading.Event())
    _stall._exit.stopping.set()
    monkeypatch.setattr(_stall._exit, "at", lambda *a, **k: pytest.fail("a turn after stop"))
    detector.progress -= 1.0
    detector._turn()
    assert "0" not in posted


def test_a_stall_in_the_same_places_after_a_moment_of_progress_is_not_said_again(quiet):
    said, _ = quiet
    posted, board = _board()
    detector = _stall.Detector(0, 2, board, str, _stall.Settings(10.0, None))
    for idle in (12.0, 13.0):  # one line calls both: the main thread is at the same place
        _other(posted)
        _compare(detector, idle)
        detector.posted = False  # a sample saw progress (a thread ran a moment): the record goes
        posted.pop("0")
    assert len(said) == 1, said
    _other(posted, p=1)
    posted["1"] = posted["1"].replace("train.py:39", "train.py:40")  # process 1 moved on
    _compare(detector, 14.0)
    assert len(said) == 2, said  # a stall elsewhere is new
