"""What the processes of `tests/test_faults.py` run: each function is one program's body.

The launched processes import this module, not the test module: they need meshkit, JAX and
numpy, not pytest (0.2 CPU-s per process, and the fault cases start about 60 of them).
"""

from __future__ import annotations

import sys
import time

import meshkit

EIGHT_STEPS = 5  # the calls of each 8-process case


def step_fn():
    import jax.numpy as jnp

    from meshkit import collectives as C

    mesh = meshkit.make_mesh({"data": -1})
    step = meshkit.spmd(lambda x: C.psum(x, "data"), mesh=mesh, in_specs="data", out_specs="")
    return mesh, step, jnp


def killed_mid_step():
    import os
    import signal

    import jax

    _, step, jnp = step_fn()
    for i in range(100):
        if i == 3 and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        step(jnp.ones((8, 4))).block_until_ready()


def stalled_in_python():
    import jax

    _, step, jnp = step_fn()
    for i in range(10):
        if i == 2 and jax.process_index() == 1:
            time.sleep(600)  # alive, stuck: the others wait at call #3
        step(jnp.ones((8, 4))).block_until_ready()


def shape_mismatch():
    import jax

    _, step, jnp = step_fn()
    step(jnp.ones((8, 4))).block_until_ready()
    rows = 8 if jax.process_index() == 0 else 16
    step(jnp.ones((rows, 4))).block_until_ready()


def two_functions():
    import jax

    from meshkit import collectives as C

    mesh, step, jnp = step_fn()

    def evaluate(x):
        return C.pmax(x, "data")

    other = meshkit.spmd(evaluate, mesh=mesh, in_specs="data", out_specs="")
    fn = step if jax.process_index() == 0 else other
    fn(jnp.ones((8, 4))).block_until_ready()


def last_batch_exit():
    import jax

    _, step, jnp = step_fn()
    steps = 5 if jax.process_index() == 0 else 4  # process 1's loader is one batch short
    for _ in range(steps):
        step(jnp.ones((8, 4))).block_until_ready()


def mesh_disagreement():
    import jax

    shape = {"data": 4, "model": 2} if jax.process_index() == 0 else {"data": 2, "model": 4}
    meshkit.make_mesh(shape)


def set_order():
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

    mesh, _, jnp = step_fn()
    fns = {
        name: meshkit.spmd(lambda x, op=op: op(x, "data"), mesh=mesh, in_specs="data", out_specs="")
        for name, op in (("sum", C.psum), ("max", C.pmax), ("min", C.pmin), ("mean", C.pmean))
    }
    for name in {"sum", "max", "min", "mean", "alpha", "beta"} & set(fns):  # per-process order
        fns[name](jnp.ones((8, 4))).block_until_ready()


def raw_collective_stall():
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh, step, jnp = step_fn()
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


def pmap_shape_mismatch():
    import jax
    import numpy as np

    from meshkit import collectives as C

    step = meshkit.pmap_compat(lambda x: C.psum(x, "i"), axis_name="i")
    width = 3 if jax.process_index() == 1 else 2
    step(np.ones((jax.local_device_count(), width), np.float32)).block_until_ready()


def batches_thread_no_false_alarm():
    import jax
    import numpy as np

    mesh, step, _ = step_fn()
    rows = 4 * jax.process_count()  # the global batch: 4 rows per process, one per device
    loader = (np.full((4, 4), i, np.float32) for i in range(20))
    total = 0.0
    # global_batches assembles in its own thread while the main thread steps: the checks of
    # the two threads are kept apart by thread name, so their interleaving raises nothing.
    for batch in meshkit.global_batches(loader, mesh, "data"):
        assert batch.shape == (rows, 4)
        total += float(np.asarray(step(batch)).sum())
    return total


def coordinator_port_taken():
    import os

    # As under a cluster launcher that picked a port some other program holds.
    os.environ["MESHKIT_COORDINATOR"] = "127.0.0.1:" + os.environ["TAKEN_PORT"]
    meshkit.init()


def soak(steps: int = 2000):
    import jax
    import numpy as np

    _, step, jnp = step_fn()
    x = jnp.arange(32.0).reshape(8, 4)
    total = None
    for i in range(steps):
        out = step(x)
        if i % 16 == 15:  # bound the work in flight (JAX 0.10.2 on CPU deadlocks past hundreds)
            out.block_until_ready()
        total = out
    assert total is not None
    return float(np.asarray(total).sum()), meshkit.debug.enabled(), jax.process_index()


def soak_on():
    return soak()


def eight_shape_mismatch():
    import jax

    _, step, jnp = step_fn()
    for call in range(1, EIGHT_STEPS + 1):
        rows = 16 if call == 2 and jax.process_index() == 5 else 8
        step(jnp.ones((rows, 4))).block_until_ready()


def eight_one_missing():
    import jax

    _, step, jnp = step_fn()
    for call in range(1, EIGHT_STEPS + 1):
        if call == 2 and jax.process_index() == 3:
            time.sleep(600)  # alive, stuck: the other 7 wait at call #2
        step(jnp.ones((8, 4))).block_until_ready()


def eight_two_functions():
    import jax

    from meshkit import collectives as C

    mesh, step, jnp = step_fn()

    def evaluate(x):
        return C.pmax(x, "data")

    other = meshkit.spmd(evaluate, mesh=mesh, in_specs="data", out_specs="")
    for call in range(1, EIGHT_STEPS + 1):
        fn = other if call == 2 and jax.process_index() == 6 else step
        fn(jnp.ones((8, 4))).block_until_ready()


def eight_global_shape_mismatch():
    import jax
    import numpy as np

    mesh = meshkit.make_mesh({"data": -1})
    for call in range(1, EIGHT_STEPS + 1):
        rows = 4 if call == 3 and jax.process_index() == 5 else 8
        meshkit.global_array_from_local(np.ones((rows, 3), np.float32), mesh, "data")
    meshkit.barrier("end")
