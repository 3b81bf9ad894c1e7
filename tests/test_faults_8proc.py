"""Fault injection at 8 processes: the faults of test_faults.py, named among many processes.

Every case runs 8 processes x 1 CPU device through the launcher and must end well within its
time limit, exit non-zero, name the process at fault, and leave no process behind (the
``marker`` fixture checks the last). With 8 processes a majority agrees, so the message names
the one process outside it. Debug mode (``MESHKIT_DEBUG=1``) is on unless the case says
otherwise, with short timeouts. Deselect with ``-k "not 8proc"`` (or ``-m "not multiprocess"``).

The functions starting with an underscore run inside the launched processes.
"""

from __future__ import annotations

import time

import pytest

import meshkit
from meshkit.testing import launch_in_processes

pytestmark = pytest.mark.multiprocess

DEBUG = {"MESHKIT_DEBUG": "1", "MESHKIT_DEBUG_TIMEOUT": "8", "MESHKIT_WATCHDOG": "3"}
NUM_PROCESSES = 8
LIMIT_S = 90  # 8 processes start in 10-20 s on 2 cores; the faults add about 10 s at most
STEPS = 5


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _failed(target, env=DEBUG):
    """Launch 8 processes, check the run failed within the limit, return result and all output."""
    start = time.monotonic()
    result = launch_in_processes(
        target,
        num_processes=NUM_PROCESSES,
        devices_per_process=1,
        timeout=LIMIT_S + 30,
        env=env,
    )
    took = time.monotonic() - start
    text = result.report + "\n" + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    assert not result.timed_out, text
    assert took < LIMIT_S, f"took {took:.0f} s\n{text}"
    return result, text


def _step_fn():
    import jax.numpy as jnp

    from meshkit import collectives as C

    mesh = meshkit.make_mesh({"data": -1})
    step = meshkit.spmd(lambda x: C.psum(x, "data"), mesh=mesh, in_specs="data", out_specs="")
    return mesh, step, jnp


# ---- bodies run in the launched processes -------------------------------------------------


def _shape_mismatch():
    import jax

    _, step, jnp = _step_fn()
    for call in range(1, STEPS + 1):
        rows = 16 if call == 2 and jax.process_index() == 5 else 8
        step(jnp.ones((rows, 4))).block_until_ready()


def _one_missing():
    import jax

    _, step, jnp = _step_fn()
    for call in range(1, STEPS + 1):
        if call == 2 and jax.process_index() == 3:
            time.sleep(600)  # alive, stuck: the other 7 wait at call #2
        step(jnp.ones((8, 4))).block_until_ready()


def _two_functions():
    import jax

    from meshkit import collectives as C

    mesh, step, jnp = _step_fn()

    def evaluate(x):
        return C.pmax(x, "data")

    other = meshkit.spmd(evaluate, mesh=mesh, in_specs="data", out_specs="")
    for call in range(1, STEPS + 1):
        fn = other if call == 2 and jax.process_index() == 6 else step
        fn(jnp.ones((8, 4))).block_until_ready()


def _global_shape_mismatch():
    import jax
    import numpy as np

    mesh = meshkit.make_mesh({"data": -1})
    for call in range(1, STEPS + 1):
        rows = 4 if call == 3 and jax.process_index() == 5 else 8
        meshkit.global_array_from_local(np.ones((rows, 3), np.float32), mesh, "data")
    meshkit.barrier("end")  # a sync point: raises what the deferred check found, if not yet


# ---- the cases ----------------------------------------------------------------------------


def test_8proc_shape_mismatch_names_the_one_process():
    _, text = _failed(_shape_mismatch)
    assert "DivergenceError" in text, text
    # Seven processes agree: the message names process 5 alone, with both shapes.
    assert (
        "call #2 of <lambda>: process 5 passed x float32[16,4]; "
        "processes 0,1,2,3,4,6,7 passed float32[8,4]." in text
    ), text
    assert "consider the data pipeline of process 5" in text, text
    assert "no majority" not in text, text


def test_8proc_missing_process_is_named_within_the_timeout():
    result, text = _failed(_one_missing)
    assert "call #2 of <lambda>" in text, text
    assert "process 3 did not arrive within 8 s (its last call was #1 of <lambda>" in text, text
    assert "Processes 0,1,2,4,5,6,7 made this call" in text, text
    # The watchdog fired before the timeout: the sleeping process shows where it sleeps.
    assert "rank 3: meshkit watchdog: process 3 made no progress" in result.report, text
    assert "in _one_missing" in result.report, text
    # Start-up (10-20 s on 2 cores) plus the 8 s timeout, not the launcher's limit.
    assert result.elapsed < 60, f"took {result.elapsed:.0f} s\n{text}"


def test_8proc_different_function_names_both_functions():
    _, text = _failed(_two_functions)
    assert "DivergenceError" in text, text
    # make_mesh is SPMD call #1 of the program, the first step #2: step 2 is #3.
    assert (
        "SPMD call #3 of the program: process 6 called evaluate (spmd, made at "
        "test_faults_8proc.py:" in text
    ), text
    assert "processes 0,1,2,3,4,5,7 called <lambda> (spmd, made at test_faults_8proc.py:" in text
    assert "process 6: call #1 of evaluate" in text, text


def test_8proc_global_array_from_local_shape_mismatch_without_debug():
    _, text = _failed(_global_shape_mismatch, env={"MESHKIT_DEBUG": "0"})
    assert "DivergenceError" not in text, text  # the default check, not debug mode, found it
    assert (
        "meshkit.global_array_from_local (call #3, checked after it returned): processes "
        "disagree on the global shape of (the array):" in text
    ), text
    assert "processes 0,1,2,3,4,6,7: float32[8, 3] (global [64, 3]" in text, text
    assert "process 5: float32[4, 3] (global [32, 3]" in text, text
    assert "for an uneven last batch pass pad=True" in text, text
