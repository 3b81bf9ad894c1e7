"""The transfer: a process's prepared part onto its local devices, and the global arrays.

On CPU, one batched put per array (what `jax.make_array_from_callback` ends in, without its
per-device callbacks), which puts every device's numpy view in one call (XLA's CPU client
aliases 64-byte-aligned host memory instead of copying it, as `jax.device_put` does). On
accelerators, one batched ``jax.device_put`` of the distinct blocks, one more that copies
blocks to the other local devices holding the same block (replicas, device to device, not from
the host again), and ``jax.make_array_from_single_device_arrays``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..core import caches as _caches
from ..core import compat as _compat
from ..sharding import layout as _layout
from .blocks import Prepared

__all__ = ["assemble", "transfer"]


def _all_from_host(prepared: Prepared) -> bool:
    """Whether every block, replicas included, goes from the host: one batched put per array.

    On CPU a device-to-device copy of a replica is a memcpy like the host one, but a host buffer
    aligned for XLA is aliased rather than copied, and `jax.make_array_from_callback` puts all
    of an array's blocks in one call (about a fifth of the overhead of a list put of the same
    views). Accelerators copy replicas device to device, faster than from pageable host memory.
    """
    return all(
        pl.device.platform == "cpu" for leaf in prepared.leaves for pl in leaf.plan.placements[:1]
    )


def _mask_value(prepared: Prepared) -> np.ndarray | None:
    """This process's padding mask (True on real rows), when `pad=True` made one."""
    if prepared.mask_plan is None or prepared.mask_rows is None:
        return None
    real, rows = prepared.mask_rows
    mask = np.zeros(rows, bool)
    mask[:real] = True
    return mask


# (sharding, global shape) -> the local devices in JAX's order and each one's block's index.
_orders: _caches.Cache[tuple[NamedSharding, tuple[int, ...]], tuple[list[Any], list[Any]]] = (
    _caches.Cache(maxsize=512)
)


def _put_order(plan: _layout.Plan, sharding: NamedSharding) -> tuple[list[Any], list[Any]]:
    """Local devices in the order JAX lists them, and the local index of each one's block."""
    key = (sharding, plan.global_shape)
    order = _orders.get(key)
    if order is None:
        by_device = {pl.device: pl.local_index for pl in plan.placements}
        devices = list(sharding.addressable_devices_indices_map(plan.global_shape))
        order = (devices, [by_device[d] for d in devices])
        _orders.put(key, order)
    return order


def _from_host(value: np.ndarray, plan: _layout.Plan, sharding: NamedSharding) -> jax.Array:
    """One global array, every local device's block put from the host view in one call."""
    devices, indices = _put_order(plan, sharding)
    blocks = [value[index] for index in indices]
    return _compat.put_blocks(plan.global_shape, value.dtype, sharding, blocks, devices)


def transfer(prepared: Prepared) -> list[jax.Array]:
    """The global array of every leaf, then the mask if any.

    On CPU every block goes from the host (`_all_from_host`); elsewhere the distinct blocks go
    from the host in one batched put and replicas are copied device to device in another.
    """
    jobs: list[tuple[np.ndarray, _layout.Plan, NamedSharding]] = [
        (leaf.value, leaf.plan, leaf.sharding) for leaf in prepared.leaves
    ]
    mask = _mask_value(prepared)
    if mask is not None and prepared.mask_plan is not None and prepared.mask_sharding is not None:
        jobs.append((mask, prepared.mask_plan, prepared.mask_sharding))
    if _all_from_host(prepared):
        return [_from_host(value, plan, sharding) for value, plan, sharding in jobs]
    views, targets, where = [], [], []
    for i, (value, plan, _) in enumerate(jobs):
        for j, pl in enumerate(plan.placements):
            if pl.first:
                views.append(value[pl.local_index])
                targets.append(pl.device)
                where.append((i, j))
    placed = jax.device_put(views, targets)
    out: list[list[Any]] = [[None] * len(plan.placements) for _, plan, _ in jobs]
    by_block: dict[tuple[int, Any], jax.Array] = {}
    for (i, j), array in zip(where, placed, strict=True):
        out[i][j] = array
        by_block[(i, repr(jobs[i][1].placements[j].global_index))] = array
    copies, copy_targets, copy_where = [], [], []
    for i, (_, plan, _) in enumerate(jobs):
        for j, pl in enumerate(plan.placements):
            if not pl.first:
                copies.append(by_block[(i, repr(pl.global_index))])
                copy_targets.append(pl.device)
                copy_where.append((i, j))
    if copies:
        for (i, j), array in zip(copy_where, jax.device_put(copies, copy_targets), strict=True):
            out[i][j] = array
    return [
        jax.make_array_from_single_device_arrays(plan.global_shape, sharding, out[i])
        for i, (_, plan, sharding) in enumerate(jobs)
    ]


def assemble(prepared: Prepared, arrays: list[jax.Array]) -> tuple[Any, jax.Array | None]:
    """The global arrays in local's pytree, and the mask (None without padding)."""
    n = len(prepared.leaves)
    mask = arrays[n] if len(arrays) > n else None
    return jax.tree_util.tree_unflatten(prepared.treedef, arrays[:n]), mask
