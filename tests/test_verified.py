"""The default check: no computation completes on arrays whose processes disagree.

`meshkit.global_array_from_local(..., check=True)` verifies a call whose layout repeats the one
`meshkit.debug.PERIOD` calls back beside the caller, and makes any other call wait for its
verdict. Each case runs 2 processes x 4 CPU devices through the launcher: every step assembles
a batch, prints ``returned STEP``, runs a jitted sum over it (a collective across both
processes) and prints ``computed STEP``. The change comes at step 15, after ``PERIOD`` steps of
one layout, where a process whose layout repeats goes on without waiting.

What the launched processes run is in `ranks/verified.py`.
"""

from __future__ import annotations

import re

import pytest
from ranks import verified as ranks
from ranks.verified import CHANGE, STEPS

from meshkit.debug import PERIOD
from meshkit.testing import launch_in_processes

pytestmark = [pytest.mark.multiprocess]

FAST = {"MESHKIT_DEBUG": "0", "MESHKIT_CHECK_TIMEOUT": "10"}


def _run(case: str):
    assert PERIOD < CHANGE - 1, "the change must come after PERIOD calls of one layout"
    result = launch_in_processes(ranks.steps, timeout=90, env={**FAST, "VERIFIED_CASE": case})
    return result, result.report + "\n" + "\n".join(r.stderr for r in result.ranks)


def _steps_seen(result, what: str) -> list[list[int]]:
    return [
        [int(m) for m in re.findall(rf"^{what} (\d+)", rank.stdout, re.MULTILINE)]
        for rank in result.ranks
    ]


def test_one_process_changes_its_layout():
    result, text = _run("one")
    assert result.returncode != 0, text
    assert not result.timed_out, text
    returned, computed = _steps_seen(result, "returned"), _steps_seen(result, "computed")
    # Process 1 changed: its call waited for the verdict and raised before it returned.
    assert returned[1] == list(range(1, CHANGE)), text
    # Process 0 repeated its layout: its call returned, and its computation never completed.
    assert max(returned[0]) >= CHANGE, text
    assert computed == [list(range(1, CHANGE))] * 2, text
    rank1 = result.ranks[1].stderr
    assert (
        "meshkit.global_array_from_local: processes disagree on the global shape of (the array)"
        in rank1
    ), text
    assert "process 0: float32[8, 3] (global [16, 3]" in rank1, text
    assert "process 1: float32[4, 3] (global [8, 3]" in rank1, text
    # Two processes, one on each side: the launcher names no root cause (no majority says
    # which is wrong) and shows the first to fail.
    assert "no rank is named as the cause" in result.report, text
    assert "--- root cause:" not in result.report, text


def test_both_processes_change_differently():
    result, text = _run("both")
    assert result.returncode != 0, text
    assert not result.timed_out, text
    # Both changed: each waited, and each raised before its call returned.
    assert _steps_seen(result, "returned") == [list(range(1, CHANGE))] * 2, text
    assert _steps_seen(result, "computed") == [list(range(1, CHANGE))] * 2, text
    for rank in result.ranks:
        raised = "meshkit.global_array_from_local: processes disagree on the global shape"
        # Or, slower to raise than the other was to fail, it was stopped by the launcher first
        # (on a loaded machine, within the 1 s grace) and said that a check had failed.
        stopped = rank.stopped_by_launcher and "a cross-process check failed" in rank.stderr
        assert raised in rank.stderr or stopped, text
    # Both raise on one verdict. Which raises first is a race, and the other may stop on the
    # first one's failure notice (which quotes the error's first line), or on the launcher's
    # signal, before it prints its own traceback; the report holds the whole message once (of
    # a first rank ended by the other's failure, it shows the other's error).
    assert result.report.count("process 0: float32[16, 3] (global [32, 3]") == 1, text
    assert result.report.count("process 1: float32[4, 3] (global [8, 3]") == 1, text


def test_a_change_together_then_one_goes_back():
    result, text = _run("back")
    assert result.returncode != 0, text
    assert not result.timed_out, text
    returned, computed = _steps_seen(result, "returned"), _steps_seen(result, "computed")
    # Step 15: both changed to 16 rows; each waited, they agreed, the step computed.
    assert computed == [list(range(1, CHANGE + 1))] * 2, text
    # Step 16: process 0 went back to 8 rows, the layout of PERIOD calls back: it went on.
    # Process 1 kept 16 rows, which is not its layout PERIOD calls back: it waited, and raised.
    assert returned[1] == list(range(1, CHANGE + 1)), text
    assert max(returned[0]) >= CHANGE + 1, text
    rank1 = result.ranks[1].stderr
    assert "meshkit.global_array_from_local: processes disagree" in rank1, text
    assert "checked after it returned" not in rank1, text  # raised by the call
    assert "process 0: float32[8, 3] (global [16, 3]" in rank1, text
    assert "process 1: float32[16, 3] (global [32, 3]" in rank1, text


