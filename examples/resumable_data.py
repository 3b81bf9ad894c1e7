"""Resuming the data at the same batch: the data position saved inside each checkpoint.

A grain ``MapDataset`` of 100 rows is read for 2 epochs in global batches of 16 (shuffled per
epoch, the last batch of each epoch short) by `meshkit.loaders.grain_batches`, through
`meshkit.global_batches`. Each step's "training" sums the batch into a running total, and
every 3 steps `meshkit.checkpoint.save` writes the total with ``data=batches``: the position
after the batches the loop took (not after those the helper thread read ahead).

A run that stops after step 8 (as if killed: step 8 was never saved) and a restart from its
latest checkpoint (step 6) see exactly the global batches of an uninterrupted run: the restart
reads the position with `meshkit.checkpoint.data_position` and passes it as ``start=``. The
position is global (an epoch and a step in it), so the restart could run on any number of
processes.

    python examples/resumable_data.py
    meshkit launch -n 2 -d 4 examples/resumable_data.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 4

import os
import shutil
import tempfile
from pathlib import Path

import meshkit

info = meshkit.init()  # first, before any other JAX call

import jax  # noqa: E402

if info.num_processes == 1 and info.cpu_devices is None:
    jax.config.update("jax_num_cpu_devices", 8)  # alone: 8 CPU devices, as in the launched run

import grain  # noqa: E402
import numpy as np  # noqa: E402

from meshkit import loaders  # noqa: E402

ROWS, GLOBAL_BATCH, EPOCHS, EVERY = 100, 16, 2, 3
mesh = meshkit.make_mesh({"data": -1})


def say(text):
    if info.process_id == 0:
        print(text, flush=True)


def loader():
    part = meshkit.process_slice(mesh, "data", (GLOBAL_BATCH,))
    rows = grain.MapDataset.range(ROWS).map(lambda i: {"id": np.int32(i)})
    return loaders.grain_batches(rows, part, seed=0, epochs=EPOCHS)


@jax.jit
def train_step(total, batch, mask):
    return total + (batch["id"] * mask).sum()


# --8<-- [start:resume]
def train(root, label, *, stop_after=None):
    """Run to the end from the latest checkpoint under ``root``; each step's row ids."""
    found = meshkit.checkpoint.latest(root)
    total, start = np.int32(0), None
    if found is not None:
        total = meshkit.checkpoint.restore(found.path, mesh)["total"]
        start = meshkit.checkpoint.data_position(found.path)
        say(f"{label}: resumed after step {start.step} (epoch {start.epoch}, its step "
            f"{start.epoch_step})")  # fmt: skip
    seen = {}
    with meshkit.global_batches(loader(), mesh, "data", pad="ragged", start=start) as batches:
        for batch, mask in batches:
            total = train_step(total, batch, mask)
            full = meshkit.gather({"id": batch["id"], "mask": mask})
            seen[batches.steps] = full["id"][full["mask"]].tolist()
            if batches.steps % EVERY == 0:
                path = meshkit.checkpoint.step_path(root, batches.steps)
                meshkit.checkpoint.save(path, {"total": total}, data=batches)
            if batches.steps == stop_after:
                say(f"{label}: stopped after step {batches.steps}, as if killed")
                break
    return seen, int(total)


# --8<-- [end:resume]

# Every process must see the same directory: one named after this run's coordinator port.
port = info.coordinator_address.rsplit(":", 1)[1] if info.coordinator_address else None
run = f"port{port}" if port else f"pid{os.getpid()}"
root = Path(tempfile.gettempdir()) / f"meshkit-resumable-data-{run}"
if info.process_id == 0:
    shutil.rmtree(root, ignore_errors=True)
meshkit.barrier("resumable_data: a fresh directory")
reference, total = train(root / "uninterrupted", "uninterrupted")
first, _ = train(root / "interrupted", "first run", stop_after=8)
restarted, resumed_total = train(root / "interrupted", "restarted")
assert min(restarted) == 7, sorted(restarted)  # it resumed after the checkpoint of step 6
same = all(steps[s] == reference[s] for steps in (first, restarted) for s in steps)
say(f"the first run and the restart take the uninterrupted run's batches: {same}")
assert same, (reference, first, restarted)
assert resumed_total == total == EPOCHS * sum(range(ROWS)), (resumed_total, total)
meshkit.barrier("resumable_data: done")
if info.process_id == 0:
    shutil.rmtree(root)
print(f"process {info.process_id}/{info.num_processes}: OK")
