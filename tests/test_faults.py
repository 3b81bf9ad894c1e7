"""Fault injection: each way a multi-process program goes wrong ends in a clear error, fast.

Every case runs 2 processes x 4 CPU devices through the launcher (the ``test_8proc_`` cases
8 processes x 1 CPU device) and must end within 60 s (90 s), exit non-zero, name the processes
involved, and leave no process behind (the ``marker`` fixture checks the last). Debug mode (``MESHKIT_DEBUG=1``) is on unless the case says otherwise,
with short timeouts so that the suite takes seconds per case.

The functions starting with an underscore run inside the launched processes.
"""

from __future__ import annotations

import re
import socket
import sys
import time

import pytest

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


def _step_fn():
    import jax.numpy as jnp

    from meshkit import collectives as C

    mesh = meshkit.make_mesh({"data": -1})
    step = meshkit.spmd(lambda x: C.psum(x, "data"), mesh=mesh, in_specs="data", out_specs="")
    return mesh, step, jnp


# ---- bodies run in the launched processes -------------------------------------------------


def _killed_mid_step():
    import os
    import signal

    import jax

    _, step, jnp = _step_fn()
    for i in range(100):
        if i == 3 and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        step(jnp.ones((8, 4))).block_until_ready()


def _stalled_in_python():
    import jax

    _, step, jnp = _step_fn()
    for i in range(10):
        if i == 2 and jax.process_index() == 1:
            time.sleep(600)  # alive, stuck: the others wait at call #3
        step(jnp.ones((8, 4))).block_until_ready()


def _shape_mismatch():
    import jax

    _, step, jnp = _step_fn()
    step(jnp.ones((8, 4))).block_until_ready()
    rows = 8 if jax.process_index() == 0 else 16
    step(jnp.ones((rows, 4))).block_until_ready()


def _two_functions():
    import jax

    from meshkit import collectives as C

    mesh, step, jnp = _step_fn()

    def evaluate(x):
        return C.pmax(x, "data")

    other = meshkit.spmd(evaluate, mesh=mesh, in_specs="data", out_specs="")
    fn = step if jax.process_index() == 0 else other
    fn(jnp.ones((8, 4))).block_until_ready()


def _last_batch_exit():
    import jax

    _, step, jnp = _step_fn()
    steps = 5 if jax.process_index() == 0 else 4  # process 1's loader is one batch short
    for _ in range(steps):
        step(jnp.ones((8, 4))).block_until_ready()


def _mesh_disagreement():
    import jax

    shape = {"data": 4, "model": 2} if jax.process_index() == 0 else {"data": 2, "model": 4}
    meshkit.make_mesh(shape)


def _set_order():
    import os

    # Seeds 1 and 2 order this set differently (checked: sum,min,max,mean and mean,sum,min,max).
    rank = str(int(os.environ["MESHKIT_PROCESS_ID"]) + 1)
    if os.environ.get("PYTHONHASHSEED") != rank:
        # The hash seed is read at start-up: start this rank again with its own (same pid, so
        # the launcher still owns it; before joining the cluster, so nobody notices).
        os.environ["PYTHONHASHSEED"] = rank
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    meshkit.init()
    from meshkit import collectives as C

    mesh, _, jnp = _step_fn()
    fns = {
        name: meshkit.spmd(lambda x, op=op: op(x, "data"), mesh=mesh, in_specs="data", out_specs="")
        for name, op in (("sum", C.psum), ("max", C.pmax), ("min", C.pmin), ("mean", C.pmean))
    }
    for name in {"sum", "max", "min", "mean", "alpha", "beta"} & set(fns):  # per-process order
        fns[name](jnp.ones((8, 4))).block_until_ready()


def _raw_collective_stall():
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh, step, jnp = _step_fn()
    step(jnp.ones((8, 4))).block_until_ready()
    x = jax.make_array_from_callback(
        (8, 4), NamedSharding(mesh, P("data")), lambda idx: np.ones((8, 4))[idx]
    )
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
    total(x).block_until_ready()  # both: compiled, and the programs compared, once
    if jax.process_index() == 1:
        time.sleep(600)
    # Process 0 waits inside a raw jax.jit collective (compiled already: nothing is compared
    # any more), where no meshkit check can see it.
    total(x).block_until_ready()


def _pmap_shape_mismatch():
    import jax
    import numpy as np

    from meshkit import collectives as C

    step = meshkit.pmap_compat(lambda x: C.psum(x, "i"), axis_name="i")
    width = 3 if jax.process_index() == 1 else 2
    step(np.ones((jax.local_device_count(), width), np.float32)).block_until_ready()


def _batches_thread_no_false_alarm():
    import jax
    import numpy as np

    mesh, step, _ = _step_fn()
    rows = 4 * jax.process_count()  # the global batch: 4 rows per process, one per device
    loader = (np.full((4, 4), i, np.float32) for i in range(20))
    total = 0.0
    # global_batches assembles in its own thread while the main thread steps: the checks of
    # the two threads are kept apart by thread name, so their interleaving raises nothing.
    for batch in meshkit.global_batches(loader, mesh, "data"):
        assert batch.shape == (rows, 4)
        total += float(np.asarray(step(batch)).sum())
    return total


