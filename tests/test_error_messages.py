"""What a new user reads when a training loop goes wrong: the user's line, each side, a fix.

Three classic mistakes of a first multi-process training loop (`ranks/error_messages.py`, an
optax loop over `meshkit.global_batches` on 2 processes x 4 CPU devices): a computation only
process 0 runs, a process that pads its batches to a size of its own, and arrays whose trailing
dimension differs. Each message names the user's line where it can, says what each process did
without guessing a culprit that no majority shows, and offers only fixes that fit: never turning
a check off, never padding that would hide the bug. Each failure is printed once per process and
once in the launcher's report. Messages are checked part by part.
"""

from __future__ import annotations

import inspect
import re

import pytest
from ranks import error_messages as ranks

import meshkit
from meshkit._src.arrays import ends
from meshkit._src.arrays.records import LeafRecord, PartRecord, compare
from meshkit._src.core.events import Event
from meshkit._src.launch import report as _report
from meshkit._src.launch.report import RankResult, Told
from meshkit._src.runtime import programs
from meshkit.testing import launch_in_processes

_FAST = {"MESHKIT_CHECK_TIMEOUT": "8"}
_FILE = r"\S*ranks/error_messages\.py"


@pytest.fixture
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _line(fn, mark: str) -> int:
    source, first = inspect.getsourcelines(fn)
    return first + next(i for i, t in enumerate(source) if t.rstrip().endswith(mark))


def _message(stderr: str, head: str) -> str:
    """The error's message in a rank's output: from ``head`` to its "Consider" line."""
    start = stderr.index(head)
    end = stderr.index("\n", stderr.index("\nConsider", start) + 1)
    return stderr[start:end]


def _raised(result, head: str) -> str:
    """The message of the first rank that raised it (the other may be ended by its failure
    first, printing only its first line)."""
    for rank in result.ranks:
        if head in rank.stderr and "\nConsider" in rank.stderr.split(head, 1)[1]:
            return _message(rank.stderr, head)
    raise AssertionError(f"no rank raised {head!r}:\n{result.report}")


def _launch(target):
    result = launch_in_processes(target, timeout=150, env=_FAST)
    text = result.report + "\n" + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    assert not result.timed_out, text
    return result, text


# ---- a computation only process 0 runs ------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.usefixtures("_leave_no_process")
def test_a_computation_only_process_0_runs_names_the_users_line():
    result, text = _launch(ranks.only_process_0_sums_the_mask)
    head = "meshkit (programs compared at compilation): "
    message = _raised(result, head)  # each side's message names both
    line = _line(ranks.only_process_0_sums_the_mask, "# process 0 only")
    # What process 0 compiled, and the user's line that ran it; not JAX's internals.
    assert re.search(rf"jit\(_reduce_sum\), run at {_FILE}:{line} in each_step", message), text
    assert "reductions.py" not in message, message
    assert "dispatch.py" not in message, message
    # The rule and the fixes that fit; no padding hint, no check turned off.
    assert "Every process must run the same computations on global arrays" in message or (
        "a computation that some processes run and others skip" in message
    ), message
    assert "Consider running that computation on every process" in message, message
    assert "with numpy" in message, message
    assert "pad" not in message, message
    assert "MESHKIT_PROGRAM_CHECK" not in text, text
    # Two processes, one on each side: the launcher names no root cause.
    assert "--- root cause:" not in result.report, result.report
    assert "no rank is named as the cause" in result.report, result.report
    # Printed once by each process that raised it, once in the report.
    for rank in result.ranks:
        assert rank.stderr.count(head) <= 1, rank.stderr
    assert result.report.count(head) == 1, result.report


# ---- a process that pads its batches to a size of its own -----------------------------------


@pytest.mark.multiprocess
@pytest.mark.usefixtures("_leave_no_process")
def test_a_process_padding_its_batches_is_not_blamed_on_the_other():
    result, _ = _launch(ranks.process_1_pads_to_40_rows)
    head = "meshkit.global_batches: at step 1, "
    for rank in result.ranks:
        assert rank.stderr.count(head) <= 1, rank.stderr
    message = _raised(result, head)
    # What each side passed, and no culprit: two processes, no majority.
    assert "the processes' batches differ in rows before the end of their data" in message
    assert "process 0's batch has 32 rows; process 1's batch has 40 rows" in message, message
    assert "the batches alone do not tell which process's loader is wrong" in message, message
    assert "check that process's loader" not in message, message
    # No fix that hides the bug.
    assert "ragged" not in message, message
    consider = message[message.index("\nConsider") :]
    assert "pad=True" not in consider, message
    assert "Consider checking that the loaders make batches of one size" in consider, message
    assert "--- root cause:" not in result.report, result.report
    assert result.report.count(head) == 1, result.report


