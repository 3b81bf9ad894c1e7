"""What the guards of docs/guarantees.md cost that `benchmarks/` does not time.

    PYTHONPATH=. meshkit launch -n 2 -d 4 tests/guarantee_programs/costs.py

(2 processes x 4 CPU devices.) Process 0 prints one ``COST {json}`` line:

- ``threads_idle``: the names of meshkit's threads in a joined process that waits (after
  `meshkit.init` and `make_mesh`), ``threads_loop``: in a `global_batches` loop,
  ``threads_after_calls``: after `global_array_from_local` calls;
- ``close_ms``: `global_batches`' ``close()`` when every process leaves its loop after the same
  step (the wait for the others' word that guards a loop left early), median of 10 loops;
  ``step_us`` / ``step_jax_us``: a step of a `global_batches` loop with a psum, against the same
  psum on arrays made by ``jax.make_array_from_process_local_data`` (medians of 5 x 200 steps);
- ``replica_us``: a steady `global_array_from_local` call of a replicated 1 MiB leaf, under the
  default check (sampled digests) and ``check="data"`` (every block hashed, the call waits);
- ``round_trip_ms``: a `meshkit.barrier` (one wait at the coordination service's barrier).
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import meshkit

meshkit.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshkit import collectives as C  # noqa: E402

mesh = meshkit.make_mesh({"data": -1})
me = jax.process_index()
time.sleep(1.0)  # the threads started by the first calls are up
threads_idle = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())

step = meshkit.spmd(lambda x: C.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
ones = np.ones((4, 64), np.float32)


def loader(n):
    for _ in range(n):
        yield ones


# A loop left after the same step on every process: close() waits for the others' word.
closes = []
threads_loop: list[str] = []
for i in range(11):
    with meshkit.global_batches(loader(100), mesh, "data", prefetch=3) as batches:
        for k, b in enumerate(batches, 1):
            step(b).block_until_ready()
            if k == 5:
                if i == 0:
                    threads_loop = sorted(
                        t.name for t in threading.enumerate() if t is not threading.main_thread()
                    )
                break
        start = time.perf_counter()
    closes.append(time.perf_counter() - start)  # __exit__ is close()
close_ms = statistics.median(closes[1:]) * 1e3


def per_step_batches(n=200):
    batches = meshkit.global_batches(loader(n + 1), mesh, "data", prefetch=3)
    step(next(batches)).block_until_ready()
    start = time.perf_counter()
    for b in batches:
        step(b).block_until_ready()
    return (time.perf_counter() - start) / n


sharding = NamedSharding(mesh, P("data"))


def per_step_jax(n=200):
    start = time.perf_counter()
    for _ in range(n):
        step(jax.make_array_from_process_local_data(sharding, ones)).block_until_ready()
    return (time.perf_counter() - start) / n


rounds = {"batches": [], "jax": []}
for _ in range(5):
    meshkit.barrier("round")
    rounds["batches"].append(per_step_batches())
    meshkit.barrier("round")
    rounds["jax"].append(per_step_jax())

params = np.ones((512, 512), np.float32)  # 1 MiB, replicated over every device
replica_us = {}
for check in (True, "data"):
    times = []
    meshkit.barrier("replicas")
    for _ in range(60):
        start = time.perf_counter()
        meshkit.global_array_from_local(params, mesh, P(), check=check)
        times.append(time.perf_counter() - start)
    replica_us[str(check)] = statistics.median(times[20:]) * 1e6
meshkit.barrier("settled")
threads_calls = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())

trips = []
for i in range(50):
    start = time.perf_counter()
    meshkit.barrier(f"trip {i % 2}")
    trips.append(time.perf_counter() - start)

if me == 0:
    record = {
        "threads_idle": threads_idle,
        "threads_loop": threads_loop,
        "threads_after_calls": threads_calls,
        "close_ms": round(close_ms, 2),
        "step_us": round(statistics.median(rounds["batches"]) * 1e6, 1),
        "step_jax_us": round(statistics.median(rounds["jax"]) * 1e6, 1),
        "replica_us": {k: round(v, 1) for k, v in replica_us.items()},
        "round_trip_ms": round(statistics.median(trips) * 1e3, 3),
    }
    print("COST " + json.dumps(record), flush=True)
