"""The default check: every process raises in the call where they disagree; none computes on it.

`meshkit.global_array_from_local(..., check=True)` agrees on every call's layout before it
returns. Each case runs 2 processes x 4 CPU devices through the launcher: every step assembles
a batch, prints ``returned STEP``, runs a jitted sum over it (a collective across both
processes) and prints ``computed STEP``. The change comes at step 15, after ``PERIOD`` steps of
one layout (the steady case, where an agreement arrives unflagged).

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


def _raised_in_the_call(result, text: str, last: int) -> None:
    """Every process returned and computed steps 1..last, and raised in the next call."""
    assert result.returncode != 0, text
    assert not result.timed_out, text
    steps = list(range(1, last + 1))
    assert _steps_seen(result, "returned") == [steps] * 2, text
    assert _steps_seen(result, "computed") == [steps] * 2, text
    for rank in result.ranks:
        # Its own traceback, or (slower to raise than the other was to fail) the other's
        # failure notice, which quotes the error's first line: never a later call's words.
        assert "meshkit.global_array_from_local: processes disagree" in rank.stderr, text
        assert "checked after it returned" not in rank.stderr, text


def test_one_process_changes_its_layout():
    result, text = _run("one")
    _raised_in_the_call(result, text, CHANGE - 1)
    said = result.report + "".join(r.stderr for r in result.ranks)
    assert "processes disagree on the global shape of (the array)" in said, text
    assert "process 0: float32[8, 3] (global [16, 3]" in said, text
    assert "process 1: float32[4, 3] (global [8, 3]" in said, text
    # Two processes, one on each side: the launcher names no root cause (no majority says
    # which is wrong) and shows the first to fail.
    assert "no rank is named as the cause" in result.report, text
    assert "--- root cause:" not in result.report, text


def test_both_processes_change_differently():
    result, text = _run("both")
    _raised_in_the_call(result, text, CHANGE - 1)
    # The report holds the whole message once.
    assert result.report.count("process 0: float32[16, 3] (global [32, 3]") == 1, text
    assert result.report.count("process 1: float32[4, 3] (global [8, 3]") == 1, text


def test_a_change_together_then_one_goes_back():
    result, text = _run("back")
    # Step 15: both changed to 16 rows and agreed; step 16: process 0 went back to 8 rows.
    _raised_in_the_call(result, text, CHANGE)
    said = result.report + "".join(r.stderr for r in result.ranks)
    assert "process 0: float32[8, 3] (global [16, 3]" in said, text
    assert "process 1: float32[16, 3] (global [32, 3]" in said, text


def _caught_in_step(program, env: dict[str, str], error: str) -> None:
    """Both processes raise ``error`` at step `CHANGE`, catch it, and compute every other step."""
    result = launch_in_processes(program, timeout=90, env=env)
    text = result.report + "\n" + "\n".join(r.stdout + r.stderr for r in result.ranks)
    assert result.returncode == 0, text
    steps = [s for s in range(1, STEPS + 1) if s != CHANGE]
    assert _steps_seen(result, "computed") == [steps] * 2, text
    for rank in result.ranks:
        raised = re.findall(r"^raised (\d+) (.*)$", rank.stdout, re.MULTILINE)
        assert [int(step) for step, _ in raised] == [CHANGE], text
        assert raised[0][1].startswith(error), text
        # Every step computed the sum of its own data: 16 rows of 3 values `step`.
        values = re.findall(r"^computed (\d+) (\S+)$", rank.stdout, re.MULTILINE)
        assert all(float(v) == 48.0 * int(s) for s, v in values), values


def test_a_process_that_catches_the_error_and_goes_on_stays_in_step():
    # Process 1 changes at step 15; both raise in that call, catch it and go on: the next
    # steps meet the same steps of the other process, and every sum is its own step's data.
    _caught_in_step(
        ranks.caught,
        FAST,
        "meshkit.global_array_from_local: processes disagree on the global shape",
    )


def test_in_debug_mode_a_call_checked_before_it_runs_keeps_the_processes_in_step():
    # The same under debug mode, with spmd steps: every call's fingerprint is agreed on before
    # it runs, so both processes raise in the step-15 call, and neither computes it.
    env = {**FAST, "MESHKIT_DEBUG": "1", "MESHKIT_DEBUG_TIMEOUT": "10"}
    _caught_in_step(ranks.caught_in_debug_mode, env, f"meshkit debug: call #{CHANGE} of <lambda>")


def test_threads_wait_for_their_own_changes():
    import json

    result = launch_in_processes(ranks.threads, timeout=90, env=FAST)
    text = result.report + "\n" + "\n".join(r.stdout + r.stderr for r in result.ranks)
    assert result.returncode == 0, text  # each thread caught its own error: the barrier passes
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

    # Thread b changed in process 1 at its call 15: both processes' thread b raised there.
    for process in (0, 1):
        assert returned(process, "b") == list(range(1, CHANGE)), text
        assert "global_array_from_local: processes disagree" in error(process, "b"), text
        # Thread a agrees everywhere, on a channel of its own: it made every call.
        assert returned(process, "a") == list(range(1, STEPS + 1)), text
        assert error(process, "a") == "", text
