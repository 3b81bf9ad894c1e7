"""Soak: healthy loops under debug mode with short settings are never ended by the watchdog.

Each case runs 2 processes x 4 CPU devices for at least `SOAK_S` seconds with
``MESHKIT_DEBUG=1`` and short settings: the checkpoint case a 2 s watchdog and a 2 s timeout, so
a process judged stalled would print a ``meshkit watchdog:`` line after 2 s and exit after 4 s;
the paced cases, whose every step is checked, a 5 s watchdog and 10 s for the others' arrival
(`PACED_ENV`). (Below that is less than a collective between two processes can promise on 2
cores running two copies of this suite, some 27 runnable processes: a step waited 1 s, then
2 s, there for its starved peer.) The loops are
the ones users leave running: plain ``jax.jit`` steps (no meshkit call at all), a
`meshkit.global_batches` pipeline feeding a ``jax.jit`` step, steps interrupted by a checkpoint
write that keeps the main thread busy in Python for several watchdog periods, and `meshkit.pmap_compat` steps. Every step paces itself with a short sleep, the way a
step waits for an accelerator: at most samples the main thread sits in the same place, and only
the device work it completes shows it moves. Each case checks its numbers, that it ran for
`SOAK_S`, and that no watchdog line was printed.

The functions starting with an underscore run inside the launched processes.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from meshkit.testing import launch_in_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]

SOAK_S = 30.0
# Each step's wait, as a step waits for its accelerator: SOAK_S / PACE_S steps last SOAK_S at
# least. The watchdog samples every 0.5 s (1 s in the paced cases), 10 steps or more apart.
# (At 20 ms a step, the soaks cost 71 CPU-s of the suite's 675 for the same 30 s.)
PACE_S = 0.05
STEPS = int(SOAK_S / PACE_S)
CHECKPOINT_STEPS = STEPS * 3 // 4  # 22.5 s of steps and two 4.5 s writes
ENV = {"MESHKIT_DEBUG": "1", "MESHKIT_DEBUG_TIMEOUT": "2", "MESHKIT_WATCHDOG": "2"}
# The paced cases make a debug-checked call per step; the timeout is also how long a process
# waits there for the others, and a first call that compiles can lag 7 s under heavy load (beside
# a second copy of the suite). A process sees only itself: waiting 2 s in a collective for a
# peer starved of CPU (measured beside a second copy of the suite: 2 s and more) is a stall
# from where it stands. Their watchdog is 5 s, still 6 periods in each soak; only the checkpoint
# case, which runs alone, keeps the 2 s watchdog and timeout (its writes outlast 2 s + 2 s).
PACED_ENV = {**ENV, "MESHKIT_DEBUG_TIMEOUT": "10", "MESHKIT_WATCHDOG": "5"}


def _global_ones(mesh, rows):
    """A (rows, 4) float32 global array of ones split over ``data``, made with JAX alone."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data"))
    return jax.make_array_from_callback(
        (rows, 4), sharding, lambda idx: np.ones((rows, 4), np.float32)[idx]
    )


def _reduce_step(mesh):
    """A jitted step whose sum over the rows is a collective across every device."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.jit(lambda acc, x: acc + x.sum(), out_shardings=NamedSharding(mesh, P()))


def _jit_only():
    import jax.numpy as jnp

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    x = _global_ones(mesh, 16)
    step = _reduce_step(mesh)
    acc = jnp.zeros(())
    start = time.monotonic()
    for i in range(STEPS):
        acc = step(acc, x)
        if i % 10 == 0:
            float(acc)  # a host read now and then, as a loop that logs its loss
        time.sleep(PACE_S)
    return float(acc), time.monotonic() - start


def _batches_and_jit():
    import jax.numpy as jnp
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    step = _reduce_step(mesh)
    loader = (np.full((8, 4), i % 7, np.float32) for i in range(STEPS))
    acc = jnp.zeros(())
    start = time.monotonic()
    for i, batch in enumerate(meshkit.global_batches(loader, mesh, "data")):
        acc = step(acc, batch)
        if i % 10 == 0:
            float(acc)
        time.sleep(PACE_S)
    return float(acc), time.monotonic() - start


def _checkpoint_write(path, seconds):
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


def _steps_with_checkpoints():
    import os
    import tempfile

    import jax
    import jax.numpy as jnp

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    x = _global_ones(mesh, 16)
    step = _reduce_step(mesh)
    acc = jnp.zeros(())
    start = time.monotonic()
    longest = 0.0
    with tempfile.TemporaryDirectory(prefix="meshkit-soak-") as directory:
        path = os.path.join(directory, f"ckpt{jax.process_index()}")
        for i in range(CHECKPOINT_STEPS):
            acc = step(acc, x)
            if i % 200 == 100:  # every process writes its part: 2 checkpoints of 2+ periods
                float(acc)
                began = time.monotonic()
                _checkpoint_write(path, 4.5)
                longest = max(longest, time.monotonic() - began)
            time.sleep(PACE_S)
    return float(acc), time.monotonic() - start, longest


def _pmap_compat_steps():
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


# The cases whose steps mostly sleep. The checkpoint case keeps both of its processes busy in
# Python for 4.5 s at a time: run beside the others, it starves them on a 2-core machine, and
# their watchdogs rightly call that a stall; it runs alone, after them.
_PACED = ("_jit_only", "_batches_and_jit", "_pmap_compat_steps")


def _launch(target):
    env = PACED_ENV if target.__name__ in _PACED else ENV
    return launch_in_processes(target, timeout=SOAK_S * 4 + 60, env=env)


@pytest.fixture(scope="module")
def soaks():
    """The paced cases' launches, started together when the module's first test asks.

    A paced soak is 30 s of steps that mostly sleep: one after the other, they cost three
    times that in wall time, together about once. Each case still runs its own 2 processes for
    `SOAK_S` under its own watchdog; only the waiting overlaps.
    """
    with concurrent.futures.ThreadPoolExecutor(len(_PACED)) as pool:
        yield {name: pool.submit(_launch, globals()[name]) for name in _PACED}


def _ran(soaks, target):
    if target.__name__ in soaks:
        result = soaks[target.__name__].result()
    else:
        concurrent.futures.wait(soaks.values())  # alone: after the paced cases
        result = _launch(target)
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode == 0, text
    assert "meshkit watchdog:" not in text, text
    assert all(v[1] >= SOAK_S for v in result.values), result.values
    return result.values


def test_jit_only_steps(soaks):
    # 16 rows of 4 ones: 64 per step.
    assert [v[0] for v in _ran(soaks, _jit_only)] == [64.0 * STEPS] * 2


def test_global_batches_feeding_a_jit_step(soaks):
    # Step i: 16 rows of 4 values (i % 7), from 2 processes.
    expected = sum(64.0 * (i % 7) for i in range(STEPS))
    assert [v[0] for v in _ran(soaks, _batches_and_jit)] == [expected] * 2


def test_steps_with_checkpoint_writes_longer_than_the_watchdog(soaks):
    values = _ran(soaks, _steps_with_checkpoints)
    assert [v[0] for v in values] == [64.0 * CHECKPOINT_STEPS] * 2
    # Each write outlasted the watchdog and its timeout together (2 s + 2 s).
    assert all(v[2] > 4.0 for v in values), values


def test_pmap_compat_steps(soaks):
    # Every device sums 4 ones... over 8 devices: 8 per read, one read every 10 steps.
    assert [v[0] for v in _ran(soaks, _pmap_compat_steps)] == [8.0 * len(range(0, STEPS, 10))] * 2
