"""Debug mode: a process with other data becomes an error that names it, not a hang.

Every process reads its own rows of each evaluation batch (host data: `meshkit.spmd` takes
each process's part and assembles the global batch); process 1's part of batch 3 is truncated.
With `meshkit.debug` on, each call is compared across processes through the coordination
service; a call that differs from the one 12 calls back in its thread (as every call of a loop's
first 12 does) is compared before it runs, so here both processes raise the same
`meshkit.DivergenceError` at batch 3, caught and printed. (Later in a long loop, only the
process whose call changed raises at the call; one that repeated its call raises the same error
at its next meshkit call.)
(Without debug mode, `meshkit.spmd`'s own check of host arguments would still stop both
processes, with a `meshkit.MeshkitError`; debug mode also covers arguments that are already
global arrays, static arguments and calls of different functions, and names the call.)

    meshkit launch -n 2 --devices-per-process 4 examples/debug_mode.py

Setting MESHKIT_DEBUG=1 in the environment does the same as `meshkit.debug.enable()`.
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 --devices-per-process 4

import meshkit

info = meshkit.init()
meshkit.debug.enable(timeout=60)  # in every process, before the calls to check

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshkit import collectives as C  # noqa: E402

mesh = meshkit.make_mesh({"data": -1})


@meshkit.spmd(mesh=mesh, in_specs="data", out_specs="")
def mean_loss(batch):
    """Each device's share of the batch; the mean over all devices of all processes."""
    return C.pmean(batch.mean(keepdims=True), "data")


def eval_batches(process_id: int):
    for step in range(5):
        rows = 8 if (process_id == 1 and step == 3) else 16  # process 1: a truncated file
        yield np.full((rows, 4), step, np.float32)


for step, batch in enumerate(eval_batches(info.process_id)):
    try:
        loss = mean_loss(batch)
    except meshkit.DivergenceError as e:
        # Both processes raise the same error at this call (one of the first 12 of the loop,
        # each compared before it runs), so they stay in step.
        if info.process_id == 0:
            print(f"step {step}: {type(e).__name__} (processes {e.processes}, field {e.field!r}):")
            print("  " + str(e).splitlines()[0])
        break
    if info.process_id == 0:
        print(f"step {step}: loss {float(np.asarray(jax.device_get(loss)).ravel()[0]):.1f}")

# A named meeting point that never hangs: every process arrives, or the arrived ones raise.
meshkit.barrier("end of the demo", timeout=60)
if info.process_id == 0:
    print("all processes reached the end")
