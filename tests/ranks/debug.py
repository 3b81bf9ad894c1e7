"""What the fresh processes of `tests/test_debug.py` run (its warm cluster runs its own).

The launched processes import this module, not the test module: they need meshkit and JAX, not
pytest and hypothesis.
"""

from __future__ import annotations

import meshkit


def barrier_meets():
    import time

    import jax

    if jax.process_index() == 1:
        time.sleep(1.0)
    came = time.time()  # one machine: the processes share this clock
    for _ in range(3):  # a name may be reused
        meshkit.barrier("meet", timeout=30)
    return came, time.time()


def barrier_missing():
    import time

    import jax

    if jax.process_index() == 1:
        time.sleep(6)
    try:
        meshkit.barrier("checkpoint written", timeout=2)
    except meshkit.MeshkitError as e:
        return str(e)
    return "passed"


def names_that_look_alike():
    import jax

    name = "ckpt/a" if jax.process_index() == 0 else "ckpt_a"
    try:
        meshkit.barrier(name, timeout=2)
    except meshkit.MeshkitError as e:
        return str(e).splitlines()[0]
    return "passed"
