"""What the processes of `tests/test_guarantees.py` run: one program per failure class.

Every program prints each number it computes across processes on its own line (``STEP k v``,
``AFTER v``, ...), so that the test can check that no process printed a wrong one before the
error. The right values are written beside each program. The lines marked ``# user line`` are
the lines an error should point at; the test finds them by their marks.
"""

from __future__ import annotations

import os
import signal
import threading
import time


def _psum_step():
    """The mesh over every device, and a psum of one row per device (the same program always)."""
    from jax.sharding import PartitionSpec as P

    import meshkit
    from meshkit import collectives as C

    mesh = meshkit.make_mesh({"data": -1})
    step = meshkit.spmd(lambda x: C.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
    return mesh, step


def _raised_at(error: BaseException) -> int:
    """The line of this file where ``error`` came out of meshkit (or JAX) into the program."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == __file__]
    return frames[-1].lineno or 0


def _ones(rows: int = 4):
    import numpy as np

    return np.ones((rows,), np.float32)


# ---- layout or shape mismatch --------------------------------------------------------------


def shape_mismatch():
    """Process 1 passes 8 rows where process 0 passes 4, at step 15 of a steady loop.

    Each step assembles this process's rows into a global array and sums it with a psum: 8.0
    at every step (8 devices, one row of ones each). At step 15 (past the 12 calls after which
    a repeated layout is checked beside the caller) process 1's loader gives it 8 rows. The
    caller does not catch the error: the run ends.
    """
    import jax

    import meshkit

    mesh, step = _psum_step()
    me = jax.process_index()
    for k in range(1, 21):
        rows = 8 if (me == 1 and k == 15) else 4
        batch = meshkit.global_array_from_local(_ones(rows), mesh, "data")  # user line: shape
        print(f"STEP {k} {float(step(batch)[0])}", flush=True)


# ---- replicated data that differs ------------------------------------------------------------


# ---- programs that differ ----------------------------------------------------------------


def only_process_0_computes():
    """Process 0 runs a computation across processes that process 1 does not run.

    Both then run the step of the loop. Process 0's ``mask.sum()`` (the first compilation of
    a sum over the global mask) meets process 1's first compilation of the step; had either
    run, the sum would wait for process 1, or meet its step (8.0 expected from the step).
    """
    import jax
    import jax.numpy as jnp

    import meshkit

    mesh, step = _psum_step()
    me = jax.process_index()
    batch = meshkit.global_array_from_local(_ones(), mesh, "data")
    mask = batch > 0
    out = []
    try:
        if me == 0:
            out.append(("MASK", int(jnp.sum(mask))))  # user line: alone
        out.append(("STEP", float(step(batch)[0])))  # user line: step
    except meshkit.DivergenceError as e:
        return out, type(e).__name__, str(e), e.processes, e.field, _raised_at(e)
    return out, None, None, None, None, None


# ---- a loop left at different steps ------------------------------------------------------


def loop_left_early():
    """Issue 43's case: rank 1 breaks after step 3, a psum per step, another psum after the loop.

    Every process contributes one 1.0 per device at each step (the psum is 8.0) and 10.0 per
    device after the loop: 80.0 is the right post-loop psum. Were rank 1's post-loop psum to
    meet rank 0's psum of step 4, it would sum four 10.0s and four 1.0s: 44.0.
    """
    import jax
    import numpy as np

    import meshkit

    mesh, step = _psum_step()
    me = jax.process_index()
    tens = meshkit.global_array_from_local(np.full((4,), 10.0, np.float32), mesh, "data")

    def loader():
        for _ in range(100):
            yield _ones()

    with meshkit.global_batches(loader(), mesh, "data", prefetch=3) as batches:  # user line: with
        for k, b in enumerate(batches, 1):
            print(f"STEP {k} {float(step(b)[0])}", flush=True)
            if me == 1 and k == 3:
                break  # user line: break
    print(f"AFTER {float(step(tens)[0])}", flush=True)  # user line: after


# ---- a process that dies -----------------------------------------------------------------


def process_dies():
    """Process 1 is killed (SIGKILL) before its 4th step; process 0 waits in that step's psum."""
    import jax

    import meshkit

    mesh, step = _psum_step()
    for k in range(1, 100):
        if k == 4 and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        batch = meshkit.global_array_from_local(_ones(), mesh, "data")
        print(f"STEP {k} {float(step(batch)[0])}", flush=True)
        time.sleep(0.05)


# ---- a preemption notice ------------------------------------------------------------------


def preempted():
    """Process 1 receives SIGTERM after step 5; each asks `should_save` at every step.

    The step is a psum (8.0), so the processes stay within a step of each other. At the step
    `should_save` says yes, each prints it and ends as a save would, with status 143.
    """
    import jax

    import meshkit

    mesh, step = _psum_step()
    for k in range(1, 1000):
        batch = meshkit.global_array_from_local(_ones(), mesh, "data")
        print(f"STEP {k} {float(step(batch)[0])}", flush=True)
        if meshkit.checkpoint.should_save(k):
            print(f"SAVE {k}", flush=True)
            raise SystemExit(143)
        if k == 5 and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)


# ---- a stuck process ------------------------------------------------------------------------


def stuck():
    """From step 5 process 1 blocks in Python (a loader thread deadlocked), alive; process 0
    waits in step 5's psum, a raw `jax.jit` collective compiled already. Each step asks
    `should_save`, as a loop that checkpoints does."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    total = jax.jit(lambda b: b.sum(), out_shardings=NamedSharding(mesh, P()))
    for k in range(1, 100):
        meshkit.checkpoint.should_save(k)
        batch = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")), np.ones((4,), np.float32)
        )
        if k == 5 and jax.process_index() == 1:
            threading.Event().wait()  # user line: stuck
        print(f"STEP {k} {float(total(batch))}", flush=True)  # user line: waits


def only_process_0_runs_a_compiled_step():
    """Process 0 runs the step alone once (an evaluation), after both compiled and ran it.

    The step's psum is 8.0 on ones and 80.0 on the evaluation batch of tens; a meshkit
    barrier ends the program on both. Process 0's evaluation psum meets process 1's 16th
    step: both would compute 44.0 (four tens, four ones).
    """
    import jax
    import numpy as np

    import meshkit

    mesh, step = _psum_step()
    me = jax.process_index()
    tens = meshkit.global_array_from_local(np.full((4,), 10.0, np.float32), mesh, "data")
    for k in range(1, 21):
        batch = meshkit.global_array_from_local(_ones(), mesh, "data")
        print(f"STEP {k} {float(step(batch)[0])}", flush=True)
        if me == 0 and k == 15:
            print(f"EVAL {float(step(tens)[0])}", flush=True)  # user line: alone again
    meshkit.barrier("end")


def replicas_differ_in_a_steady_loop(check):
    """Replicated parameters, equal for 15 calls; at the 16th process 1's differ (2.0, not 1.0)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    total = jax.jit(lambda p: p.sum(), out_shardings=NamedSharding(mesh, P()))
    kwargs = {} if check is None else {"check": check}
    computed = []
    try:
        for k in range(1, 17):
            value = 2.0 if (me == 1 and k == 16) else 1.0
            params = np.full((4,), value, np.float32)
            p = meshkit.global_array_from_local(params, mesh, P(), **kwargs)  # user line: steady
            computed.append(float(total(p)))
        meshkit.barrier("after the loop")  # user line: barrier
    except meshkit.MeshkitError as e:
        return computed, type(e).__name__, str(e), _raised_at(e)
    return computed, None, None, None
