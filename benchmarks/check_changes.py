"""What a call whose layout changed costs under the default check (issue 25), 2 processes.

Usage: ``meshkit launch -n 2 -d 4 check_changes.py BENCHMARKS_DIR``. Process 0 prints one
``BENCH {json}`` line.

Each call cycles through 17 layouts of 64 KiB per process (17 widths of one float32 batch), so
no agreement repeats a pattern the primitive predicts (periods up to 16): under ``check=True``
every call posts its record before the agreement, the most a changed layout costs. Timed beside
one layout under ``check=True`` (a steady loop, on its own channel), ``check="deferred"``
(agrees at every 64th call; a round's calls are verified by the untimed drain before the next)
and ``jax.make_array_from_process_local_data``, in alternating rounds; a round is 34 calls,
then a device barrier (untimed). The coordination service's round trip is timed
alone: one wait at the service's own barrier by every process (``wait_at_barrier``, one
request each).
"""

import json
import sys
import time

sys.path.insert(0, sys.argv[1])
from _timing import bench_rounds, interleaved_medians

import meshkit

meshkit.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

mesh = meshkit.make_mesh({"data": -1})
sharding = NamedSharding(mesh, PartitionSpec("data"))
ROWS = 64  # 64 KiB per process at the middle width
widths = [256 - 6 * 16 + 12 * k for k in range(17)]  # 17 layouts, about 64 KiB each
batches = [np.random.default_rng(w).random((ROWS, w), dtype=np.float32) for w in widths]
shapes = [(ROWS * jax.process_count(), w) for w in widths]
CALLS = 2 * len(widths)


def cycle(fn):
    def run():
        return [fn(i % len(widths)) for i in range(CALLS)]

    return run


def ours(check):
    return cycle(lambda i: meshkit.global_array_from_local(batches[i], mesh, "data", check=check))


def steady():
    """One layout, on a channel of its own: its agreed history is steady across rounds (on the
    main channel, each round would follow the changed calls' and agree PERIOD calls first)."""
    one = cycle(lambda i: meshkit.global_array_from_local(batches[8], mesh, "data"))

    def run():
        with meshkit.channel("bench-steady"):
            return one()

    return run


base = cycle(lambda i: jax.make_array_from_process_local_data(sharding, batches[i], shapes[i]))


def settle():
    """Before each round, untimed: the deferred checks verified, then every process at once."""
    from meshkit._src.coord import agree

    agree.drain()
    multihost_utils.sync_global_devices("meshkit-bench")


jax_s, changed_s, deferred_s, steady_s = interleaved_medians(
    [base, ours(True), ours("deferred"), steady()],
    wait=jax.block_until_ready,
    rounds=bench_rounds(15),
    number=1,
    before_round=settle,
)
# One round trip of the coordination service: its own barrier, one request per process (a
# meshkit.barrier is an agreement, several requests).
from jax._src import distributed  # noqa: E402

client = distributed.global_state.client
trips = []
for i in range(30):
    start = time.perf_counter()
    client.wait_at_barrier(f"meshkit-bench-round-trip-{i}", 60_000)
    trips.append(time.perf_counter() - start)
if jax.process_index() == 0:
    per = 1.0 / CALLS
    print(
        "BENCH "
        + json.dumps(
            {
                "jax": jax_s * per,
                "changed": changed_s * per,
                "deferred": deferred_s * per,
                "steady": steady_s * per,
                "round_trip": float(np.median(trips)),
                "bytes": int(batches[8].nbytes),
            }
        )
    )
