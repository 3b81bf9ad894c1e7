"""The program tests/test_slurm.py starts under SLURM's srun (2 tasks x 4 CPU devices).

Each process prints what it computed; the test asserts on the numbers. With the argument
``fail``, process 1 raises before the first collective, and process 0 waits in it.
"""

import os
import sys
import time

import meshkit

info = meshkit.init()  # JAX's SLURM detection: SLURM_JOB_ID, SLURM_STEP_NODELIST, ...

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshkit import collectives as C  # noqa: E402

me, n = info.process_id, info.num_processes
print(
    f"process {me}/{n}: joined through {info.source} ({info.cluster}), "
    f"coordinator {info.coordinator_address}, SLURM job {os.environ['SLURM_JOB_ID']}",
    flush=True,
)
print(f"process {me}/{n}: local devices {info.local_device_ids}; {info.reason}", flush=True)
if sys.argv[1:] == ["fail"] and me == 1:
    print(f"process 1 fails at {time.time():.3f}", flush=True)
    raise RuntimeError("planted failure in process 1")

mesh = meshkit.make_mesh({"data": -1, "model": jax.local_device_count()})
print(f"process {me}/{n}: mesh {dict(mesh.shape)}, {mesh.devices.size} devices", flush=True)

# A global 8 x 3 array, one row per device: each process provides the rows of its devices.
ref = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
part = meshkit.process_slice(mesh, "(data model)", ref.shape)
local = part.take(ref)
g = meshkit.global_array_from_local(local, mesh, "(data model)")

total = meshkit.spmd(
    lambda block: C.psum(block.sum(keepdims=True), ("data", "model")),
    mesh=mesh,
    in_specs="(data model)",
    out_specs="_",
)(g)
print(f"process {me}/{n}: psum over {mesh.devices.size} devices = {float(total[0, 0]):g}")

back = meshkit.local_from_global(g)
whole = meshkit.gather(g)
(rows,) = part.ranges[0]
print(
    f"process {me}/{n}: rows {rows[0]}-{rows[1] - 1} round trip "
    f"{'equal' if np.array_equal(back, local) else 'DIFFERENT'}, gather "
    f"{'equal' if np.array_equal(whole, ref) else 'DIFFERENT'} (sum {whole.sum():g})",
    flush=True,
)
