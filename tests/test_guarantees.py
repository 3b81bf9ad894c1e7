"""The guarantees of docs/guarantees.md, one multi-process test per failure class.

Each test runs 2 processes x 4 CPU devices on a program of `guarantee_programs/failures.py`,
which prints every number it computes across processes. Each asserts the error's parts (its
type, the processes it names, the program's line it is raised at) and that no process printed
a wrong number before it: each process either prints the right value or stops with the error.
Where a guarantee stops (a case no check sees), docs/guarantees.md says so.

Classes whose processes stay in step (replicas, programs) run in the module's warm cluster;
those that end the run (a failure raised uncaught, a kill, a notice, a stall) in fresh ones,
all launched at once when the module starts (most of their time is waiting: for a timeout, a
stall's deadline, a notice), each test then reading its own run.
"""

from __future__ import annotations

import inspect
import os
import re
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import processes_with_marker, said
from guarantee_programs import failures

from meshkit.testing import launch_in_processes

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.waits,  # for timeouts, a stall's deadline, a notice
    pytest.mark.warm_cluster(num_processes=2, devices_per_process=4, timeout=120),
]

PROGRAM = Path(failures.__file__)
FAST = {"MESHKIT_CHECK_TIMEOUT": "20"}
STEP = 8.0  # every step's psum: a 1.0 on each of the 8 devices


def _line(mark: str) -> int:
    """The line of the programs file marked ``# user line: mark``."""
    lines = PROGRAM.read_text().splitlines()
    (found,) = [i for i, text in enumerate(lines, 1) if text.endswith(f"# user line: {mark}")]
    return found


def _printed(text: str, word: str) -> list[tuple[int | None, float]]:
    """The numbers a rank printed after ``word``: ``STEP 3 8.0`` -> (3, 8.0), ``AFTER 80.0``
    -> (None, 80.0)."""
    out = []
    for line in said(text, word + " "):
        parts = line.split()
        out.append((int(parts[1]), float(parts[2])) if len(parts) == 3 else (None, float(parts[1])))
    return out


def _raised_at(stderr: str, mark: str, function: str, error: str) -> None:
    """``error`` (its type and first line) came out of the program at the line marked ``mark``."""
    frame = f'{PROGRAM}", line {_line(mark)}, in {function}\n'
    assert frame in stderr, stderr
    assert error in stderr.split(frame, 1)[1], stderr


def _launch(program, env: dict[str, str], limit: float = 90):
    """Run ``program`` in fresh processes; it must end (not time out) within ``limit`` s."""
    start = time.monotonic()
    result = launch_in_processes(program, timeout=limit + 30, env=env)
    took = time.monotonic() - start
    text = result.report + "\n".join(
        f"--- rank {r.rank}\n{r.stdout}{r.stderr}" for r in result.ranks
    )
    assert not result.timed_out, text
    assert took < limit, f"took {took:.0f} s\n{text}"
    return result, text


# Stall detection under the defaults, with a 6 s deadline (the report after 1.2 s).
STALL = {"MESHKIT_STALL_TIMEOUT": "6"}

# The runs in fresh processes: a name for each, its program and its settings.
FRESH = {
    "shape": (failures.shape_mismatch, FAST),
    "compiled alone": (
        failures.only_process_0_runs_a_compiled_step,
        {"MESHKIT_CHECK_TIMEOUT": "5"},
    ),
    "compiled alone, debug": (
        failures.only_process_0_runs_a_compiled_step,
        {"MESHKIT_DEBUG": "1", "MESHKIT_DEBUG_TIMEOUT": "10", "MESHKIT_CHECK_TIMEOUT": "5"},
    ),
    "loop": (failures.loop_left_early, FAST),
    "dies": (failures.process_dies, FAST),
    "preempted": (failures.preempted, FAST),
    "stuck": (failures.stuck, STALL),
}


