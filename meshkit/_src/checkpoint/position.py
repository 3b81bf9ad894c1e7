"""`data_position`: the data position a checkpoint was saved with (``save(..., data=...)``)."""

from __future__ import annotations

import os

from ..core.data_position import DataPosition
from ..core.errors import MeshkitError
from ..core.tracebacks import public
from . import data as _data
from . import orbax as _orbax

__all__ = ["data_position"]

# orbax's step metadata file, where a checkpoint's custom metadata lives (written by process 0
# inside the save's commit).
_STEP_METADATA = "_CHECKPOINT_METADATA"


@public
def data_position(path: str | os.PathLike[str], *, missing_ok: bool = False) -> DataPosition | None:
    """The `meshkit.DataPosition` saved with the checkpoint at ``path`` (``save(data=...)``).

    Reads the checkpoint's metadata only (no array), with nothing exchanged between processes:
    every process reads the same file and gets the same answer. Pass the result to
    ``meshkit.global_batches(..., start=position)`` to resume the data at the global batch the
    saved run would have taken next.

    Args:
        path: a checkpoint directory written by `save`.
        missing_ok: return None for a checkpoint saved without ``data=`` (the data then starts
            from its beginning with ``start=None``), instead of raising.

    Returns:
        A `meshkit.DataPosition` (None: none saved, with ``missing_ok``).

    Raises:
        MeshkitError: no complete checkpoint at ``path`` (as `restore`); a checkpoint saved
            without ``data=`` (unless ``missing_ok``); a position of a newer format.

    Example:
        >>> import numpy as np, meshkit, tempfile
        >>> mesh = meshkit.make_mesh({"data": -1})
        >>> loader = (np.ones((8, 2), np.float32) for _ in range(3))
        >>> path = tempfile.mkdtemp() + "/step_1"
        >>> with meshkit.global_batches(loader, mesh, "data") as batches:
        ...     _ = next(batches)
        ...     meshkit.checkpoint.save(path, {"step": 1}, data=batches)
        >>> meshkit.checkpoint.data_position(path).step
        1
    """
    what = "meshkit.checkpoint.data_position"
    ocp = _orbax._import_orbax(what)
    where = _orbax._path(path, what)
    if not isinstance(missing_ok, bool):
        raise MeshkitError(f"{what}: missing_ok must be True or False; got {missing_ok!r}.")
    if _orbax._TMP_MARK in where.name or not (where / "_METADATA").is_file():
        _, problem = _orbax._read_metadata(ocp, where, what)  # the words of restore's checks
        raise MeshkitError(problem or f"{what}: {where} is no complete checkpoint.")
    value = None
    if (where / _STEP_METADATA).is_file():
        value = _data.from_metadata(ocp.metadata.get_step_metadata(where).custom_metadata)
    if value is not None:
        return DataPosition._read(value, what)
    if missing_ok:
        return None
    raise MeshkitError(
        f"{what}: the checkpoint at {where} was saved without a data position (no data= "
        "given to meshkit.checkpoint.save), so nothing says which batch comes next.\n"
        "Consider meshkit.checkpoint.save(path, tree, data=batches) with the "
        "meshkit.global_batches iterator that fed the step; for this checkpoint, "
        "data_position(path, missing_ok=True) gives None, and start=None starts the data "
        "from its beginning."
    )
