"""Checkpoints of global arrays with orbax, restored onto any mesh (needs ``meshkit[orbax]``).

`save` and `restore` check their inputs on every process, and the processes agree on the
verdict before orbax is called, so a mistake is a `meshkit.MeshkitError` on every process.
For orbax's ``CheckpointManager``, use `check_savable` and `targets` directly. See
docs/checkpoints.md.

Examples:
    ```python
    meshkit.checkpoint.save("/ckpt/step_100", {"w": w, "step": 100})
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
    "Latest", "check_savable", "data_position", "latest", "restore", "save", "should_save",
    "step_path", "targets",
]  # fmt: skip