def _selected(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a test of this module that pytest will run takes ``fixture`` as an argument."""
    return any(
        item.module is request.module and fixture in inspect.signature(item.function).parameters
        for item in request.session.items
        if isinstance(item, pytest.Function)
    )


@pytest.fixture(scope="module", autouse=True)
def fresh_runs(request: pytest.FixtureRequest):
    """Every fresh run the selected tests read, launched at once when the module starts, and
    the warm cluster started meanwhile; each test waits for its own run.

    The runs' processes carry a marker of their own: none may outlive the module.
    """
    marker = uuid.uuid4().hex
    with ThreadPoolExecutor(len(FRESH)) as pool:
        runs = {
            name: pool.submit(_launch, program, {**env, "MESHKIT_TEST_MARKER": marker})
            for name, (program, env) in (FRESH.items() if _selected(request, "fresh_runs") else ())
        }
        if _selected(request, "warm_cluster"):
            request.getfixturevalue("warm_cluster")  # starts while the fresh runs run
        yield runs
    left = processes_with_marker(marker)
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"processes left behind: {left}"


def _run(fresh_runs: dict[str, Future], name: str):
    """The fresh run called ``name``: its launch result and every line it printed."""
    return fresh_runs[name].result()


# ---- layout or shape mismatch ------------------------------------------------------------------


def test_a_layout_mismatch_raises_in_the_call_before_any_computation_on_it_completes(fresh_runs):
    # Process 1 passes 8 rows at step 15 of a steady loop, process 0 4 rows. Every call is
    # agreed before it returns: both raise at step 15's call. No step 15 is printed.
    result, text = _run(fresh_runs, "shape")
    assert result.returncode != 0, text
    error = (
        "meshkit.DivergenceError: meshkit.global_array_from_local: processes disagree on the "
        "global shape of (the array):\n"
        "  process 0: float32[4] (global [8], split over [('data',)])\n"
        "  process 1: float32[8] (global [16], split over [('data',)])\n"
    )
    raised = 0
    for rank in result.ranks:
        assert _printed(rank.stdout, "STEP") == [(k, STEP) for k in range(1, 15)], text
        assert rank.returncode != 0, text
        if "Traceback" in rank.stderr:  # its own error; else ended first by the other's
            _raised_at(rank.stderr, "shape", "shape_mismatch", error)
            raised += 1
    assert raised >= 1, text


# ---- replicated data that differs ----------------------------------------------------------------


def test_replicas_that_differ_raise_in_the_call_with_check_data(warm_cluster):
    # At call 16 process 1's replicated parameters are 2.0 where process 0's are 1.0.
    results = warm_cluster.run(failures.replicas_differ_in_a_steady_loop, "data", env=FAST)
    for computed, kind, message, line in results:
        assert computed == [4.0] * 15  # nothing computed on the call that differs
        assert kind == "MeshkitError"
        assert message.splitlines()[0] == (
            "meshkit.global_array_from_local: processes [0] vs [1] hold the same block of (the "
            "array) (starting at (0,)) as replicas, but passed different data for it."
        )
        assert line == _line("steady")


def test_replicas_that_differ_raise_in_the_call_under_the_default(warm_cluster):
    # The default check compares sampled digests of replicas before the call returns: call 16
    # raises on both processes, and nothing is computed on it.
    results = warm_cluster.run(failures.replicas_differ_in_a_steady_loop, None, env=FAST)
    for computed, kind, message, line in results:
        assert computed == [4.0] * 15
        assert kind == "MeshkitError"
        assert message.splitlines()[0] == (
            "meshkit.global_array_from_local: processes [0] vs [1] hold the same block of (the "
            "array) (starting at (0,)) as replicas, but passed different data for it."
        )
        assert line == _line("steady")


# ---- programs that differ ------------------------------------------------------------------


def test_a_computation_only_one_process_runs_is_named_before_it_runs(warm_cluster):
    # Process 0 sums the mask alone: its next compilation across processes meets process 1's
    # next, the step's. Both raise before either computation runs.
    results = warm_cluster.run(failures.only_process_0_computes, env=FAST)
    for pid, (out, kind, message, processes, field, line) in enumerate(results):
        assert out == []  # no value computed on either process
        assert kind == "DivergenceError"
        # (Counted from the warm cluster's start: earlier tests compiled programs too.)
        assert re.fullmatch(
            r"meshkit \(programs compared at compilation\): the processes compiled different "
            r"programs as their \d+(st|nd|rd|th) computation across processes:",
            message.splitlines()[0],
        ), message
        assert (processes, field) == ([0, 1], "function")
        assert line == _line("alone" if pid == 0 else "step")


def test_a_computation_only_one_process_runs_is_named_at_the_programs_lines(warm_cluster):
    results = warm_cluster.run(failures.only_process_0_computes, env=FAST)
    for _, _, message, _, _, _ in results:
        assert f"{PROGRAM.name}:{_line('alone')}" in message, message
        assert f"{PROGRAM.name}:{_line('step')}" in message, message


def test_a_compiled_computation_one_process_runs_alone_computes_nothing_wrong(fresh_runs):
    # Process 0's evaluation psum waits for process 1, whose step-16 call waits at its
    # agreement for process 0: nothing computes, and after MESHKIT_CHECK_TIMEOUT (5 s) process
    # 1's call names process 0 as missing.
    result, text = _run(fresh_runs, "compiled alone")
    assert result.returncode != 0, text
    for rank in result.ranks:
        assert _printed(rank.stdout, "STEP") == [(k, STEP) for k in range(1, 16)], text
        assert _printed(rank.stdout, "EVAL") == [], text
    said = result.report + result.ranks[1].stderr
    assert "meshkit.global_array_from_local: process 0 did not arrive within 5 s" in said, text


def test_with_debug_mode_a_compiled_computation_one_process_runs_alone_is_named_before_it_runs(
    fresh_runs,
):
    # Debug mode agrees on every meshkit call before it runs: process 0's evaluation (an spmd
    # call where process 1 makes its next global_array_from_local) raises before it runs.
    result, text = _run(fresh_runs, "compiled alone, debug")
    assert result.returncode != 0, text
    for rank in result.ranks:
        assert all(v == STEP for _, v in _printed(rank.stdout, "STEP")), text
        assert _printed(rank.stdout, "EVAL") == [], text
    message = (
        r"meshkit\.DivergenceError: meshkit debug: SPMD call #\d+ of the program: process 0 "
        r"called <lambda> \(spmd, made at failures\.py:\d+\); process 1 called "
        r"meshkit\.global_array_from_local \(global_array_from_local\)\.\n"
    )
    stderr = result.ranks[0].stderr
    frame = f'{PROGRAM}", line {_line("alone again")}, in only_process_0_runs_a_compiled_step\n'
    assert frame in stderr, stderr
    assert re.search(message, stderr.split(frame, 1)[1]), stderr


# ---- a loop left at different steps -----------------------------------------------------------


def test_a_loop_left_early_computes_nothing_wrong_on_any_process(fresh_runs):
    # Issue 43's case: rank 1 breaks after step 3 of its `with` block; a psum per step and one
    # after the loop (80.0 is right). Rank 1's psum after the loop must not meet rank 0's psum
    # of step 4 (44.0): rank 1's close() waits until rank 0 says how it left, learns that it
    # took step 4, and raises before the program computes anything after the loop.
    result, text = _run(fresh_runs, "loop")
    for rank in result.ranks:
        assert _printed(rank.stdout, "STEP") == [(k, STEP) for k in (1, 2, 3)], text
        after = _printed(rank.stdout, "AFTER")
        assert after in ([], [(None, 80.0)]), text  # never 44.0
        if not after:  # a process that printed nothing after the loop raised the error
            assert "DivergenceError: meshkit.global_batches: the processes left their loops at " \
                "different steps: " in rank.stderr, text  # fmt: skip
    assert "44.0" not in text
    # Rank 1's close() raises at its `with` line, unless rank 0's failure post (rank 0 is ended
    # at once, below) ended it first, saying the same from rank 0's side, possibly while rank 1
    # was printing its traceback (a process that raised itself is never ended by the watch).
    rank1 = result.ranks[1].stderr
    if "meshkit: process 0 failed:" not in rank1:
        _raised_at(
            rank1, "with", "loop_left_early",
            "meshkit.DivergenceError: meshkit.global_batches: the processes left their loops at "
            "different steps: this process (process 1) closed its iterator after step 3, but "
            "process 0 took step 4.\n",
        )  # fmt: skip
    else:
        assert (
            "meshkit: process 0 failed: DivergenceError: meshkit.global_batches: the processes "
            "left their loops at different steps: process 1 after step 3 closed its iterator, but "
            "this process (process 0) took step 4 already" in rank1
        ), text
    # Rank 0 waits in step 4's psum, which rank 1 will not join: its close watch hears rank 1's
    # close and ends it at once (or rank 1's failure post does, naming rank 1).
    rank0 = result.ranks[0].stderr
    assert "meshkit: process 0 stops inside step 4 of meshkit.global_batches" in rank0 or (
        "cannot go on without process 1" in rank0 and "Process 1's output holds the cause." in rank0
    ), text
    assert [r.returncode for r in result.ranks] != [0, 0], text


# ---- a process that dies ------------------------------------------------------------------


def test_a_process_that_dies_ends_the_others_before_they_compute_on(fresh_runs):
    # Process 1 is killed (SIGKILL) before step 4; process 0 waits in step 4's psum. The
    # launcher sees the death and stops process 0.
    result, text = _run(fresh_runs, "dies")
    assert result.returncode != 0, text
    assert result.first_failure == 1, text
    assert "rank 1 failed first (killed by SIGKILL)" in result.report, text
    assert result.ranks[1].returncode == -9, text
    for rank in result.ranks:
        assert _printed(rank.stdout, "STEP") == [(k, STEP) for k in (1, 2, 3)], text
    stopped = result.attempts[-1].stopped_s
    assert stopped is not None, text
    assert stopped < 10, text


# ---- a preemption notice ------------------------------------------------------------------


def test_a_preemption_notice_saves_at_one_step_on_every_process_and_ends_143(fresh_runs):
    # Process 1 receives SIGTERM after step 5. `should_save` says yes at the same step on both,
    # which then end with status 143, as a save after a notice ends them.
    result, text = _run(fresh_runs, "preempted")
    saved = {r.rank: _printed(r.stdout, "SAVE") for r in result.ranks}
    assert set(saved) == {0, 1}, text
    ((_, step),) = saved[0]
    assert saved[1] == saved[0], text
    assert step >= 6, text  # the step after the last one any process asked about
    for rank in result.ranks:
        assert rank.returncode == 143, text
        assert _printed(rank.stdout, "STEP") == [(k, STEP) for k in range(1, int(step) + 1)], text
    assert result.preempted, text
    assert result.returncode == 143, text
    assert result.report.startswith(
        f"meshkit launch: preempted: the notice (SIGTERM to rank 1) reached every rank at step "
        f"{int(step)}."
    ), text


# ---- a stuck process ----------------------------------------------------------------------

# Under the defaults, every process says which one holds the run, and the run ends.


def test_a_stuck_process_is_named_by_every_process_and_the_run_ends(fresh_runs):
    result, text = _run(fresh_runs, "stuck")
    assert result.returncode == 1, text
    for rank in result.ranks:
        assert _printed(rank.stdout, "STEP") == [(k, STEP) for k in (1, 2, 3, 4)], text
        said = rank.stderr
        assert "Process 1 holds the run: the others wait for a collective" in said, text
        # Process 1 in its own code, at the line that blocks; process 0 in step 5's psum.
        stuck = f"{PROGRAM}:{_line('stuck')} in stuck, in wait (threading.py:"
        assert f"  process 1 is in Python at {stuck}" in said, text
        waits = f"{PROGRAM}:{_line('waits')} in stuck, in "
        assert f"  process 0 waits for device results at {waits}" in said, text
        assert said.count("), step 5 of should_save\n") == 2, text  # the step each asked
        assert "Process 1's main thread (most recent call last):" in said, text
    assert "The evidence points to rank 1: the run stalled" in result.report, text
    summary = result.report.split("Where each rank was when the run stalled:", 1)[1]
    assert re.search(r"rank 0: no progress for \d+ s; .*, waiting for device results", summary)
    assert re.search(r"rank 1: no progress for \d+ s; .*, in Python", summary), summary
