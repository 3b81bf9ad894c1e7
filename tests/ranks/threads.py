"""What the processes of `tests/test_threads.py` run: each function is one program's body.

The launched processes import this module, not the test module: they need meshkit, JAX and
numpy, not pytest.
"""

from __future__ import annotations

import threading
import time

import numpy as np

import meshkit

CALLS = 40
SHAPES = {"a": (8, 3), "b": (4, 5)}  # each channel's own layout: a mispairing is an error


def two_threads():
    """Two threads assemble global arrays at once, each on its channel; threads are named
    differently in each process, and started in a different order."""
    import jax

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    sums: dict[str, list[float]] = {}
    errors: list[BaseException] = []

    def work(channel):
        rows, cols = SHAPES[channel]
        try:
            with meshkit.channel(channel):
                out = []
                for i in range(CALLS):
                    local = np.full((rows, cols), i + me, np.float32)
                    g = meshkit.global_array_from_local(local, mesh, "data")
                    out.append(float(np.asarray(g.addressable_shards[0].data).sum()))
                    if i % 7 == me:
                        time.sleep(0.01)  # interleave differently in each process
                sums[channel] = out
                meshkit.barrier(f"done {channel}")
        except BaseException as e:  # reported to the test
            errors.append(e)

    order = ["a", "b"] if me == 0 else ["b", "a"]
    threads = [
        threading.Thread(target=work, args=(c,), name=f"worker-{me}-{k}")
        for k, c in enumerate(order)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    unnamed = ""

    def without_channel():
        nonlocal unnamed
        try:
            meshkit.global_array_from_local(np.ones((8, 3), np.float32), mesh, "data")
        except meshkit.MeshkitError as e:
            unnamed = str(e)

    t = threading.Thread(target=without_channel)
    t.start()
    t.join(60)
    return [repr(e) for e in errors], sums, unnamed


def closed_from_another_thread():
    """Process 0's loader blocks at batch 3; another thread of process 0 closes the iterator."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    step = jax.jit(lambda b: b.sum(), out_shardings=NamedSharding(mesh, P()))
    gate = threading.Event()

    def loader():
        for i in range(100):
            if i == 3 and me == 0:
                gate.wait(60)  # a loader stuck on a slow file system
            yield np.full((4, 2), i, np.float32)

    # Step 1 alone, steps 2-3 in a window of two, then a window from step 4, which blocks: with
    # three slots, steps 1-3 reach the caller before the helper reads step 4's batch, however
    # slowly the caller takes them (with two, step 3 could wait for the blocked read).
    it = meshkit.global_batches(loader(), mesh, "data", prefetch=3)
    closed: list[str] = []

    sums: list[float] = []

    def close():
        # Once this process took step 3 (its next() then waits for the stuck loader), however
        # long the steps took on a loaded machine.
        deadline = time.monotonic() + 60
        while len(sums) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        try:
            it.close()  # waits for process 1, which asks for step 4
        except meshkit.DivergenceError as e:
            closed.append(str(e).splitlines()[0])

    if me == 0:
        closer = threading.Thread(target=close)
        closer.start()
    start = time.monotonic()
    error = None
    try:
        for b in it:
            sums.append(float(step(b)))
    except meshkit.DivergenceError as e:  # the others: process 0 closed after step 3
        error = str(e).splitlines()[0]
    took = time.monotonic() - start
    gate.set()
    if me == 0:
        closer.join(60)
        error = closed[0] if closed else None
    return sums, took, error


def meshkit_threads():
    """The names of this process's threads beside the main thread: idle after `meshkit.init`
    and a first call, then while a `meshkit.global_batches` loop runs."""
    import jax

    def names():
        return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())

    mesh = meshkit.make_mesh({"data": -1})
    g = meshkit.global_array_from_local(np.ones((8, 2), np.float32), mesh, "data")
    jax.block_until_ready(g)
    time.sleep(2)  # what the call started has settled
    idle = names()
    seen: set[str] = set()
    loader = (np.full((8, 2), i, np.float32) for i in range(20))
    with meshkit.global_batches(loader, mesh, "data") as batches:
        for batch in batches:
            jax.block_until_ready(batch)
            seen.update(names())
            time.sleep(0.05)
    return idle, sorted(seen)
