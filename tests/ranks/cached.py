"""A rank that compiles one program across every process and prints its compile totals.

Run under ``meshkit launch`` with ``MESHKIT_COMPILATION_CACHE`` set, or alone (then it is
process 0 of 1). Prints ``TOTALS {"seconds": ..., "programs": ..., "hits": ...}`` and the
global sum, so a test can compare a first and a second run sharing one cache directory.
"""

import json

import meshkit

info = meshkit.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshkit._src.runtime import compile_cache  # noqa: E402

compile_cache.watch()  # already watching under meshkit launch; alone it starts here
mesh = meshkit.make_mesh({"data": -1})
sharded = NamedSharding(mesh, P("data"))


@jax.jit
def step(x):
    return jnp.sum(jnp.sin(x) * 2.0 + jnp.cos(x))


x = jax.jit(lambda: jnp.arange(64.0), out_shardings=sharded)()
total = float(step(x))
print("SUM", f"{total:.6f}")
print("TOTALS", json.dumps(compile_cache.totals()))
