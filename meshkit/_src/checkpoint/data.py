"""The data position inside a checkpoint: what `meshkit.checkpoint.save`'s ``data=`` adds.

The position goes into orbax's commit as custom metadata, written by process 0. Its common
part is one more entry of the save's agreement; per-process states (a grain iterator's) are
posted to the coordination service before that agreement, and process 0 reads them after it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from ..coord import agree as _agree
from ..core import compat as _compat
from ..core.data_position import DataPosition
from ..core.errors import MeshkitError

KEY = "meshkit"  # custom metadata: {"meshkit": {"data_position": DataPosition.to_dict()}}
_POSITION = "data_position"
DATA_FIX = (
    "Consider data= the iterator that fed the step being saved, saved after the same step on "
    "every process (each process's position then says the same)."
)


@dataclasses.dataclass(frozen=True)
class Shared:
    """A save's data position (None: no ``data=``), and where its states were posted (None: not)."""

    position: DataPosition | None = None
    prefix: str | None = None

    @property
    def entry(self) -> list[Any]:
        """The position's entry in the save's agreement."""
        position = self.position
        return ["data=", "data", "no data position" if position is None else position.describe()]

    def metadata(self) -> dict[str, Any]:
        """Orbax's ``save`` keyword arguments, after the agreement; process 0 gathers the states."""
        if self.position is None:
            return {}
        _, me, n = _compat.distributed_state()
        position = dataclasses.replace(self.position, processes=n)
        node = _agree.node()
        if self.prefix is not None and node is not None and me == 0:
            found = {int(k.rsplit("/", 1)[1]): v for k, v in node.service.dir_get(self.prefix)}
            node.service.delete(self.prefix)
            assert position.states is not None
            found[0] = position.states[0]  # its own, not sent
            position = dataclasses.replace(position, states=dict(sorted(found.items())))
        elif position.states is not None and self.prefix is None:  # one process: its state
            position = dataclasses.replace(position, states={me: position.states[me]})
        return {"custom_metadata": {KEY: {_POSITION: position.to_dict()}}}


def share(data: Any, where: Path, what: str) -> Shared:
    """``data``'s position (a `DataPosition` or ``data.position()``); others post their state."""
    if data is None:
        return Shared()
    position = data
    if not isinstance(data, DataPosition):
        method = getattr(data, "position", None)
        position = method() if callable(method) else None
    if not isinstance(position, DataPosition):
        raise MeshkitError(
            f"{what}: data must be a meshkit.GlobalBatches (its position() is saved) or a "
            f"meshkit.DataPosition; got {type(data).__name__}.\n"
            "Consider data=batches, the meshkit.global_batches iterator that fed this step."
        )
    if position.states is None:
        return Shared(position)
    me = _compat.distributed_state()[1]
    state = position.states.get(me)
    if state is None:
        raise MeshkitError(
            f"{what}: data= holds per-process states of processes {sorted(position.states)}"
            f", none of this process ({me}).\nConsider data=batches, the iterator itself."
        )
    unsavable = json.loads(state).get("unsavable")
    if unsavable is not None:
        raise MeshkitError(
            f"{what}: data='s source keeps a state of type {unsavable} (its get_state()), "
            "which is neither bytes nor JSON values: it cannot go into a checkpoint's "
            "metadata.\nConsider a source whose get_state() gives bytes or JSON values (a "
            "grain DataLoader or IterDataset iterator), or meshkit.loaders.grain_batches / "
            "hf_batches."
        )
    node = _agree.node()
    if node is None:
        return Shared(position)
    digest = hashlib.blake2b(str(where).encode(), digest_size=8).hexdigest()
    prefix = f"meshkit/checkpoint/data/{digest}/"
    if me != 0:  # process 0 has its own
        node.service.set(prefix + str(me), state, overwrite=True)
    return Shared(position, prefix)


def from_metadata(custom: Any) -> Any:
    """The position's plain value in a checkpoint's custom metadata (None: none saved)."""
    if not isinstance(custom, dict):
        return None
    mine = custom.get(KEY)
    return mine.get(_POSITION) if isinstance(mine, dict) else None
