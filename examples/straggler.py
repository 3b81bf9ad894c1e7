"""A straggler, named while the run goes on: process 1's loader is 80 ms slower per batch.

Every process waits for the slowest at each step's collective, so the whole run goes at its
pace. Process 0 names it from the step times every process posts (windows of 1 s here, 30 s by
default), and every process reads the table with `meshkit.step_times()`. Every process also
takes a `jax.profiler` trace of the same steps (`meshkit.profile_steps`: one run directory,
a trace per process, for TensorBoard or XProf), and process 0 prints where its own time went
(`meshkit.runtime_info().goodput()`; the launcher's report ends with the whole run's).

    meshkit launch -n 2 --devices-per-process 2 examples/straggler.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 2

import os
import pathlib
import tempfile
import time

os.environ.setdefault("MESHKIT_STEP_WINDOW", "1")  # a window a second, for a short demo

import meshkit

info = meshkit.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402

STEPS, EXTRA_MS = 60, 80 if info.process_id == 1 and info.num_processes > 1 else 0

mesh = meshkit.make_mesh({"data": -1})


def loader():
    """This process's rows of each global batch; process 1's take longer to load."""
    for step in range(STEPS):
        time.sleep((5 + EXTRA_MS) / 1000)
        yield np.full((8, 4), step, np.float32)


# One directory for every process of this run (named after the launcher's process).
profiles = pathlib.Path(tempfile.gettempdir()) / f"meshkit-straggler-{os.getppid()}"
traces = meshkit.profile_steps(20, 22, profiles)  # steps 20 to 22, on every process
step = jax.jit(lambda batch: batch.sum())  # a sum over every process's rows: a collective
with meshkit.global_batches(loader(), mesh, "data") as batches:
    for batch in batches:
        total = float(step(batch))
        if batches.steps == STEPS - 5 and info.process_id == 0:
            for row in meshkit.step_times():  # every process's latest window, slowest first
                print(
                    f"process {row.process}: {row.step_ms:.0f} ms per step, "
                    f"{row.loader_ms:.0f} ms in its loader, {row.host_ms:.1f} ms host work"
                )
if info.process_id == 0:
    files = sorted(p.name for p in pathlib.Path(traces).iterdir())
    print(f"traces of steps 20-22 in {traces}: {files}")
    print(f"(open them with: tensorboard --logdir {profiles})")
    print(meshkit.runtime_info().goodput())
