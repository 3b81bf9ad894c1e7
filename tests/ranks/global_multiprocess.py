"""What the fresh processes of `tests/test_global_multiprocess.py` run (not its warm cluster).

The launched processes import this module, not the test module: they need meshkit, JAX and
numpy, not pytest.
"""

from __future__ import annotations


def deferred_checks():
    import threading
    import time

    import jax
    import numpy as np

    import meshkit
    from meshkit._src.coord import agree as _agree

    mesh = meshkit.make_mesh({"data": -1, "model": 4})
    me = jax.process_index()
    good = np.ones((8, 4), np.float32)
    bad = np.ones((8, 4), np.int32)  # process 1's call #250: another dtype
    deferred = {"check": "deferred"}
    meshkit.barrier("start")
    for _ in range(20):  # the agreements' pattern: predicted after PERIOD repeats
        jax.block_until_ready(meshkit.global_array_from_local(good, mesh, "data"))
    rpcs = _agree.stats.rpcs
    for _ in range(128):  # the default: every call agreed before it returns
        jax.block_until_ready(meshkit.global_array_from_local(good, mesh, "data"))
    in_call = (_agree.stats.rpcs - rpcs) / 128
    meshkit.barrier("in call")
    rpcs = _agree.stats.rpcs
    for _ in range(100):  # a slow loop: a call every 3 ms
        jax.block_until_ready(meshkit.global_array_from_local(good, mesh, "data", **deferred))
        time.sleep(0.003)
    ours = sorted(t.name for t in threading.enumerate() if t.name.startswith("meshkit"))
    meshkit.barrier("slow")  # every check so far verified, none raised
    slow_per_call = (_agree.stats.rpcs - rpcs - 1) / 100  # less the barrier's one
    rpcs = _agree.stats.rpcs
    for i in range(101, 301):
        if i <= 200:
            jax.block_until_ready(meshkit.global_array_from_local(good, mesh, "data", **deferred))
        if i == 200:
            meshkit.barrier("fast")
            per_call = (_agree.stats.rpcs - rpcs - 1) / 100
        if i > 200:
            local = bad if (me == 1 and i == 250) else good
            try:  # deferred: even the call that changes returns before it is verified
                meshkit.global_array_from_local(local, mesh, "data", **deferred)
            except meshkit.MeshkitError as e:  # raised by a later call, once verified
                return in_call, per_call, slow_per_call, i, str(e), ours
    try:
        meshkit.barrier("end")
    except meshkit.MeshkitError as e:
        return in_call, per_call, slow_per_call, 301, str(e), ours
    return in_call, per_call, slow_per_call, None, "no error", ours


def one_process_never_calls():
    import time

    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    if jax.process_index() == 1:
        time.sleep(6)  # alive, past process 0's 3 s wait, and never calling
        return "skipped"
    try:
        meshkit.global_array_from_local(np.zeros((4, 2), np.float32), mesh, "data")
    except meshkit.MeshkitError as e:
        return str(e)
    return "no error"


def one_process_ends_first():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    if jax.process_index() == 1:
        return "ended"  # its exit is posted at its next agreement: process 0's call reads it
    try:
        meshkit.global_array_from_local(np.zeros((4, 2), np.float32), mesh, "data")
    except meshkit.MeshkitError as e:
        return str(e)
    return "no error"


def mismatch_then_end():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    rows = 8 if jax.process_index() == 1 else 4
    local = np.ones((rows, 3), np.float32)
    x = meshkit.global_array_from_local(local, mesh, "data", check="deferred")
    print("returned", x.shape, flush=True)  # verified at exit


def gather_to_different_places():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    g = meshkit.global_array_from_local(np.ones((4, 2), np.float32), mesh, "data")
    me = jax.process_index()
    try:
        meshkit.gather({"g": g}, to=me)  # a mistake: each process gathers to itself
    except meshkit.MeshkitError as e:
        first = str(e)
    else:
        first = "no error"
    # The check is an agreement, not a collective: the processes go on together afterwards.
    again = meshkit.gather({"g": g}, to=0)
    return first, None if again is None else float(again["g"].sum())


def stop_early(mode):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    # A collective per step: a process that took a step the others do not would hang in it.
    step = jax.jit(lambda b: b.sum(), out_shardings=NamedSharding(mesh, P()))

    def loader():
        for i in range(100):
            yield np.full((4, 2), i, np.float32)

    steps = 0
    if mode == "with":
        with meshkit.global_batches(loader(), mesh, "data", prefetch=3) as it:
            for b in it:
                float(step(b))
                steps += 1
                if steps == 2:
                    break
    elif mode == "raises":  # rank 0's loop body raises at step 1; rank 1 goes on
        with meshkit.global_batches(loader(), mesh, "data", prefetch=3) as it:
            for b in it:
                float(step(b))
                steps += 1
                if me == 0:
                    raise ValueError(f"boom at step {steps}")
                if steps == 3:
                    break
    elif mode == "one closes":
        it = meshkit.global_batches(loader(), mesh, "data", prefetch=3)
        for b in it:
            float(step(b))
            steps += 1
            if me == 0 and steps == 2:
                it.close()
                break
    else:  # leave the loop and the program without closing: the exit handler stops it
        for b in meshkit.global_batches(loader(), mesh, "data", prefetch=3):
            float(step(b))
            steps += 1
            if steps == 2:
                break
    return steps


def stop_early_with():
    return stop_early("with")


def stop_early_raising():
    return stop_early("raises")


def stop_early_one_closes():
    return stop_early("one closes")


def stop_early_no_close():
    return stop_early("no close")


def one_rank_leaves_the_loop_early():
    """Rank 1 leaves its ``with`` loop after step 3, rank 0 goes on; a psum after the loop.

    The post-loop psum is the same program as the steps' psum: if rank 1 went on after its
    close, its psum would meet rank 0's psum of step 4 and compute a wrong number.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    total = jax.jit(lambda b: b.sum(), out_shardings=NamedSharding(mesh, P()))
    tens = meshkit.global_array_from_local(np.full((4, 2), 10, np.float32), mesh, "data")

    def loader():
        for i in range(1, 100):
            yield np.full((4, 2), i, np.float32)

    sums = []
    with meshkit.global_batches(loader(), mesh, "data", prefetch=3) as batches:
        for b in batches:
            sums.append(float(total(b)))
            if me == 1 and len(sums) == 3:
                break
    after = float(total(tens))  # 160.0 on every process
    print(f"rank {me} after the loop: {after}", flush=True)
    return sums, after
