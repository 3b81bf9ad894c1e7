"""Fault injection: each way a multi-process program goes wrong ends in a clear error, fast.

Every case runs 2 processes x 4 CPU devices through the launcher (the ``test_8proc_`` cases
8 processes x 1 CPU device) and must end within 60 s (90 s), exit non-zero, name the processes
involved, and leave no process behind (the ``marker`` fixture checks the last). Debug mode (``MESHKIT_DEBUG=1``) is on unless the case says otherwise,
with short timeouts so that the suite takes seconds per case.

What the launched processes run is in `ranks/faults.py`.
"""

from __future__ import annotations

import re
import socket
import sys
import time

import pytest
from ranks import faults as ranks

import meshkit
from meshkit.testing import launch_in_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]

DEBUG = {"MESHKIT_DEBUG": "1", "MESHKIT_DEBUG_TIMEOUT": "8", "MESHKIT_WATCHDOG": "3"}
LIMIT_S = 60


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _failed(target, env=DEBUG, *, limit=LIMIT_S, **kwargs):
    """Launch, check the run failed within ``limit`` s, return the launcher's whole report."""
    start = time.monotonic()
    result = launch_in_processes(target, timeout=limit + 30, env=env, **kwargs)
    took = time.monotonic() - start
    text = result.report + "\n" + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    assert not result.timed_out, text
    assert took < limit, f"took {took:.0f} s\n{text}"
    return result, text


# ---- the cases ----------------------------------------------------------------------------


def test_rank_killed_mid_step_is_named_by_the_launcher():
    result, text = _failed(ranks.killed_mid_step)
    assert result.first_failure == 1, text
    assert "rank 1 failed first (killed by SIGKILL)" in result.report, text


def test_rank_stalled_in_python_is_named_with_its_last_call_and_stack():
    # A 3 s watchdog: the stall is reported at 3 s (a sample later under load) and would end
    # the run at 11 s, after the others name the sleeping process at their 8 s timeout.
    result, text = _failed(ranks.stalled_in_python, env={**DEBUG, "MESHKIT_WATCHDOG": "3"})
    assert "call #3 of" in text, text
    assert "process 1 did not arrive within 8 s" in text, text
    assert "its last call was #2 of" in text, text
    # The stall was reported before the timeout: every process names the sleeping one.
    assert "Process 1 holds the run" in result.ranks[0].stderr, text
    summary = result.report.split("Where each rank was when the run stalled:", 1)[1]
    # Where each waited: process 0 at its meshkit call, process 1 in its own code.
    assert re.search(r"rank 0: .*, inside a meshkit call", summary), summary
    # Process 1 reports at its own next sample: it may be ended by process 0's timeout first.
    assert re.search(r"rank 1: .* in stalled_in_python, in Python", summary) or (
        "(no stall report from rank 1)" in summary
    ), summary
    assert "--- root cause: rank 1 ---" in result.report, result.report


def test_shape_mismatch_names_the_process_and_the_argument():
    _result, text = _failed(ranks.shape_mismatch)
    assert "DivergenceError" in text, text
    assert (
        "call #2 of <lambda>: process 0 passed x float32[8,4]; process 1 passed float32[16,4]."
        in text
    ), text
    assert "no majority says which is wrong" in text, text


def test_two_different_functions_name_both():
    _, text = _failed(ranks.two_functions)
    assert "DivergenceError" in text, text
    assert (
        "SPMD call #2 of the program: process 0 called <lambda> (spmd, made at faults.py:" in text
    ), text
    assert "process 1 called evaluate (spmd, made at faults.py:" in text, text


def test_leaving_the_loop_one_step_early_is_reported_at_once():
    result, text = _failed(ranks.last_batch_exit)
    assert "process 1 ended its program (normal exit) after call #4 of" in text, text
    # Reported from the exit record, not after the 8 s timeout.
    assert result.elapsed < 30, text


def test_mesh_disagreement_names_both_meshes():
    _, text = _failed(ranks.mesh_disagreement)
    assert (
        "call #1 of meshkit.make_mesh: process 0 passed axes static 'data=4,model=2'; "
        "process 1 passed static 'data=2,model=4'." in text
    ), text
    assert "Static arguments (and make_mesh's axes) must be equal" in text, text


def test_set_iteration_order_divergence_is_caught():
    # Each rank runs with its own hash seed: the same set iterates in a different order.
    _, text = _failed(ranks.set_order, init=False)
    assert "DivergenceError" in text, text
    # One lambda line made the four functions: they differ by the order they were made in.
    # Seed 1 calls "sum" (made first) first, seed 2 "mean" (made fourth).
    assert re.search(
        r"process 0 called <lambda> \(spmd, made at faults.py:(\d+)\); "
        r"process 1 called <lambda> \(spmd, made at faults.py:\1 #4\)",
        text,
    ), text


def test_pmap_compat_shape_mismatch_is_caught():
    _, text = _failed(ranks.pmap_shape_mismatch)
    assert "call #1 of" in text, text
    assert "process 0 passed x float32[4,2]; process 1 passed float32[4,3]." in text, text


