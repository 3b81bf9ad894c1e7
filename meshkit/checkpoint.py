"""Checkpoints of global arrays with orbax, restored onto any mesh (needs ``meshkit[orbax]``).

`save` writes a pytree of global arrays (and host values) with orbax's
``StandardCheckpointer``: every process writes the shards its devices hold, and the checkpoint
appears only when all of them have finished (orbax writes into a temporary directory and renames
it). `restore` reads one onto a mesh of any shape, in any number of processes: each array
keeps the spec it was saved with, or takes the one given, and each process reads only the
blocks its devices hold.

Both check what they are given first, in every process, and the processes agree on the verdict
(one barrier of the coordination service) before orbax is called, so a mistake is a
`meshkit.MeshkitError` on every process, never a deep error on one of them while the others
wait:

* `save` refuses process-local arrays (what `meshkit.pmap_compat` returns by default in a
  multi-process run, and ``jax.pmap``), which orbax cannot save, names the way to make them
  global, and checks that the processes save the same tree with the same host values (orbax
  writes host values from process 0 only);
* `restore` checks every array against the target mesh before reading (a dimension its mesh
  axes do not divide, a spec naming an axis the mesh lacks, a mesh that leaves a process out)
  and refuses a directory whose save never finished.

``save(..., data=batches)`` keeps where the data stands (the `meshkit.DataPosition` of the
`meshkit.global_batches` iterator that fed the step) inside the same commit; `data_position`
reads it back, and ``global_batches(..., start=position)`` resumes at the next global batch, on
any number of processes for meshkit's own loaders.

With orbax's ``CheckpointManager`` (steps, ``max_to_keep``, asynchronous saves), use the two
checks directly: `check_savable` before ``manager.save`` and `targets` to build the restore
targets (see ``examples/resumable_training.py``).

Example:
    ```python
    import meshkit, numpy as np

    meshkit.init()
    mesh = meshkit.make_mesh({"data": -1, "model": 4})
    w = meshkit.global_array_from_local(local_w, mesh, "data model")
    meshkit.checkpoint.save("/ckpt/step_100", {"w": w, "step": 100})

    # later, on another mesh shape or process count:
    mesh = meshkit.make_mesh({"data": 1, "model": -1})
    state = meshkit.checkpoint.restore("/ckpt/step_100", mesh, {"w": "_ model"})
    ```
"""

from ._src.checkpoint.orbax import check_savable as check_savable
from ._src.checkpoint.orbax import data_position as data_position
from ._src.checkpoint.orbax import restore as restore
from ._src.checkpoint.orbax import save as save
from ._src.checkpoint.orbax import targets as targets
from ._src.checkpoint.steps import Latest as Latest
from ._src.checkpoint.steps import latest as latest
from ._src.checkpoint.steps import should_save as should_save
from ._src.checkpoint.steps import step_path as step_path

__all__ = [
    "Latest",
    "check_savable",
    "data_position",
    "latest",
    "restore",
    "save",
    "should_save",
    "step_path",
    "targets",
]
