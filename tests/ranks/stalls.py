"""What the processes of `tests/test_stall_multiprocess.py` run: one program per stall case.

Each prints ``STEP k v`` for every cross-process sum it reads, so that the test can check how
far each process got. The lines marked ``# user line`` are the places a verdict should name;
the test finds them by their marks.
"""

from __future__ import annotations

import os
import signal
import threading
import time

DEADLINE_S = 3.0  # MESHKIT_STALL_TIMEOUT in these runs
# The healthy run's first compilation, in jnp operations: 4-5 s on this machine's CPU alone,
# longer under the suite's load; never under the deadline.
COMPILE_OPS = 1600
SOLO_S = 1.5 * DEADLINE_S  # how long process 0 evaluates alone while process 1 waits


def _step():
    """A mesh over every device, and a jitted sum across it (a collective of every process)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    total = jax.jit(lambda b: b.sum(), out_shardings=NamedSharding(mesh, P()))
    return mesh, total


def _batch(mesh):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), np.ones((4,), np.float32)
    )


def all_stuck():
    """After step 3 every process blocks in its own code: nobody waits for another. Each step is
    a `meshkit.spmd` sum, whose calls the verdict counts."""
    import jax
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh, _ = _step()

    def total(b):
        return jax.lax.psum(b.sum(), "data")

    total = meshkit.spmd(total, mesh=mesh, in_specs=P("data"), out_specs=P())
    for k in range(1, 4):
        print(f"STEP {k} {float(total(_batch(mesh)))}", flush=True)
    threading.Event().wait()  # user line: all stuck


def dead_peer():
    """Process 1 is killed before step 4; process 0 waits in step 4's sum for it, in C."""
    mesh, total = _step()
    for k in range(1, 6):
        if k == 4 and int(os.environ.get("MESHKIT_PROCESS_ID", "0")) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"STEP {k} {float(total(_batch(mesh)))}", flush=True)


def loader_stuck():
    """`global_batches` over a loader that, in process 1, deadlocks at its 5th batch: process 1's
    main thread waits inside meshkit for its own loader thread."""
    import jax
    import numpy as np

    import meshkit

    mesh, total = _step()

    def loader():
        for k in range(1, 100):
            if k == 5 and jax.process_index() == 1:
                threading.Event().wait()  # user line: loader
            yield np.ones((4,), np.float32)

    for k, batch in enumerate(meshkit.global_batches(loader(), mesh, "data"), 1):
        print(f"STEP {k} {float(total(batch))}", flush=True)


def healthy():
    """A first compilation longer than the deadline, then process 0 evaluating alone for one
    and a half deadlines while process 1 waits at a barrier (a device collective): never ended."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    mesh, total = _step()

    def deep(x):
        for i in range(COMPILE_OPS):
            x = jnp.tanh(x @ x.T) + jnp.cumsum(x, axis=i % 2)
        return x

    began = time.monotonic()
    compiled = jax.jit(deep).lower(jnp.ones((8, 8))).compile()
    compiling = time.monotonic() - began
    print(f"STEP 1 {float(total(_batch(mesh)))}", flush=True)
    solo = 0.0
    if jax.process_index() == 0:
        local = jax.jit(lambda x: jnp.tanh(x @ x.T), device=jax.local_devices()[0])
        x = jnp.ones((64, 64))
        began = time.monotonic()
        while time.monotonic() - began < SOLO_S:
            x = local(x)
            float(x[0, 0])  # a host read per evaluation step
            time.sleep(0.02)  # as a step waits for its accelerator
        solo = time.monotonic() - began
    multihost_utils.sync_global_devices("evaluated")
    print(f"STEP 2 {float(total(_batch(mesh)))}", flush=True)
    float(compiled(jnp.ones((8, 8)))[0, 0])
    return compiling, solo


SLOW_MS = 100  # process 1's loader: this much longer per batch
SLOW_STEPS = 50


def slow_loader():
    """`global_batches` over a loader that is `SLOW_MS` slower per batch in process 1 than in
    process 0; returns `meshkit.step_times()` late in the run."""
    import jax
    import numpy as np

    import meshkit

    mesh, total = _step()
    slow = jax.process_index() == 1

    def loader():
        for _ in range(SLOW_STEPS):
            time.sleep((SLOW_MS if slow else 5) / 1000)  # user line: loader sleeps
            yield np.ones((4,), np.float32)

    seen = []
    with meshkit.global_batches(loader(), mesh, "data") as batches:
        for batch in batches:
            float(total(batch))
            if batches.steps == SLOW_STEPS - 5:  # the latest windows, late in the run
                seen = [(r.process, r.steps, r.loader_ms, r.own_ms) for r in meshkit.step_times()]
    return seen


SLOW_SAVE_S = 1.5 * DEADLINE_S  # process 1's checkpoint writes: this much longer each
SAVES = 3


def slow_save():
    """Process 1 writes each checkpoint `SLOW_SAVE_S` slower (a slow disk); process 0 waits for
    it inside the save, longer than the deadline: progress, never ended. Returns process 1's
    seconds per save (0s on process 0)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    import meshkit

    mesh, total = _step()
    if jax.process_index() == 1:
        write = ocp.StandardCheckpointer.save

        def slow_write(self, *args, **kwargs):
            time.sleep(SLOW_SAVE_S)  # user line: a slow disk
            return write(self, *args, **kwargs)

        ocp.StandardCheckpointer.save = slow_write
    w = meshkit.replicate(np.ones((4,), np.float32))
    took = []
    for k in range(1, SAVES + 1):
        print(f"STEP {k} {float(total(_batch(mesh)))}", flush=True)
        began = time.monotonic()
        meshkit.checkpoint.save(f"{os.environ['STALL_SAVE_DIR']}/step_{k}", {"w": w, "step": k})
        took.append(time.monotonic() - began if jax.process_index() == 1 else 0.0)
    return took