def test_global_batches_background_thread_raises_no_false_alarm():
    result = launch_in_processes(ranks.batches_thread_no_false_alarm, timeout=120, env=DEBUG)
    assert result.returncode == 0, result.report
    # 20 steps; step i sums 8 rows of 4 values i: 32 i.
    assert result.values == [32.0 * sum(range(20))] * 2, result.values


def test_stall_in_a_raw_collective_ends_through_the_stall_deadline():
    result, text = _failed(ranks.raw_collective_stall)
    assert "Process 1 holds the run" in text, text
    assert re.search(r"process 0 waits for device results at \S*faults.py:\d+ in raw_", text)
    assert "ends with status 1 (debug mode: watchdog 3 s + timeout 8 s)" in text, text
    assert "The evidence points to rank 1: the run stalled" in result.report, text


def test_coordinator_port_taken_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(meshkit.LaunchError, match=f"port {port}"):
            meshkit.launch([sys.executable, "-c", "pass"], num_processes=2, port=port)


def test_coordinator_port_taken_under_another_launcher_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result, text = _failed(
            ranks.coordinator_port_taken, env={"TAKEN_PORT": str(port)}, init=False
        )
    assert result.first_failure == 0, text
    assert f"port {port} is already in\nuse on this host" in text, text


@pytest.mark.parametrize("debug", [True, False], ids=["debug-on", "debug-off"])
def test_soak_2000_steps(debug):
    # 2000 checked calls, each an agreement of the host argument through the coordination
    # service (the sequence, its key blocks and their deletion) and a collective across the
    # processes. One CPU device per process: the agreements and the collective across processes
    # are the same, and each step costs a third of its CPU time on four devices (measured:
    # 13 and 17 CPU-s for both processes, against 34 and 39).
    env = dict(DEBUG) if debug else {"MESHKIT_DEBUG": "0"}
    result = launch_in_processes(ranks.soak_on, timeout=240, env=env, devices_per_process=1)
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode == 0, text
    # Each process passes arange(32).reshape(8, 4) as its own 8 rows of a global batch of 16:
    # the psum over all 16 rows, summed, is 2 * 496 on every process.
    assert result.values == [(992.0, debug, 0), (992.0, debug, 1)], text


# ---- 8 processes x 1 CPU device: the faults named among many -----------------------------------
# Start-up takes 10-20 s on 2 cores; each case must end within 90 s. With 8 processes a majority
# agrees, so messages name the one process outside it.

EIGHT = {"num_processes": 8, "devices_per_process": 1, "limit": 90}


def test_8proc_shape_mismatch_names_the_one_process():
    _, text = _failed(ranks.eight_shape_mismatch, **EIGHT)
    assert "DivergenceError" in text, text
    assert (
        "call #2 of <lambda>: process 5 passed x float32[16,4]; "
        "processes 0,1,2,3,4,6,7 passed float32[8,4]." in text
    ), text
    assert "consider the data pipeline of process 5" in text, text
    assert "no majority" not in text, text


def test_8proc_missing_process_is_named_within_the_timeout():
    # The stall verdict (watchdog 3 s) needs all eight processes' records before the timeout;
    # 12 s leaves room for eight processes sharing 2 cores with the rest of the suite.
    env = {**DEBUG, "MESHKIT_DEBUG_TIMEOUT": "12"}
    result, text = _failed(ranks.eight_one_missing, env, **EIGHT)
    assert "call #2 of <lambda>" in text, text
    assert "process 3 did not arrive within 12 s (its last call was #1 of <lambda>" in text, text
    assert "Processes 0,1,2,4,5,6,7 made this call" in text, text
    # The stall was reported before the timeout: the sleeping process shows where it sleeps.
    pattern = r"rank 3: no progress for \d+ s; .* in eight_one_missing, in Python"
    assert re.search(pattern, text), text
    assert result.elapsed < 60, f"took {result.elapsed:.0f} s\n{text}"


def test_8proc_different_function_names_both_functions():
    _, text = _failed(ranks.eight_two_functions, **EIGHT)
    assert "DivergenceError" in text, text
    # make_mesh is SPMD call #1 of the program, the first step #2: step 2 is #3.
    assert re.search(
        r"SPMD call #3 of the program: process 6 called evaluate \(spmd, made at "
        r"faults.py:\d+\); processes 0,1,2,3,4,5,7 called <lambda> \(spmd, made at "
        r"faults.py:\d+\)",
        text,
    ), text
    assert "process 6: call #1 of evaluate" in text, text


def test_8proc_global_array_from_local_shape_mismatch_without_debug():
    _, text = _failed(ranks.eight_global_shape_mismatch, env={"MESHKIT_DEBUG": "0"}, **EIGHT)
    assert "SPMD call" not in text, text  # the default check, not debug mode, found it
    assert (
        "meshkit.global_array_from_local: processes disagree on the global shape of "
        "(the array):" in text
    ), text
    assert "processes 0,1,2,3,4,6,7: float32[8, 3] (global [64, 3]" in text, text
    assert "process 5: float32[4, 3] (global [32, 3]" in text, text
    assert "for an uneven last batch (the end of the data), pass pad=True" in text, text
    # Seven processes against one: the report names process 5.
    assert "The evidence points to rank 5" in text, text
