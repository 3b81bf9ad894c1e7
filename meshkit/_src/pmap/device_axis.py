"""Arrays with a device axis (the pmap convention) as global arrays over a 1-D device mesh.

The mesh is ordered by process then id, so each process's entries are contiguous.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..core import caches as _caches
from ..core.errors import MeshkitError


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_devices(devices: Any, what: str) -> list[Any]:
    """``devices`` as a list: a non-empty sequence of distinct devices, some of this process."""
    if isinstance(devices, jax.Device):
        raise MeshkitError(
            f"{what}: devices must be a sequence of devices; got a single device ({devices}).\n"
            f"Consider devices=[{devices}] or devices=jax.local_devices()."
        )
    try:
        chosen = list(devices)
    except TypeError:
        raise MeshkitError(
            f"{what}: devices must be a sequence of devices; got {type(devices).__name__} "
            f"({_shown(devices)}).\nConsider devices=jax.local_devices()."
        ) from None
    if not chosen:
        raise MeshkitError(
            f"{what}: devices is empty; the result has one entry per device, so at least one "
            "device is needed.\nConsider devices=jax.local_devices()."
        )
    bad = [d for d in chosen if not isinstance(d, jax.Device)]
    if bad:
        raise MeshkitError(
            f"{what}: devices holds {type(bad[0]).__name__} ({_shown(bad[0])}), not a device.\n"
            "Consider devices from jax.devices() or jax.local_devices()."
        )
    if len(set(chosen)) != len(chosen):
        twice = sorted({str(d) for d in chosen if chosen.count(d) > 1})
        raise MeshkitError(
            f"{what}: devices lists {', '.join(twice)} more than once; each device holds one "
            "entry of the device axis.\nConsider removing the repeats."
        )
    me = jax.process_index()
    if not any(d.process_index == me for d in chosen):
        raise MeshkitError(
            f"{what}: devices holds no device of this process ({me}); every process puts its "
            "entries on its own devices.\nConsider including jax.local_devices()."
        )
    return chosen


@_caches.cached(maxsize=64)
def _mesh(devices: tuple[Any, ...], axis_name: str) -> Mesh:
    return Mesh(np.array(devices, dtype=object), (axis_name,), axis_types=(AxisType.Auto,))


def device_mesh(
    devices: Sequence[Any] | None = None, axis_name: str = "devices", *, keep_order: bool = False
) -> Mesh:
    """The cached 1-D mesh over ``devices`` (default: all); ``keep_order``: as given (1 process)."""
    chosen = tuple(jax.devices() if devices is None else devices)
    if not (keep_order and jax.process_count() == 1):
        chosen = tuple(sorted(chosen, key=lambda d: (d.process_index, d.id)))
    return _mesh(chosen, axis_name)


def local_devices(mesh: Mesh) -> list[Any]:
    me = jax.process_index()
    return [d for d in mesh.devices.flat if d.process_index == me]


def mapped_spec(dim: int, axis_name: str) -> PartitionSpec:
    return PartitionSpec(*([None] * dim), axis_name)


def sharding(mesh: Mesh, dim: int | None = 0) -> NamedSharding:
    """One entry of dimension ``dim`` per device of ``mesh`` (None: whole on every device)."""
    spec = PartitionSpec() if dim is None else mapped_spec(dim, mesh.axis_names[0])
    return NamedSharding(mesh, spec)


def _with_size(shape: Sequence[int], dim: int | None, n: int) -> tuple[int, ...]:
    return tuple(shape) if dim is None else (*shape[:dim], n, *shape[dim + 1 :])


def from_rows(
    mesh: Mesh, shape: Sequence[int], row: Callable[[int], Any], dim: int = 0
) -> jax.Array:
    """A device-axis array whose entry ``i`` along ``dim`` is ``row(i)`` (size 1 at ``dim``)."""
    place = lambda index: row(index[dim].start or 0)  # type: ignore[index]  # noqa: E731
    return jax.make_array_from_callback(tuple(shape), sharding(mesh, dim), place)


def _blocks(x: jax.Array, devices: Sequence[Any]) -> list[Any]:
    by_device = {s.device: s.data for s in x.addressable_shards}
    return [by_device[d] for d in devices]


def from_local(value: Any, mesh: Mesh, dim: int) -> jax.Array:
    """A global array from this process's part (its local entries along ``dim``), unchecked."""
    if isinstance(value, jax.Array) and len(value.devices()) > 1:
        value = np.asarray(value)  # a multi-device local array: read it once
    offset = list(mesh.devices.flat).index(local_devices(mesh)[0])
    head = (slice(None),) * dim
    shape = _with_size(np.shape(value), dim, mesh.size)
    return from_rows(mesh, shape, lambda i: value[(*head, slice(i - offset, i - offset + 1))], dim)


def from_local_array(x: jax.Array, mesh: Mesh, dim: int | None) -> jax.Array | None:
    """A process-local array (entry per local device at ``dim``) as the global one, or None.

    The inverse of `local_view`: ``x``'s buffers become this process's blocks, no copy.
    """
    mine = local_devices(mesh)
    if dim is not None and (x.ndim <= dim or x.shape[dim] != len(mine)):
        return None
    local = sharding(_mesh(tuple(mine), mesh.axis_names[0]), dim)
    if not x.sharding.is_equivalent_to(local, x.ndim):
        return None
    shape = _with_size(x.shape, dim, mesh.size)
    return jax.make_array_from_single_device_arrays(shape, sharding(mesh, dim), _blocks(x, mine))


def local_view(x: Any) -> Any:
    """This process's entries of a device-axis array (what `jax.pmap` returns), no copy."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    spec = x.sharding.spec  # type: ignore[attr-defined]
    mesh = x.sharding.mesh  # type: ignore[attr-defined]
    mapped = [d for d, e in enumerate(spec) if e is not None]
    mine = local_devices(mesh)
    target = NamedSharding(_mesh(tuple(mine), mesh.axis_names[0]), spec)
    shape = _with_size(x.shape, mapped[0] if mapped else None, len(mine))
    return jax.make_array_from_single_device_arrays(shape, target, _blocks(x, mine))
