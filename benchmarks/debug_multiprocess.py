"""Per-call cost of debug mode in 2 processes: a small spmd step with meshkit.debug off and on.

Both processes run the same rounds in the same order (debug mode must be on in all processes
at once); each round times 100 calls, waiting for every 10th result to bound the work in flight.
"""

import json
import statistics
import sys
import time

import meshkit

meshkit.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from meshkit import collectives as C  # noqa: E402

mesh = meshkit.make_mesh({"data": -1})
step = meshkit.spmd(lambda x: C.psum(x, "data"), mesh=mesh, in_specs="data", out_specs="")
x = jax.device_put(jnp.ones((8, 128)), jax.sharding.NamedSharding(mesh, jax.P("data")))
CALLS = 100


def one_round() -> float:
    start = time.perf_counter()
    for i in range(CALLS):
        out = step(x)
        if i % 10 == 9:
            out.block_until_ready()
    return (time.perf_counter() - start) / CALLS


rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
off, on = [], []
one_round()
for _ in range(rounds):
    off.append(one_round())
    meshkit.debug.enable(watchdog=None)
    on.append(one_round())
    meshkit.debug.disable()
if jax.process_index() == 0:
    print("BENCH " + json.dumps({"off": statistics.median(off), "on": statistics.median(on)}))
