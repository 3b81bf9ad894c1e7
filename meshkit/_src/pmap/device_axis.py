"""Arrays with a leading device axis (the pmap convention) as global arrays over a 1-D mesh.

Legacy pmap code gives each process arrays whose axis 0 (or another mapped axis) has one entry
per local device. meshkit's form of such an array is a global `jax.Array` over a 1-D mesh of
every device of every process, ordered process by process (and by device id within a
process), with the mapped dimension split over the mesh axis: each device holds one entry.
In a single process that is exactly the array `jax.pmap` returns, shape ``(devices, ...)``;
with several processes the mapped dimension has ``jax.device_count()`` entries and process
``p`` holds entries ``p * L`` to ``(p + 1) * L - 1`` (``L`` local devices).

`pmap_compat`, the legacy helpers (`replicate`, `unreplicate`, `shard`, ...) and their tests
share these conversions, so arrays pass between them without copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..core import caches as _caches
from ..core.errors import MeshkitError

__all__ = [
    "DEFAULT_AXIS",
    "device_mesh",
    "from_local",
    "from_local_array",
    "local_devices",
    "local_view",
    "mapped_spec",
    "rewrap",
]

DEFAULT_AXIS = "devices"


def _ordered(devices: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(sorted(devices, key=lambda d: (d.process_index, d.id)))


@_caches.cached(maxsize=64)
def _mesh(devices: tuple[Any, ...], axis_name: str) -> Mesh:
    return Mesh(np.array(devices, dtype=object), (axis_name,), axis_types=(AxisType.Auto,))


def device_mesh(
    devices: Sequence[Any] | None = None,
    axis_name: str = DEFAULT_AXIS,
    *,
    what: str = "meshkit",
    keep_order: bool = False,
) -> Mesh:
    """The 1-D mesh of a device axis: ``devices`` (default: every device of every process).

    Ordered by process, then device id, so that every process builds the same mesh and a
    process's local devices hold a contiguous range of the mapped dimension. ``keep_order``:
    the order given instead, in a single-process run (`jax.pmap`'s ``devices=``). Cached.
    """
    if devices is None:
        chosen = _ordered(jax.devices())
    else:
        given = tuple(devices)
        single = all(d.process_index == jax.process_index() for d in given)
        chosen = given if keep_order and single and jax.process_count() == 1 else _ordered(given)
        if not chosen:
            raise MeshkitError(f"{what}: devices= is empty; give at least one device.")
        if len(set(chosen)) != len(chosen):
            raise MeshkitError(f"{what}: devices= lists a device twice: {list(devices)}.")
        processes = {d.process_index for d in chosen}
        if jax.process_index() not in processes:
            raise MeshkitError(
                f"{what}: devices= holds no device of this process ({jax.process_index()}); "
                "every process must map over some of its own devices."
            )
    return _mesh(chosen, axis_name)


def local_devices(mesh: Mesh) -> list[Any]:
    """This process's devices of a device-axis mesh, in mesh order (the local mapped order)."""
    me = jax.process_index()
    return [d for d in mesh.devices.flat if d.process_index == me]


def mapped_spec(dim: int, axis_name: str) -> PartitionSpec:
    """The spec that splits dimension ``dim`` over the device axis (one entry per device)."""
    return PartitionSpec(*([None] * dim), axis_name)


def from_local(value: Any, mesh: Mesh, dim: int) -> jax.Array:
    """A global array from this process's part: ``value.shape[dim]`` == its local entries.

    ``mesh`` is a device-axis mesh (1-D). The part goes to the local devices in one batched put
    (numpy, scalars and fully addressable arrays alike; on CPU, aligned numpy memory is used in
    place). The processes' parts are not compared here; `meshkit.global_array_from_local` does
    that.
    """
    name = mesh.axis_names[0]
    mine = local_devices(mesh)
    if isinstance(value, jax.Array) and len(value.devices()) > 1:
        value = np.asarray(value)  # a multi-device local array: read it once
    shape = tuple(np.shape(value))
    global_shape = (*shape[:dim], mesh.shape[name], *shape[dim + 1 :])
    sharding = NamedSharding(mesh, mapped_spec(dim, name))
    # This process's first mapped entry.
    offset = list(mesh.devices.flat).index(mine[0])
    head = (slice(None),) * dim

    def block(index: Any) -> Any:
        i = index[dim].start or 0
        return value[(*head, slice(i - offset, i - offset + 1))]

    if isinstance(value, jax.Array):
        shards = [jax.device_put(value[(*head, slice(i, i + 1))], d) for i, d in enumerate(mine)]
        return jax.make_array_from_single_device_arrays(global_shape, sharding, shards)
    return jax.make_array_from_callback(global_shape, sharding, block)


def from_local_array(x: jax.Array, mesh: Mesh, dim: int | None) -> jax.Array | None:
    """A process-local array as the global array over ``mesh``, no copy; None if it is not one.

    The inverse of `local_view`: ``x`` lives on this process's devices of ``mesh`` with one
    entry of dimension ``dim`` per device, in mesh order (what `jax.pmap` returns in a
    multi-process run), or whole on each of them when ``dim`` is None. Its device buffers
    become this process's blocks of the global array.
    """
    mine = local_devices(mesh)
    name = mesh.axis_names[0]
    if len(mesh.axis_names) != 1 or (
        dim is not None and (x.ndim <= dim or x.shape[dim] != len(mine))
    ):
        return None
    spec = mapped_spec(dim, name) if dim is not None else PartitionSpec()
    local = NamedSharding(_mesh(tuple(mine), name), spec)
    if not x.sharding.is_equivalent_to(local, x.ndim):
        return None
    by_device = {s.device: s.data for s in x.addressable_shards}
    shape = x.shape if dim is None else (*x.shape[:dim], mesh.shape[name], *x.shape[dim + 1 :])
    blocks = [by_device[d] for d in mine]
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, spec), blocks)


