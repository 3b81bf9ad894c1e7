"""Programs compared at compilation, in 2 processes: the cost per compilation and per call.

Every process compiles the same fresh functions in the same order (AOT: ``lower().compile()``,
nothing runs), alternately with the comparison off and on, then times calls of one compiled
step both ways. Process 0 prints medians as one ``BENCH`` line.
"""

import json
import statistics
import sys
import time

import meshkit

meshkit.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshkit._src.runtime import programs  # noqa: E402

sys.path.insert(0, sys.argv[1])
from _timing import median_seconds  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("data",))
x = jax.device_put(jnp.ones((64, 128)), NamedSharding(mesh, P("data")))


def compile_seconds(i: int) -> float:
    """Compile a function no process has compiled before (its constant is new)."""
    fn = jax.jit(lambda v: jnp.tanh(v * (i + 1.5)).sum(axis=0))
    start = time.perf_counter()
    fn.lower(x).compile()
    return time.perf_counter() - start


assert programs.installed()
spent = {"compared": 0, "seconds": 0.0}  # the comparison itself: programs._agree_on, timed
agree_on = programs._agree_on


def timed_agree_on(compiling, tag):
    start = time.perf_counter()
    try:
        agree_on(compiling, tag)
    finally:
        spent["compared"] += 1
        spent["seconds"] += time.perf_counter() - start


programs._agree_on = timed_agree_on
times: dict[str, list[float]] = {"off": [], "on": []}
for i in range(40):  # alternating, so that drift in the machine's speed hits both alike
    on = i % 2 == 1
    if not on:
        programs.uninstall()
    times["on" if on else "off"].append(compile_seconds(i))
    if not on:
        programs.install(jax.process_count())

compared, seconds = spent["compared"], spent["seconds"]  # the 20 compiled with it on
step = jax.jit(lambda v: (v * 2.0).sum())
step(x).block_until_ready()  # compiled (and compared) once
calls = {}
for name in ("off", "on", "off2", "on2"):
    if name.startswith("off"):
        programs.uninstall()
    calls[name] = median_seconds(lambda: step(x).block_until_ready(), number=50)
    if name.startswith("off"):
        programs.install(jax.process_count())
if jax.process_index() == 0:
    print(
        "BENCH "
        + json.dumps(
            {
                "compile_off": statistics.median(times["off"]),
                "compile_on": statistics.median(times["on"]),
                "call_off": min(calls["off"], calls["off2"]),
                "call_on": min(calls["on"], calls["on2"]),
                "compare": seconds / compared,
                "compared": compared,
            }
        )
    )