def _records(**rows: int) -> dict[int, PartRecord]:
    return {
        int(p[1:]): PartRecord(rows=n, last=False if p == "p0" else None) for p, n in rows.items()
    }


def test_rows_that_differ_name_the_outlier_only_where_a_majority_agrees():
    three = {
        0: PartRecord(rows=32, last=False),
        1: PartRecord(rows=32, last=False),
        2: PartRecord(rows=40),
    }
    error = ends.short_batch(three, 3, pad=True)
    assert error is not None
    assert (error.processes, error.field) == ([2], "rows")
    message = str(error)
    assert "processes 0 and 1 have 32 rows; process 2's batch has 40 rows" in message, message
    assert "process 2 differs from the others" in message, message
    assert "ragged" not in message


# ---- a trailing dimension that differs ------------------------------------------------------


def _leaf_records(*shapes: tuple[list, list]) -> dict[int, PartRecord]:
    return {
        p: PartRecord(tree="*", leaves=(LeafRecord("['x']", "float32", [["data"], []], g, local),))
        for p, (g, local) in enumerate(shapes)
    }


@pytest.mark.parametrize(
    "shapes",
    [
        ((["?", 8], [32, 8]), (["?", 9], [32, 9])),  # pad=True: only the trailing size differs
        (([64, 8], [32, 8]), ([64, 9], [32, 9])),  # pad=False, trailing
        (([64, 8], [32, 8]), ([80, 9], [40, 9])),  # pad=False, both
        (([64, 8], [32, 8]), ([80, 8], [40, 8])),  # pad=False, the leading size only
    ],
    ids=["pad-trailing", "trailing", "both", "leading"],
)
def test_padding_is_offered_only_where_it_can_fix_the_shapes(shapes):
    records = _leaf_records(*shapes)
    with pytest.raises(meshkit.DivergenceError) as caught:
        compare(records, "meshkit.global_batches")
    message = str(caught.value)
    assert message.startswith(
        "meshkit.global_batches: processes disagree on the global shape of ['x']:\n"
    ), message
    assert f"  process 0: float32{shapes[0][1]} (global [{', '.join(map(str, shapes[0][0]))}]" in (
        message
    )
    assert f"  process 1: float32{shapes[1][1]} (global [{', '.join(map(str, shapes[1][0]))}]" in (
        message
    )
    assert caught.value.processes == [0, 1]  # no majority
    assert caught.value.field == "['x']"
    leading_only = shapes[0][0][1:] == shapes[1][0][1:] and shapes[0][0][0] != "?"
    if leading_only:
        assert "for an uneven last batch (the end of the data), pass pad=True." in message
    else:
        assert "pad=True" not in message, message
        assert "which padding cannot fix" in message, message
        assert "Consider loaders that give every process arrays of the same trailing" in message


# ---- no message offers a fix that hides the bug ---------------------------------------------


def _messages() -> list[str]:
    out = []
    names = {0: {"name": "jit(f)", "digest": "a", "line": "t.py:9 in main"},
             1: {"name": "jit(g)", "digest": "b", "line": "t.py:7 in main"}}  # fmt: skip
    out.append(str(programs._difference(names, 2)))
    inside = {p: {**r, "name": "jit(f)"} for p, r in names.items()}
    out.append(str(programs._difference(inside, 2)))
    args = {0: [["x", "float32[8,16]", "?"]], 1: [["x", "float32[8,24]", "?"]]}
    out.append(str(programs._difference({p: {**r, "args": args[p]} for p, r in inside.items()}, 2)))
    out.append(
        programs._ALONE.format(
            what="w", mine=programs._ran(names[0]), number="2nd", gone="process 1 left"
        )
    )
    midstream = ends.short_batch(_records(p0=32, p1=40), 1, pad=True)
    assert midstream is not None
    out.append(str(midstream))
    for shapes in (
        ((["?", 8], [32, 8]), (["?", 9], [32, 9])),
        (([64, 8], [32, 8]), ([64, 9], [32, 9])),
    ):
        with pytest.raises(meshkit.DivergenceError) as caught:
            compare(_leaf_records(*shapes))
        out.append(str(caught.value))
    return out


def test_no_message_offers_turning_the_check_off_or_padding_that_hides_the_bug():
    for message in _messages():
        assert "MESHKIT_PROGRAM_CHECK" not in message, message
        assert "ragged" not in message, message
        assert "turns this check off" not in message, message


def test_a_compiled_function_of_jax_is_named_without_its_internal_file():
    record = {"name": "jit(_reduce_sum)", "digest": "a", "line": "train.py:95 in <module>",
              "where": f"_reduce_sum at {programs.jax.__file__}:230"}  # fmt: skip
    assert programs._ran(record) == "jit(_reduce_sum), run at train.py:95 in <module>"
    mine = {"name": "jit(step)", "where": "step at train.py:12", "line": "train.py:93 in <module>"}
    assert programs._ran(mine) == "jit(step) (step at train.py:12), run at train.py:93 in <module>"