def test_a_process_that_catches_the_error_and_goes_on_never_joins_the_others_step():
    # Process 1 changes at step 15, catches the error and goes on. Process 0 repeated its layout
    # and went on into its step-15 sum, which waits for process 1. Had process 1's next call
    # assembled an array, its step-16 sum would have completed process 0's step-15 sum: a
    # number made of two steps' data on both processes, and a run that exits 0.
    result = launch_in_processes(ranks.caught, timeout=90, env=FAST)
    text = result.report + "\n" + "\n".join(r.stdout + r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    assert not result.timed_out, text
    computed = _steps_seen(result, "computed")
    assert computed == [list(range(1, CHANGE))] * 2, text  # no process computed step 15 or later
    raised = re.findall(r"^raised (\d+) (.*)$", result.ranks[1].stdout, re.MULTILINE)
    assert [int(step) for step, _ in raised] == list(range(CHANGE, STEPS + 1)), text
    assert raised[0][1].startswith(
        "meshkit.global_array_from_local: processes disagree on the global shape"
    ), text
    for _, message in raised[1:]:  # every later call raises that the processes are out of step
        assert message.startswith(
            "meshkit: the processes are out of step: process 0 went on past the call at which "
            "the processes differed, which raised here: meshkit.global_array_from_local: "
            "processes disagree on the global shape of (the array): It may be waiting in a "
            "computation that this process must not join"
        ), message
    # Process 1's program ran to its end, and exits with status 1: the launcher names it.
    assert "rank 1 failed first (exit code 1)" in result.report, text
    assert "a program whose processes went out of step did not succeed" in result.report, text


def test_in_debug_mode_a_call_checked_before_it_runs_keeps_the_processes_in_step():
    # The same under debug mode, with spmd steps: process 1's changed step-15 call waits for
    # its check and raises before it runs. Process 0's repeated its fingerprint and went on past
    # the check, to its host data's agreement, where process 1's failure reaches it: it raises
    # the same error in the same call, and neither computes step 15. In step, both go on.
    env = {**FAST, "MESHKIT_DEBUG": "1", "MESHKIT_DEBUG_TIMEOUT": "10"}
    result = launch_in_processes(ranks.caught_in_debug_mode, timeout=90, env=env)
    text = result.report + "\n" + "\n".join(r.stdout + r.stderr for r in result.ranks)
    assert result.returncode == 0, text
    steps = [s for s in range(1, STEPS + 1) if s != CHANGE]
    assert _steps_seen(result, "computed") == [steps] * 2, text
    for rank in result.ranks:
        raised = re.findall(r"^raised (\d+) (.*)$", rank.stdout, re.MULTILINE)
        assert [int(step) for step, _ in raised] == [CHANGE], text
        assert raised[0][1].startswith(f"meshkit debug: call #{CHANGE} of <lambda>"), text
    # Every step computed the sum of its own data: 16 rows of 3 values `step`.
    values = re.findall(r"^computed (\d+) (\S+)$", result.ranks[0].stdout, re.MULTILINE)
    assert all(float(v) == 48.0 * int(s) for s, v in values), values


def test_threads_wait_for_their_own_changes():
    import json

    result = launch_in_processes(ranks.threads, timeout=90, env=FAST)
    text = result.report + "\n" + "\n".join(r.stdout + r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    assert not result.timed_out, text
    lines = [
        [json.loads(line) for line in rank.stdout.splitlines() if line.startswith("{")]
        for rank in result.ranks
    ]

    def returned(process: int, thread: str) -> list[int]:
        return [e["returned"] for e in lines[process] if e["thread"] == thread and "returned" in e]

    def error(process: int, thread: str) -> str:
        return next(
            (e["error"] for e in lines[process] if e["thread"] == thread and "error" in e), ""
        )

    # Process 1's thread b changed at its call 15: that call waited and raised.
    assert returned(1, "b") == list(range(1, CHANGE)), text
    assert "global_array_from_local: processes disagree" in error(1, "b"), text
    # Thread a agrees everywhere: it made every call, unless the disagreement that thread b
    # found beside it was raised by one of its calls (the process's next meshkit call).
    for process in (0, 1):
        if error(process, "a"):
            assert "processes disagree on the global shape" in error(process, "a"), text
        else:
            assert returned(process, "a") == list(range(1, STEPS + 1)), text
    # Process 0's thread b repeated its layout and went on; the mismatch reached it later: raised
    # by a later call, by the final barrier, or, found after its last call, it ended process 0
    # with status 1.
    assert max(returned(0, "b")) >= CHANGE, text
    assert (
        f"call #{CHANGE}, checked after it returned"
        in result.ranks[0].stdout + result.ranks[0].stderr
    ), text
