"""What the processes of `tests/test_soak.py` run: each function is one soak's body.

The launched processes import this module, not the test module: they need meshkit, JAX and
numpy, not pytest. The test checks its numbers against the constants here.
"""

from __future__ import annotations

import time

# 20 s: 4 periods of the paced cases' 5 s watchdog, 10 of the checkpoint case's 2 s one. (At
# 30 s, the soaks cost 69 CPU-s of the suite's 765 on Python 3.11, serially.)
SOAK_S = 20.0
# Each step's wait, as a step waits for its accelerator: SOAK_S / PACE_S steps last SOAK_S at
# least. The watchdog samples every 0.5 s (1 s in the paced cases), 10 steps or more apart.
# (At 20 ms a step and 30 s, the soaks cost 71 CPU-s of the suite's 675.)
PACE_S = 0.05
STEPS = int(SOAK_S / PACE_S)
# The checkpoint case: one write that outlasts the watchdog and its timeout together (2 s + 2 s),
# halfway, in steps whose waits and the write last SOAK_S at least.
WRITE_S = 4.5
CHECKPOINT_STEPS = STEPS - int(WRITE_S / PACE_S)  # 15.5 s of steps and a 4.5 s write


def global_ones(mesh, rows):
    """A (rows, 4) float32 global array of ones split over ``data``, made with JAX alone."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data"))
    return jax.make_array_from_callback(
        (rows, 4), sharding, lambda idx: np.ones((rows, 4), np.float32)[idx]
    )


def reduce_step(mesh):
    """A jitted step whose sum over the rows is a collective across every device."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.jit(lambda acc, x: acc + x.sum(), out_shardings=NamedSharding(mesh, P()))


def jit_only():
    import jax.numpy as jnp

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    x = global_ones(mesh, 16)
    step = reduce_step(mesh)
    acc = jnp.zeros(())
    start = time.monotonic()
    for i in range(STEPS):
        acc = step(acc, x)
        if i % 10 == 0:
            float(acc)  # a host read now and then, as a loop that logs its loss
        time.sleep(PACE_S)
    return float(acc), time.monotonic() - start


def batches_and_jit():
    import jax.numpy as jnp
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    step = reduce_step(mesh)
    loader = (np.full((8, 4), i % 7, np.float32) for i in range(STEPS))
    acc = jnp.zeros(())
    start = time.monotonic()
    for i, batch in enumerate(meshkit.global_batches(loader, mesh, "data")):
        acc = step(acc, batch)
        if i % 10 == 0:
            float(acc)
        time.sleep(PACE_S)
    return float(acc), time.monotonic() - start


def checkpoint_write(path, seconds):
    """Keep the main thread busy ``seconds`` s in Python: compress and write 1 MiB chunks.

    Every process writes its own part for the same time, so none waits long for another (a
    process waiting in a collective for one that writes alone is stalled, seen from itself).
    """
    import zlib

    import numpy as np

    data = np.random.default_rng(0).bytes(1 << 20)
    start = time.monotonic()
    with open(path, "wb") as f:
        while time.monotonic() - start < seconds:
            f.write(zlib.compress(data, 1))


def steps_with_checkpoints():
    import os
    import tempfile

    import jax
    import jax.numpy as jnp

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    x = global_ones(mesh, 16)
    step = reduce_step(mesh)
    acc = jnp.zeros(())
    start = time.monotonic()
    longest = 0.0
    with tempfile.TemporaryDirectory(prefix="meshkit-soak-") as directory:
        path = os.path.join(directory, f"ckpt{jax.process_index()}")
        for i in range(CHECKPOINT_STEPS):
            acc = step(acc, x)
            if i == CHECKPOINT_STEPS // 2:  # every process writes its part, for 2+ periods
                float(acc)
                began = time.monotonic()
                checkpoint_write(path, WRITE_S)
                longest = max(longest, time.monotonic() - began)
            time.sleep(PACE_S)
    return float(acc), time.monotonic() - start, longest


def pmap_compat_steps():
    import jax
    import numpy as np

    import meshkit
    from meshkit import collectives as C

    step = meshkit.pmap_compat(lambda x: C.psum(x, "i"), axis_name="i")
    x = np.ones((jax.local_device_count(), 4), np.float32)
    total = 0.0
    start = time.monotonic()
    for i in range(STEPS):
        out = step(x)
        if i % 10 == 0:
            total += float(out[0, 0])
        time.sleep(PACE_S)
    return total, time.monotonic() - start
