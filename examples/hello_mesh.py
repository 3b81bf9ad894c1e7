"""The meshkit demo: one mesh over every device of every process, and a cross-process psum.

Run it with 2 processes x 4 CPU devices:

    meshkit launch -n 2 --devices-per-process 4 examples/hello_mesh.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 --devices-per-process 4

import meshkit

# Join the program first, before any other JAX call (reads what `meshkit launch` set).
info = meshkit.init()
print(
    f"process {info.process_id}/{info.num_processes}: joined through {info.source} ({info.reason})"
)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# "model" spans one host's devices, so its collectives stay inside the host; "data" crosses hosts.
mesh = meshkit.make_mesh({"data": -1, "model": jax.local_device_count()})
if info.process_id == 0:
    print(meshkit.describe(mesh))

# Each device holds one number: its position in the mesh, 0..N-1. Their sum crosses processes.
n = mesh.devices.size
sharding = NamedSharding(mesh, P(("data", "model")))
x = jax.make_array_from_callback((n,), sharding, lambda idx: np.arange(n, dtype=np.float32)[idx])


@jax.jit
def total(v):
    return jax.shard_map(
        lambda block: jax.lax.psum(block.sum(keepdims=True), ("data", "model")),
        mesh=mesh,
        in_specs=P(("data", "model")),
        out_specs=P(),
    )(v)


result = float(total(x).addressable_data(0)[0])
expected = n * (n - 1) / 2
print(
    f"process {info.process_id}/{info.num_processes}: psum over {n} devices "
    f"= {result:g} (expected {expected:g})"
)
assert result == expected, (result, expected)
