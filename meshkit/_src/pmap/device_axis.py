"""Arrays with a device axis (the pmap convention) as global arrays over a 1-D device mesh.

The mesh is ordered by process then id, so each process's entries are contiguous.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..core import caches as _caches
from ..core.errors import MeshkitError


def shown(value: Any) -> str:
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
            f"({shown(devices)}).\nConsider devices=jax.local_devices()."
        ) from None
    if not chosen:
        raise MeshkitError(
            f"{what}: devices is empty; the result has one entry per device, so at least one "
            "device is needed.\nConsider devices=jax.local_devices()."
        )
    bad = [d for d in chosen if not isinstance(d, jax.Device)]
    if bad:
        raise MeshkitError(
            f"{what}: devices holds {type(bad[0]).__name__} ({shown(bad[0])}), not a device.\n"
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


SPEC = PartitionSpec("devices")  # one entry per device of a `device_mesh` with the default axis


def mapped_spec(dim: int, axis_name: str) -> PartitionSpec:
    return PartitionSpec(*([None] * dim), axis_name)


def sharding(mesh: Mesh, dim: int | None = 0) -> NamedSharding:
    """One entry of dimension ``dim`` per device of ``mesh`` (None: whole on every device)."""
    spec = PartitionSpec() if dim is None else mapped_spec(dim, mesh.axis_names[0])
    return NamedSharding(mesh, spec)


def from_rows(mesh: Mesh, shape: Sequence[int], row: Callable[[int], Any]) -> jax.Array:
    """A device-axis array whose entry ``i`` is ``row(i)`` (size 1 along axis 0)."""
    place = lambda index: row(index[0].start or 0)  # noqa: E731
    return jax.make_array_from_callback(tuple(shape), sharding(mesh), place)


def local_view(x: jax.Array) -> jax.Array:
    """This process's entries of a device-axis array (what `jax.pmap` returns), no copy."""
    named: Any = x.sharding  # a NamedSharding over a concrete mesh
    return multihost_utils.global_array_to_host_local_array(x, named.mesh, named.spec)