def _coordinator_port_taken():
    import os

    # As under a cluster launcher that picked a port some other program holds.
    os.environ["MESHKIT_COORDINATOR"] = "127.0.0.1:" + os.environ["TAKEN_PORT"]
    meshkit.init()


def _soak(steps: int = 2000):
    import jax
    import numpy as np

    _, step, jnp = _step_fn()
    x = jnp.arange(32.0).reshape(8, 4)
    total = None
    for i in range(steps):
        out = step(x)
        if i % 16 == 15:  # bound the work in flight (JAX 0.10.2 on CPU deadlocks past hundreds)
            out.block_until_ready()
        total = out
    assert total is not None
    return float(np.asarray(total).sum()), meshkit.debug.enabled(), jax.process_index()


def _soak_on():
    return _soak()


# ---- the cases ----------------------------------------------------------------------------


def test_rank_killed_mid_step_is_named_by_the_launcher():
    result, text = _failed(_killed_mid_step)
    assert result.first_failure == 1, text
    assert "rank 1 failed first (killed by SIGKILL)" in result.report, text


def test_rank_stalled_in_python_is_named_with_its_last_call_and_stack():
    # A 5 s watchdog: the stalled process exits 13 s into its stall, well after the others
    # name it at their 8 s timeout (with 3 s the two raced, 11 s against 8 s plus the verdict).
    result, text = _failed(_stalled_in_python, env={**DEBUG, "MESHKIT_WATCHDOG": "5"})
    assert "call #3 of" in text, text
    assert "process 1 did not arrive within 8 s" in text, text
    assert "its last call was #2 of" in text, text
    # Both watchdogs fired before the timeout: the sleeping process shows where it sleeps.
    assert "Stall watchdog" in result.report, result.report
    assert "rank 1: meshkit watchdog: process 1 made no progress" in result.report, result.report
    assert "in _stalled_in_python" in result.report, result.report
    # Where each waited: process 0 at its meshkit call, process 1 in its own code.
    summary = result.report.split("Stall watchdog, where each rank was:", 1)[1]
    assert re.search(r"rank 0: .*, inside a meshkit call; last meshkit call", summary), summary
    assert re.search(r"rank 1: .*, outside meshkit; last meshkit call", summary), summary
    assert "--- root cause: rank 1 ---" in result.report, result.report


def test_shape_mismatch_names_the_process_and_the_argument():
    _result, text = _failed(_shape_mismatch)
    assert "DivergenceError" in text, text
    assert (
        "call #2 of <lambda>: process 0 passed x float32[8,4]; process 1 passed float32[16,4]."
        in text
    ), text
    assert "no majority says which is wrong" in text, text


def test_two_different_functions_name_both():
    _, text = _failed(_two_functions)
    assert "DivergenceError" in text, text
    assert (
        "SPMD call #2 of the program: process 0 called <lambda> (spmd, made at test_faults.py:"
        in text
    ), text
    assert "process 1 called evaluate (spmd, made at test_faults.py:" in text, text


def test_leaving_the_loop_one_step_early_is_reported_at_once():
    result, text = _failed(_last_batch_exit)
    assert "process 1 ended its program (normal exit) after call #4 of" in text, text
    # Reported from the exit record, not after the 8 s timeout.
    assert result.elapsed < 30, text


def test_mesh_disagreement_names_both_meshes():
    _, text = _failed(_mesh_disagreement)
    assert (
        "call #1 of meshkit.make_mesh: process 0 passed axes static 'data=4,model=2'; "
        "process 1 passed static 'data=2,model=4'." in text
    ), text
    assert "Static arguments (and make_mesh's axes) must be equal" in text, text


def test_set_iteration_order_divergence_is_caught():
    # Each rank runs with its own hash seed: the same set iterates in a different order.
    _, text = _failed(_set_order, init=False)
    assert "DivergenceError" in text, text
    # One lambda line made the four functions: they differ by the order they were made in.
    # Seed 1 calls "sum" (made first) first, seed 2 "mean" (made fourth).
    assert re.search(
        r"process 0 called <lambda> \(spmd, made at test_faults.py:(\d+)\); "
        r"process 1 called <lambda> \(spmd, made at test_faults.py:\1 #4\)",
        text,
    ), text


def test_pmap_compat_shape_mismatch_is_caught():
    _, text = _failed(_pmap_shape_mismatch)
    assert "call #1 of" in text, text
    assert "process 0 passed x float32[4,2]; process 1 passed float32[4,3]." in text, text


def test_global_batches_background_thread_raises_no_false_alarm():
    result = launch_in_processes(_batches_thread_no_false_alarm, timeout=120, env=DEBUG)
    assert result.returncode == 0, result.report
    # 20 steps; step i sums 8 rows of 4 values i: 32 i.
    assert result.values == [32.0 * sum(range(20))] * 2, result.values


