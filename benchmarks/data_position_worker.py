"""What ``save(..., data=...)`` adds to a checkpoint, in 2 processes (run by data_position.py).

Usage: ``meshkit launch -n 2 -d 4 data_position_worker.py BENCHMARKS_DIR ROOT``, ROOT a
directory every process sees. Process 0 prints one
``BENCH {json}`` line. For each source (a `meshkit.loaders.grain_batches` loader, whose position
is global, and a grain ``DataLoader``, whose per-process states reach process 0 through the
coordination service): the median seconds of ``save(tree)`` and ``save(tree, data=batches)``
over interleaved rounds (a new directory each, a meshkit.barrier before each, outside the timed
span); the position's own work per process, timed alone (``position()``, its checks, the key
set, process 0's directory read and the metadata); and the bytes of the position in the
checkpoint's metadata per process.
"""

import json
import shutil
import statistics
import sys
import time
import warnings

sys.path.insert(0, sys.argv[1])
import meshkit

meshkit.init()

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from _timing import bench_rounds  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from meshkit import loaders  # noqa: E402
from meshkit._src.checkpoint import data as _data  # noqa: E402
from meshkit._src.coord import agree  # noqa: E402

warnings.simplefilter("ignore", meshkit.DtypeWarning)
me, n = jax.process_index(), jax.process_count()
mesh = meshkit.make_mesh({"data": -1})
part = meshkit.process_slice(mesh, "data", (64,))
rows = np.arange(1 << 18, dtype=np.float32).reshape(-1, 64)  # 1 MiB per process
tree = {"w": meshkit.global_array_from_local(rows, mesh, "data"), "step": 1}
records = [{"id": np.int32(i)} for i in range(4096)]


def meshkit_loader():
    return loaders.grain_batches(grain.MapDataset.source(records), part, seed=1, epochs=2)


def dataloader():
    return grain.DataLoader(
        data_source=records,
        sampler=loaders.grain_sampler(len(records), part, shuffle=True, seed=1),
        shard_options=grain.sharding.NoSharding(),
        operations=[grain.transforms.Batch(part.local_shape[0])],
    )


root = sys.argv[2]
saves = 0


def save(data):
    global saves
    saves += 1
    meshkit.barrier(f"bench-data-{saves}")  # outside the timed span: both start together
    start = time.perf_counter()
    meshkit.checkpoint.save(f"{root}/c{saves}", tree, data=data)
    elapsed = time.perf_counter() - start
    meshkit.barrier(f"bench-data-{saves}-done")
    if me == 0:
        shutil.rmtree(f"{root}/c{saves}")
    return elapsed


def own_work(batches, calls=200):
    """The position's work in a save, per process, timed alone (keys sent and read included).

    The median call: a loaded 2-core machine delays some requests by milliseconds.
    """
    seconds = []
    for i in range(calls):
        start = time.perf_counter()
        _, shared = _data.share(batches, f"{root}/own-{i}", None, "bench")
        _ = shared.entry
        shared.metadata()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def one_request(calls=200):
    """One request to the coordination service, for scale: a key set (the median)."""
    node = agree.node()
    seconds = []
    for i in range(calls):
        start = time.perf_counter()
        node.service.set(f"bench/data/{me}/{i}", "x", overwrite=True)
        seconds.append(time.perf_counter() - start)
    node.service.delete(f"bench/data/{me}/")
    return statistics.median(seconds)


out = {}
meshkit.barrier("bench-data-request")
request = one_request()
for name, make in (("grain_batches", meshkit_loader), ("DataLoader", dataloader)):
    batches = meshkit.global_batches(make(), mesh, "data", pad=True)
    next(batches)
    plain, with_data = [], []
    save(None), save(batches)  # warm-up, untimed
    for r in range(bench_rounds(11)):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            (plain, with_data)[which].append(save(batches if which else None))
    meshkit.barrier(f"bench-data-own-{name}")
    own = own_work(batches)
    meshkit.barrier(f"bench-data-own-{name}-done")
    owns = multihost_utils.process_allgather(np.array([own])).reshape(-1).tolist()
    _, shared = _data.share(batches, f"{root}/size", None, "bench")
    meshkit.barrier(f"bench-data-size-{name}")
    size = len(json.dumps(shared.metadata()["custom_metadata"], separators=(",", ":")))
    batches.close()
    out[name] = {
        "plain": plain,
        "data": with_data,
        "own": owns,
        "bytes_per_process": size / n,
    }
if me == 0:
    print("BENCH " + json.dumps({"sources": out, "request": request}))
