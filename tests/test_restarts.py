"""Whole-group restarts (``meshkit launch --max-restarts``) on one machine, 2 processes x 2 CPU
devices: a crash at step 7 of 12 with a checkpoint every 2 steps ends as an uninterrupted run
does, bit for bit; a failure that repeats is not restarted again; the report lists every attempt.

The program is ``ranks/training.py``. Unit tests of the decisions are at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import require
from ranks.preloads import ECOSYSTEM

import meshkit
from meshkit import LaunchError
from meshkit._src.core import events as _events
from meshkit._src.launch.report import LaunchAttempt, LaunchResult
from meshkit._src.launch.restarts import attempt_of, repeated, run_attempts, summary
from meshkit.testing._forks import starter

pytestmark = pytest.mark.multiprocess
PROGRAM = Path(__file__).parent / "ranks" / "training.py"


SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _train(
    root: Path, *args: str, max_restarts: int = 0, log_dir: Path | None = None
) -> meshkit.LaunchResult:
    require("orbax.checkpoint", "orbax")
    return meshkit.launch(
        [str(PROGRAM), str(root), *args],
        log_dir=log_dir,
        num_processes=2,
        devices_per_process=2,
        platform="cpu",
        timeout=120,
        stream=False,
        keep_output=True,
        grace=1.0,
        max_restarts=max_restarts,
        starter=starter(None, "tests/test_restarts.py", ECOSYSTEM),
    )


def _lines(result: meshkit.LaunchResult, word: str) -> list[str]:
    """Rank 0's lines starting with ``word``, each cut before a line JAX's gloo wrote into it
    (its C++ writes to the same stdout, without waiting for our line's end)."""
    lines = result.ranks[0].stdout.splitlines()
    return [x.split("[Gloo]", 1)[0] for x in lines if x.startswith(word + " ")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[str]:
    result = _train(tmp_path_factory.mktemp("whole"))
    assert result.returncode == 0, result.report
    assert len(result.attempts) == 1
    return _lines(result, "LOSS") + _lines(result, "FINAL")


def test_a_crash_restarts_the_group_which_ends_as_an_uninterrupted_run(tmp_path, uninterrupted):
    result = _train(tmp_path, "--kill-at", "7", max_restarts=2, log_dir=tmp_path / "logs")
    assert result.returncode == 0, result.report
    first, second = result.attempts
    assert first.cause.startswith("meshkit launch: rank 1 failed first (killed by SIGKILL) after ")
    assert (first.saved_step, first.restored_step, first.restartable) == (6, None, True)
    assert first.stopped_s is not None
    assert (second.restored_step, second.saved_step, second.returncode) == (6, 12, 0)
    assert second.restore_s is not None
    assert second.joined_s is not None
    assert _lines(result, "ATTEMPT") == ["ATTEMPT 1 from step 7"]
    # The resumed steps and the end equal the uninterrupted run's, bit for bit (CPU).
    resumed = _lines(result, "LOSS") + _lines(result, "FINAL")
    assert resumed == uninterrupted[6:]
    report = result.report.splitlines()
    assert report[0] == "meshkit launch: 1 restart (at most 2):"
    assert report[1].startswith("  attempt 0: every rank joined after ")
    assert "; saved up to step 6; rank 1 failed first (killed by SIGKILL) after " in report[1]
    assert report[1].endswith(" later")
    assert "; restored step 6 in " in report[2]
    assert report[2].endswith("; saved up to step 12; finished")
    # The picture of the run: a band per attempt, the saves of the first, the restores after.
    svg = ET.parse(tmp_path / "logs" / "timeline.svg").getroot()
    marks = [g.get("class") for g in svg.iter(f"{SVG}g")]
    bands = [r for r in svg.iter(f"{SVG}rect") if r.get("class") == "attempt"]
    assert [b.find(f"{SVG}title").text for b in bands] == ["attempt 0", "attempt 1"]
    assert marks.count("restored") == 2, marks  # both ranks, in the second attempt
    assert marks.count("saved") >= 2, marks


def test_a_failure_that_repeats_is_not_restarted_again(tmp_path):
    result = _train(tmp_path, "--fail-at", "3", "--every-attempt", max_restarts=5)
    assert result.returncode == 1
    assert [a.number for a in result.attempts] == [0, 1]
    assert result.attempts[0].failure == result.attempts[1].failure
    rank, error, where, step = result.attempts[1].failure
    assert (rank, error, step) == (1, "RuntimeError", 2)
    assert where.endswith("training.py:" + str(_line_of("raise RuntimeError")))
    assert (
        "meshkit launch: not restarting again: attempts 0 and 1 failed the same way (rank 1: "
        f"RuntimeError raised at {where}, after step 2); a restart will not mend it."
    ) in result.report
    assert "process 1 fails at step 3 on purpose" in result.report


def test_restarts_end_when_none_is_left(tmp_path):
    # A crash (no exception: not "the same failure") on every attempt; one restart allowed.
    result = _train(tmp_path, "--kill-at", "1", "--every-attempt", max_restarts=1)
    assert result.returncode == 1
    assert len(result.attempts) == 2
    assert result.report.splitlines()[-1] == "meshkit launch: no restart left (--max-restarts 1)."


def _line_of(text: str) -> int:
    lines = PROGRAM.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


# ---- bad input ----------------------------------------------------------------------------


def test_max_restarts_must_be_a_count(tmp_path):
    with pytest.raises(LaunchError, match=r"--max-restarts must be an int >= 0; got -1\."):
        meshkit.launch([str(PROGRAM)], num_processes=1, max_restarts=-1)
    out = subprocess.run(
        [sys.executable, "-m", "meshkit", "launch", "-n", "1", str(PROGRAM)],
        env={**os.environ, "MESHKIT_MAX_RESTARTS": "many"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "MESHKIT_MAX_RESTARTS" in out.stderr
    assert "'many'" in out.stderr


# ---- the decisions, without processes -------------------------------------------------------


def _result(code: int, first: int | None = None, report: str = "") -> LaunchResult:
    return LaunchResult(code, [], first, False, [], 1.0, report)


def _event(rank: int, kind: str, time: float = 0.0, **fields: object) -> _events.Event:
    return _events.Event(rank, kind, time, dict(fields))


def test_an_attempt_is_read_from_the_ranks_records():
    records = [
        _event(0, _events.JOINED, 101.0),
        _event(1, _events.JOINED, 102.5),
        _event(0, _events.RESTORED, step=4, seconds=0.25),
        _event(1, _events.RESTORED, step=4, seconds=0.5),
        _event(0, _events.SAVED, step=6),
        _event(1, _events.FAILED, cause="exception", error="ValueError", where="t.py:3"),
    ]
    a = attempt_of(
        2, _result(1, 1, "meshkit launch: rank 1 failed first\nmore"), records,
        ranks=[0, 1], started_at=100.0, stopped_s=0.5, restartable=True,
    )  # fmt: skip
    assert a == LaunchAttempt(
        number=2, returncode=1, cause="meshkit launch: rank 1 failed first", restartable=True,
        elapsed=1.0, joined_s=2.5, stopped_s=0.5, restored_step=4, restore_s=0.5,
        saved_step=6, failure=(1, "ValueError", "t.py:3", 6), started_at=100.0, goodput=a.goodput,
    )  # fmt: skip
    # The rank that raised is the cause, whichever rank the launcher saw exit first.
    peer = _event(0, _events.FAILED, 0.5, cause="peer", process=1, error="ValueError")
    raced = attempt_of(2, _result(1, 0, "x"), [peer, *records], ranks=[0, 1], started_at=100.0,
                       stopped_s=0.5, restartable=True)  # fmt: skip
    assert raced.failure == (1, "ValueError", "t.py:3", 6)
    missing = attempt_of(0, _result(0), records[:1], ranks=[0, 1], started_at=100.0,
                         stopped_s=None, restartable=False)  # fmt: skip
    assert (missing.joined_s, missing.failure, missing.cause) == (None, None, "")
    # A machine whose run started no rank (machines that differ end it first): nobody joined.
    empty = attempt_of(0, _result(1), [], ranks=[], started_at=100.0, stopped_s=None,
                       restartable=True)  # fmt: skip
    assert empty.joined_s is None


def test_only_the_same_failure_at_the_same_step_repeats():
    a = LaunchAttempt(0, 1, failure=(1, "E", "t.py:3", 2))
    assert repeated([a, LaunchAttempt(1, 1, failure=(1, "E", "t.py:3", 2))])
    assert not repeated([a, LaunchAttempt(1, 1, failure=(1, "E", "t.py:3", 4))])  # it got further
    assert not repeated([a, LaunchAttempt(1, 1, failure=None)])  # a crash, a lost machine
    assert not repeated([a])


def test_run_attempts_stops_at_success_at_a_stop_that_cannot_be_mended_and_at_the_limit():
    def runs(outcomes):
        seen = []

        def one(number):
            code, restartable = outcomes[number]
            seen.append(number)
            result = _result(code, 0 if code else None, "meshkit launch: boom." if code else "")
            result.attempts = [LaunchAttempt(number, code, "meshkit launch: boom." if code else "",
                                       restartable)]  # fmt: skip
            return result

        notes = []
        result = run_attempts(one, 3, notes.append)
        return seen, notes, result

    seen, notes, result = runs([(1, True), (0, False)])
    assert seen == [0, 1]
    assert result.returncode == 0
    assert notes == ["meshkit launch: restarting every process (restart 1 of at most 3): boom"]
    seen, _, result = runs([(1, True), (124, False)])  # a timeout: not restarted
    assert seen == [0, 1]
    assert result.returncode == 124
    seen, _, result = runs([(1, True)] * 4)
    assert seen == [0, 1, 2, 3]
    assert summary(result.attempts, 3).endswith("no restart left (--max-restarts 3).")
