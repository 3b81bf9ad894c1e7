"""A loop of `meshkit.global_batches` that fails once and resumes, for the goodput test.

    python goodput.py ROOT

8 steps of 50 ms (a sleep in each) on a ``{"data": -1}`` mesh, a checkpoint after every 4th
(``ROOT/step_<n>``). On the first attempt process 1 raises after step 5; the next attempt
restores step 4 and takes steps 5 to 8. At the end process 0 prints ``GOODPUT`` and the
fields of `meshkit.RuntimeInfo.goodput` as JSON.
"""

import dataclasses
import json
import sys
import time

import meshkit

info = meshkit.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

STEPS, EVERY, FAIL_AT = 8, 4, 5
root = sys.argv[1]
mesh = meshkit.make_mesh({"data": -1})
found = meshkit.checkpoint.latest(root)
w = jnp.zeros(4) if found is None else meshkit.checkpoint.restore(found.path, mesh)["w"]
start = 0 if found is None else found.step
rows = len(jax.local_devices())  # one row per device of this process


@jax.jit
def step(w, x):
    return w + x.mean(axis=0)


batches = (np.full((rows, 4), s, np.float32) for s in range(start + 1, STEPS + 1))
for n, x in enumerate(meshkit.global_batches(batches, mesh, "data"), start + 1):
    w = step(w, x)
    time.sleep(0.05)
    if n % EVERY == 0:
        meshkit.checkpoint.save(meshkit.checkpoint.step_path(root, n), {"w": w})
    if info.attempt == 0 and n == FAIL_AT and info.process_id == 1:
        raise RuntimeError(f"process 1 fails after step {n} on purpose")
if info.process_id == 0:
    print("GOODPUT", json.dumps(dataclasses.asdict(info.goodput())), flush=True)
