"""Which accelerators a task of a scheduler owns, when the scheduler bound them to it.

Under SLURM or Open MPI ``jax.distributed.initialize`` gives each process the one device
numbered by its local rank. Where the scheduler bound GPUs to each task (``srun
--gpus-per-task``, ``--gpu-bind``), the task sees only its own GPUs, renumbered from 0, and
local rank 3 asks for a device it cannot see (JAX issue 16788). `bound_device_ids` tells the two
cases apart from the environment, before JAX is asked; the rule is the table of
``docs/multi-host.md`` ("GPUs bound to each task").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..core.env import visible_devices

__all__ = ["Binding", "bound_device_ids"]


@dataclasses.dataclass(frozen=True)
class Binding:
    """The accelerators a task owns, and why meshkit thinks so.

    Attributes:
        ids: device ids in the task's own numbering (what JAX's ``local_device_ids`` takes).
        reason: the variables that say so, for `meshkit.runtime_info` and messages.
    """

    ids: tuple[int, ...]
    reason: str


def _count(text: str | None) -> int | None:
    """The number in ``"2"`` or ``"a100:2"`` (SLURM's ``[type:]count``)."""
    if text is None:
        return None
    tail = text.strip().rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def bound_device_ids(environ: Mapping[str, str], local_rank: int | None) -> Binding | None:
    """The devices a scheduler bound to this task, or None when JAX's choice is right.

    Args:
        environ: the process's environment.
        local_rank: the task's index on its node, which JAX would use as its one device id
            (None when JAX would not choose: nothing to correct).

    Returns:
        The task's own devices, or None.

    Examples:
        >>> bound_device_ids({"CUDA_VISIBLE_DEVICES": "3"}, 3).ids  # srun --gpu-bind
        (0,)
        >>> env = {"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_GPUS_PER_TASK": "2"}
        >>> bound_device_ids(env, 1).ids  # srun --gpus-per-task=2
        (0, 1)
        >>> bound_device_ids({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 1) is None  # all visible
        True
    """
    visible = visible_devices(environ)
    if visible is None or local_rank is None:
        return None
    name, count = visible
    if count == 0:
        return None
    listed = f"{name}={environ[name]}"
    per_task = _count(environ.get("SLURM_GPUS_PER_TASK"))
    if per_task == count:
        why = f"SLURM_GPUS_PER_TASK={environ['SLURM_GPUS_PER_TASK']} and {listed}"
        return Binding(tuple(range(count)), f"{why}: the task's own GPUs")
    if local_rank >= count:
        why = f"local rank {local_rank} with {listed}"
        return Binding(tuple(range(count)), f"{why}: the scheduler bound these to the task")
    return None
