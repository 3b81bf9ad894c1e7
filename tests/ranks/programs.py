"""What the fresh processes of `tests/test_programs.py` run (its warm cluster runs its own).

The launched processes import this module, not the test module: they need meshkit, JAX and
numpy, not pytest and hypothesis.
"""

from __future__ import annotations

import time

import numpy as np


def one_of_eight_differs():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows = 3 if jax.process_index() == 5 else 2
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), np.ones((rows, 2), np.float32)
    )
    return float(jax.jit(lambda v: v.sum())(x))


def only_process_0_computes():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), np.ones((4, 2), np.float32)
    )
    if jax.process_index() == 0:  # a computation over both processes' devices, run by one
        start = time.monotonic()
        try:
            return float(jax.jit(lambda v: v.sum())(x))
        except meshkit.DivergenceError as e:
            return str(e).splitlines()[0], e.processes, e.field, time.monotonic() - start
    return "ended"


def switched_off():
    from meshkit._src.runtime import programs as p

    return p.installed()


def waits_at_different_agreements():
    """Process 0 compiles a program at step 2; process 1 skips it and computes step 3."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    replicated = NamedSharding(mesh, P())
    total = jax.jit(lambda b: b.sum(), out_shardings=replicated)
    loader = (np.full((4, 2), i, np.float32) for i in range(100))
    start = time.monotonic()
    try:
        for i, batch in enumerate(meshkit.global_batches(loader, mesh, "data")):
            float(total(batch))  # process 1
            if i == 1 and jax.process_index() == 0:  # a program process 1 does not run
                float(jax.jit(lambda b: b.max(), out_shardings=replicated)(batch))  # process 0
    except meshkit.DivergenceError as e:
        return str(e).splitlines()[0], e.processes, e.field, time.monotonic() - start
    return "no error"


def _compiles_while_process_1_waits(verdict):
    """Process 0 compiles a program only it runs; process 1 runs ``verdict(mesh, x)`` instead.

    Returns the first line of the `DivergenceError` each raises, with its processes, field and
    the seconds it took.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    replicated = NamedSharding(mesh, P())
    x = meshkit.global_array_from_local(np.ones((8, 2), np.float32), mesh, "data")
    start = time.monotonic()
    try:
        if jax.process_index() == 0:
            float(jax.jit(lambda b: b.max(), out_shardings=replicated)(x))  # process 0
        else:
            verdict(mesh, x)
    except meshkit.DivergenceError as e:
        return str(e).splitlines()[0], e.processes, e.field, time.monotonic() - start
    return "no error"


def waits_at_a_verdict():
    """Process 1 makes a global_array_from_local call, which waits at its agreement."""
    import meshkit

    def verdict(mesh, x):
        meshkit.global_array_from_local(np.ones((8, 3), np.float32), mesh, "data")  # 1

    return _compiles_while_process_1_waits(verdict)


def waits_at_a_debug_verdict():
    """Debug mode: process 1 makes its first spmd call, whose check waits at its agreement."""
    import meshkit

    def verdict(mesh, x):
        meshkit.spmd(lambda b: b * 2, mesh=mesh, in_specs="data", out_specs="data")(x)  # 1

    return _compiles_while_process_1_waits(verdict)