def test_stall_in_a_raw_collective_ends_through_the_watchdog():
    _result, text = _failed(_raw_collective_stall)
    assert "meshkit watchdog: process 0 made no progress" in text, text
    assert re.search(r"process 0 made no progress .*, outside meshkit; last meshkit call", text)
    assert "exiting with status 1" in text, text


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
        result, text = _failed(_coordinator_port_taken, env={"TAKEN_PORT": str(port)}, init=False)
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
    result = launch_in_processes(_soak_on, timeout=240, env=env, devices_per_process=1)
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode == 0, text
    # Each process passes arange(32).reshape(8, 4) as its own 8 rows of a global batch of 16:
    # the psum over all 16 rows, summed, is 2 * 496 on every process.
    assert result.values == [(992.0, debug, 0), (992.0, debug, 1)], text


# ---- 8 processes x 1 CPU device: the faults named among many -----------------------------------
# Start-up takes 10-20 s on 2 cores; each case must end within 90 s. With 8 processes a majority
# agrees, so messages name the one process outside it.

EIGHT = {"num_processes": 8, "devices_per_process": 1, "limit": 90}
EIGHT_STEPS = 5


def _eight_shape_mismatch():
    import jax

    _, step, jnp = _step_fn()
    for call in range(1, EIGHT_STEPS + 1):
        rows = 16 if call == 2 and jax.process_index() == 5 else 8
        step(jnp.ones((rows, 4))).block_until_ready()


def _eight_one_missing():
    import jax

    _, step, jnp = _step_fn()
    for call in range(1, EIGHT_STEPS + 1):
        if call == 2 and jax.process_index() == 3:
            time.sleep(600)  # alive, stuck: the other 7 wait at call #2
        step(jnp.ones((8, 4))).block_until_ready()


def _eight_two_functions():
    import jax

    from meshkit import collectives as C

    mesh, step, jnp = _step_fn()

    def evaluate(x):
        return C.pmax(x, "data")

    other = meshkit.spmd(evaluate, mesh=mesh, in_specs="data", out_specs="")
    for call in range(1, EIGHT_STEPS + 1):
        fn = other if call == 2 and jax.process_index() == 6 else step
        fn(jnp.ones((8, 4))).block_until_ready()


def _eight_global_shape_mismatch():
    import jax
    import numpy as np

    mesh = meshkit.make_mesh({"data": -1})
    for call in range(1, EIGHT_STEPS + 1):
        rows = 4 if call == 3 and jax.process_index() == 5 else 8
        meshkit.global_array_from_local(np.ones((rows, 3), np.float32), mesh, "data")
    meshkit.barrier("end")


def test_8proc_shape_mismatch_names_the_one_process():
    _, text = _failed(_eight_shape_mismatch, **EIGHT)
    assert "DivergenceError" in text, text
    assert (
        "call #2 of <lambda>: process 5 passed x float32[16,4]; "
        "processes 0,1,2,3,4,6,7 passed float32[8,4]." in text
    ), text
    assert "consider the data pipeline of process 5" in text, text
    assert "no majority" not in text, text


def test_8proc_missing_process_is_named_within_the_timeout():
    result, text = _failed(_eight_one_missing, **EIGHT)
    assert "call #2 of <lambda>" in text, text
    assert "process 3 did not arrive within 8 s (its last call was #1 of <lambda>" in text, text
    assert "Processes 0,1,2,4,5,6,7 made this call" in text, text
    # The watchdog fired before the timeout: the sleeping process shows where it sleeps.
    assert "rank 3: meshkit watchdog: process 3 made no progress" in result.report, text
    assert "in _eight_one_missing" in result.report, text
    assert result.elapsed < 60, f"took {result.elapsed:.0f} s\n{text}"


def test_8proc_different_function_names_both_functions():
    _, text = _failed(_eight_two_functions, **EIGHT)
    assert "DivergenceError" in text, text
    # make_mesh is SPMD call #1 of the program, the first step #2: step 2 is #3.
    assert re.search(
        r"SPMD call #3 of the program: process 6 called evaluate \(spmd, made at "
        r"test_faults.py:\d+\); processes 0,1,2,3,4,5,7 called <lambda> \(spmd, made at "
        r"test_faults.py:\d+\)",
        text,
    ), text
    assert "process 6: call #1 of evaluate" in text, text


def test_8proc_global_array_from_local_shape_mismatch_without_debug():
    _, text = _failed(_eight_global_shape_mismatch, env={"MESHKIT_DEBUG": "0"}, **EIGHT)
    assert "DivergenceError" not in text, text  # the default check, not debug mode, found it
    assert (
        "meshkit.global_array_from_local: processes disagree on the global shape of "
        "(the array):" in text
    ), text
    assert "processes 0,1,2,3,4,6,7: float32[8, 3] (global [64, 3]" in text, text
    assert "process 5: float32[4, 3] (global [32, 3]" in text, text
    assert "for an uneven last batch pass pad=True" in text, text
