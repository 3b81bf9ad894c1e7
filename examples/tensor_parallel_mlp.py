"""A tensor-parallel MLP layer through meshkit.spmd, checked against the single-device result.

    y = gelu(x @ W1 + b1) @ W2 + b2

The batch is split over the "data" axis. W1 is split by columns over "model" (column-parallel),
so each device computes its own slice of the hidden layer, and the nonlinearity needs no
communication; W2 is split by rows (row-parallel), so each device's product is a partial sum of
the output, and one psum over "model" completes it.

Run it alone (8 CPU devices in one process) or as 2 processes x 4 CPU devices:

    python examples/tensor_parallel_mlp.py
    meshkit launch -n 2 --devices-per-process 4 examples/tensor_parallel_mlp.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 --devices-per-process 4

import meshkit

info = meshkit.init()  # first, before any other JAX call

import jax  # noqa: E402

if info.num_processes == 1 and info.cpu_devices is None:
    # Alone, and MESHKIT_CPU_DEVICES is not set: give this process 8 CPU devices (before any
    # backend use), so the mesh below has both axes. Under the launcher each process already
    # has the CPU devices it was given.
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from meshkit import collectives as C  # noqa: E402

# "model" stays inside a host, where its psum is cheap; "data" crosses hosts. 2 x 4 in both runs.
mesh = meshkit.make_mesh({"data": -1, "model": min(4, jax.local_device_count())})
if info.process_id == 0:
    print(meshkit.describe(mesh))

BATCH, D_IN, HIDDEN, D_OUT = 16, 32, 64, 24


@meshkit.spmd(
    mesh=mesh,
    in_specs=(
        "batch d_in -> data _",  # x: rows split over data
        "d_in hidden -> _ model",  # W1: columns split over model
        "hidden -> model",  # b1: follows W1's columns
        "hidden d_out -> model _",  # W2: rows split over model
        "d_out -> _",  # b2: whole on every device
    ),
    out_specs="batch d_out -> data _",
)
def mlp(x, w1, b1, w2, b2):
    # Each argument is this device's block: x (8, 32), w1 (32, 16), b1 (16,), w2 (16, 24).
    h = jax.nn.gelu(x @ w1 + b1)  # this device's 16 of the 64 hidden units
    partial = h @ w2  # its share of the output: the sum over its hidden units only
    return C.psum(partial, "model") + b2  # the same on every device along model


def mlp_reference(x, w1, b1, w2, b2):
    """The same layer, unsplit, as plain jnp code."""
    return jax.nn.gelu(x @ w1 + b1) @ w2 + b2


# A fixed seed gives every process the same whole arrays, for the reference below.
rng = np.random.default_rng(0)
x = rng.standard_normal((BATCH, D_IN), dtype=np.float32)
w1 = rng.standard_normal((D_IN, HIDDEN), dtype=np.float32) / np.sqrt(D_IN)
b1 = rng.standard_normal(HIDDEN, dtype=np.float32)
w2 = rng.standard_normal((HIDDEN, D_OUT), dtype=np.float32) / np.sqrt(HIDDEN)
b2 = rng.standard_normal(D_OUT, dtype=np.float32)

# Host data passed to spmd is this process's part of each argument. The batch is split over
# "data", across processes: each process passes its own rows (process_slice says which; a real
# loader would read only those). The weights are not split across processes: every process
# passes them whole, and the same.
my_rows = meshkit.process_slice(mesh, "data _", x.shape).take(x)

out = mlp(my_rows, w1, b1, w2, b2)  # a global array, rows split over data, on every device
# Its rows live on several processes; process_allgather brings the whole value to each one.
result = np.asarray(multihost_utils.process_allgather(out, tiled=True))

# The plain computation, jitted for this process's default device alone.
reference = np.asarray(jax.jit(mlp_reference)(x, w1, b1, w2, b2))

error = float(np.max(np.abs(result - reference)))
print(
    f"process {info.process_id}/{info.num_processes}: output {result.shape} split as "
    f"{out.sharding.spec}; max abs error vs one device: {error:.2e}"
)
np.testing.assert_allclose(result, reference, rtol=1e-5, atol=1e-5)
print(f"process {info.process_id}/{info.num_processes}: OK")
