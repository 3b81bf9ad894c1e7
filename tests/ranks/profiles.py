"""What the processes of `tests/test_profiles.py` run: a short `global_batches` loop with a
cross-process sum per step; ``MESHKIT_PROFILE_STEPS`` (set by the test, as ``meshkit launch
--profile-steps`` sets it) says which steps every process traces."""

from __future__ import annotations

STEPS = 5


def loop() -> int:
    """`STEPS` steps of `global_batches`, each a jitted sum over every process's devices."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    total = jax.jit(lambda b: b.sum(), out_shardings=NamedSharding(mesh, P()))
    loader = (np.full((4,), k, np.float32) for k in range(STEPS))
    with meshkit.global_batches(loader, mesh, "data") as batches:
        for batch in batches:
            float(total(batch))
        return batches.steps