def test_each_process_is_shown_with_the_line_or_the_thread_that_ran_its_program():
    records = {
        0: {"name": "jit(f)", "digest": "a", "line": "t.py:9 in main"},
        1: {"name": "jit(f)", "digest": "a", "line": "t.py:7 in main"},
        2: {"name": "jit(stack)", "digest": "b", "thread": "meshkit-batches"},
    }
    text = str(programs._difference(records, 2))
    assert (
        "  processes 0,1: jit(f), run by process 0 at t.py:9 in main; process 1 at t.py:7 in "
        "main\n  process 2: jit(stack), run in thread meshkit-batches\n" in text
    ), text


# ---- the launcher names no root cause it cannot know ----------------------------------------


def _rank(rank, code, stderr="", *, stopped=False):
    return RankResult(rank, code, "", stderr, stopped)


def test_the_launcher_names_no_root_cause_without_a_majority():
    results = [_rank(0, 1, "DivergenceError: a"), _rank(1, 1, "DivergenceError: a")]
    differ = {"cause": "divergence", "error": "DivergenceError", "field": "function"}
    told = Told.of([Event(r, "failed", 0.0, {**differ, "processes": [0, 1]}) for r in (1, 0)])
    report = _report.root_cause(results[1], results, 4.5, told)
    assert report.splitlines()[1] == (
        "meshkit found that ranks 0, 1 differ (function); no majority says which is wrong, so "
        "no rank is named as the cause."
    ), report
    assert "--- root cause:" not in report, report
    assert "--- first to fail: rank 1 ---" in report, report
    assert "evidence points" not in report, report
    # Each rank's record names the other (loops left at different steps): no rank is singled out.
    steps = {"cause": "divergence", "error": "DivergenceError", "field": "steps"}
    told = Told.of([Event(r, "failed", 0.0, {**steps, "processes": [1 - r]}) for r in (0, 1)])
    report = _report.root_cause(results[1], results, 4.5, told)
    assert "meshkit found that ranks 0, 1 differ (steps); no majority" in report, report
    assert "--- root cause:" not in report, report


def test_without_a_majority_the_report_shows_the_error_that_ended_the_first_rank():
    # Rank 0 exited first, ended by rank 1's failure (fail-fast): its output holds a notice
    # only, so the report shows rank 1's error, once, and still names no cause.
    results = [
        _rank(0, 1, "meshkit: process 1 failed: DivergenceError: shapes\nProcess 0 stops too"),
        _rank(
            1, 1, "DivergenceError: shapes\n  process 0: float32[16, 3]\n  process 1: float32[4, 3]"
        ),
    ]
    differ = {"cause": "divergence", "error": "DivergenceError", "field": "(the array)"}
    told = Told.of(
        [
            Event(1, "failed", 0.0, {**differ, "processes": [0, 1]}),
            Event(0, "failed", 0.0, {"cause": "peer", "process": 1, "error": "DivergenceError"}),
        ]
    )
    report = _report.root_cause(results[0], results, 1.6, told)
    assert "no majority says which is wrong" in report, report
    assert "--- the error that ended rank 0: rank 1 ---" in report, report
    assert report.count("process 0: float32[16, 3]") == 1, report
    assert "--- root cause:" not in report, report
    # A first rank that raised its own error is shown as the first to fail.
    told = Told.of([Event(r, "failed", 0.0, {**differ, "processes": [0, 1]}) for r in (0, 1)])
    report = _report.root_cause(results[1], results, 1.6, told)
    assert "--- first to fail: rank 1 ---" in report, report


def test_the_launcher_names_no_root_cause_when_every_rank_failed_alike():
    results = [_rank(0, 1, "MeshkitError: a", stopped=True), _rank(1, 1, "MeshkitError: a")]
    failed = {"cause": "exception", "error": "MeshkitError", "where": "/x/train.py:56"}
    told = Told.of([Event(r, "failed", 0.0, failed) for r in (1, 0)])
    report = _report.root_cause(results[1], results, 9.2, told)
    assert "Ranks 0-1 failed alike (MeshkitError at /x/train.py:56)" in report, report
    assert "--- root cause:" not in report, report
    assert "--- first to fail: rank 1 ---" in report, report
    # Failed at different places: the first to fail is still the one the evidence points to.
    other = {**failed, "where": "/x/train.py:57"}
    told = Told.of([Event(0, "failed", 0.0, failed), Event(1, "failed", 0.0, other)])
    assert "--- root cause: rank 1 ---" in _report.root_cause(results[1], results, 9.2, told)