def rewrap(x: jax.Array, mesh: Mesh, dim: int) -> jax.Array | None:
    """``x`` laid out over ``mesh``'s device axis at ``dim``, without a copy; None if it is not.

    An array made over another 1-D mesh of the same devices in the same order (another axis
    name: `meshkit.replicate`'s output meeting a `pmap_compat` function) holds the same
    blocks on the same devices, so its shards are reused as they are.
    """
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding) or x.ndim <= dim:
        return None
    other = sharding.mesh
    if not isinstance(other, Mesh) or len(other.axis_names) != 1:
        return None
    if tuple(other.devices.flat) != tuple(mesh.devices.flat):
        return None
    want = mapped_spec(dim, mesh.axis_names[0])
    have = mapped_spec(dim, other.axis_names[0])
    if not sharding.is_equivalent_to(NamedSharding(other, have), x.ndim):
        return None
    target = NamedSharding(mesh, want)
    if sharding == target:
        return x
    shards = [s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, target, shards)


def local_view(x: jax.Array, dim: int | None = 0) -> jax.Array:
    """This process's entries of a device-axis array, as an array over its local devices only.

    No copy: the local shards, assembled over a mesh of this process's devices. The result
    is what `jax.pmap` returned in a multi-process run (a process-local array). ``dim``: the
    mapped dimension, or None for a value every device holds whole (``out_axes=None``).
    """
    sharding = x.sharding
    if (
        not isinstance(sharding, NamedSharding)
        or not isinstance(sharding.mesh, Mesh)
        or len(sharding.mesh.axis_names) != 1
    ):
        raise MeshkitError(
            f"meshkit: expected an array over a device axis (a 1-D mesh); got sharding {sharding}."
        )
    if x.is_fully_addressable:
        return x
    mesh: Mesh = sharding.mesh
    mine = local_devices(mesh)
    local_mesh = _mesh(tuple(mine), mesh.axis_names[0])
    shape = x.shape if dim is None else (*x.shape[:dim], len(mine), *x.shape[dim + 1 :])
    by_device = {s.device: s.data for s in x.addressable_shards}
    target = NamedSharding(local_mesh, sharding.spec)
    return jax.make_array_from_single_device_arrays(shape, target, [by_device[d] for d in mine])
