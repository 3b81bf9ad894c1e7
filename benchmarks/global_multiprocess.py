"""global_array_from_local in 2 processes (run by global_assembly.bench_global_two_processes).

Usage: ``meshkit launch -n 2 -d 4 global_multiprocess.py BENCHMARKS_DIR``. Process 0 prints one
``BENCH {json}`` line with `global_assembly.measure`'s result.

Rows: 64 MiB per process on both meshes, copied and zero-copy (48 and 1024 calls per round);
64 KiB per process on the data mesh, copied and zero-copy, ``SMALL_CALLS`` calls per round.
Rounds are ``BENCH_REPEATS`` when set (every row alike), else the defaults below.
"""

import json
import sys

sys.path.insert(0, sys.argv[1])
from _timing import bench_rounds, keep_freed_memory

MALLOC = keep_freed_memory()  # before JAX starts its threads

import meshkit  # noqa: E402

meshkit.init()

import jax  # noqa: E402
from global_assembly import (  # noqa: E402
    COPY,
    SMALL_BYTES,
    ZERO_COPY,
    local_data,
    make_case,
    measure,
)
from jax.experimental import multihost_utils  # noqa: E402


def barrier() -> None:
    # A device collective, outside the timed span: both processes leave it together.
    multihost_utils.sync_global_devices("meshkit-bench")


per_process = jax.local_device_count()
data = meshkit.make_mesh({"data": -1})
replicated = meshkit.make_mesh({"data": -1, "model": per_process})
data_label = f"data={jax.device_count()} ({per_process} blocks per process)"
replicated_label = (
    f"data={jax.process_count()} x model={per_process} (1 block per process, on {per_process} "
    "devices)"
)
# Both processes build the same cases and run the same calls in the same order, as the
# cross-process checks of make_mesh and global_array_from_local require.
cases = []
# Rounds and calls per round per (data alignment, mesh): enough for medians within a few percent
# on a noisy 2-core machine: copied 64 MiB calls take milliseconds, zero-copy ones tens of
# microseconds.
rounds = {
    (False, data): (11, 48),
    (False, replicated): (11, 48),
    (True, data): (15, 1024),
    (True, replicated): (11, 1024),
}
for aligned, kind in ((False, COPY), (True, ZERO_COPY)):
    local = local_data(seed=jax.process_index(), aligned=aligned)
    for mesh, label in ((data, data_label), (replicated, replicated_label)):
        n, calls = rounds[aligned, mesh]
        cases.append(
            make_case(
                mesh, local, label=f"{label}, {kind}", rounds=bench_rounds(n), number=calls,
                verify=True,
            )
        )  # fmt: skip
# 64 KiB per process (issue 13's small size), data mesh only. A call takes tens of
# microseconds, so a round is SMALL_CALLS calls: the barrier's noise is spread over them.
SMALL_CALLS = 1024
SMALL_ROUNDS = 41
for aligned, kind in ((False, COPY), (True, ZERO_COPY)):
    local = local_data(seed=jax.process_index(), aligned=aligned, nbytes=SMALL_BYTES)
    cases.append(
        make_case(
            data,
            local,
            label=f"{data_label}, 64 KiB, {kind}",
            rounds=bench_rounds(SMALL_ROUNDS),
            number=SMALL_CALLS,
            verify=True,
        )
    )
result = measure(cases, sync=barrier)
if jax.process_index() == 0:
    print("BENCH " + json.dumps({**result, "malloc": MALLOC}))
