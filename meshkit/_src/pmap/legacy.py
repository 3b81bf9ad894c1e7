"""The flax-era device-axis placement: `replicate`, `unreplicate`, `device_put_*`, PRNG keys.

Same signatures and results as ``flax.jax_utils`` and old ``jax``; arrays with a device axis
are `meshkit._src.pmap.device_axis` arrays, which `pmap_compat` takes without copies.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..arrays.blocks import tree_paths
from ..core import caches as _caches
from ..core.errors import MeshkitError
from ..core.tracebacks import public
from . import device_axis as _device_axis
from .device_axis import check_devices

_NOT_ARRAY = """\
{what}: the leaf at {path} is of type {kind} ({shown}), not an array.
{what} puts numbers on devices: numpy arrays, scalars or jax.Arrays at every leaf.
Consider keeping strings and other objects out of the pytree."""

_GLOBAL_SPLIT = """\
{what}: the leaf at {path} is a global jax.Array split across processes (shape {shape}, \
sharding {sharding}); {what} copies a value this process holds whole.
Consider meshkit.gather(x) for its whole value first, or passing it to the pmap_compat \
function as a broadcast argument (in_axes=None)."""

_ROW_SPLIT = """\
meshkit.unreplicate: the first entry of the leaf at {path} (shape {shape}, sharding {sharding}) \
is split over several devices, so no single shard holds it; unreplicate reads one device's \
shard and does not communicate.
Consider meshkit.gather(x)[0] (every process calls it), or an array whose leading axis is the \
device axis (a pmap_compat or meshkit.replicate output)."""

_SHARDS_MISMATCH = """\
meshkit.device_put_sharded: shards[{i}] at {path} is {got}, but shards[0] is {want}; the \
shards are stacked into one array per leaf, so every shard must have the same shape and dtype.
Consider padding or casting the shards to one shape and dtype first."""


def host_array(what: str, path: str, leaf: Any) -> np.ndarray:
    """A numeric host leaf as numpy in the dtype JAX will use (as `jax.device_put` does)."""
    is_array = isinstance(leaf, np.ndarray | np.generic | bool | int | float | complex)
    value = np.asarray(leaf) if is_array or hasattr(leaf, "__array__") else None
    if value is None or not (
        value.dtype == np.bool_ or jax.numpy.issubdtype(value.dtype, np.number)
    ):
        kind = type(leaf).__name__ if value is None else f"array of dtype {value.dtype}"
        shown = repr(leaf) if len(repr(leaf)) <= 60 else repr(leaf)[:57] + "..."
        raise MeshkitError(_NOT_ARRAY.format(what=what, path=path, kind=kind, shown=shown))
    target = np.dtype(jax.dtypes.canonicalize_dtype(value.dtype))
    return value if value.dtype == target else value.astype(target)


def device_axis_mesh(devices: Any, what: str) -> Mesh:
    """The 1-D device-axis mesh over ``devices`` (None: every device of every process)."""
    return _device_axis.device_mesh(None if devices is None else check_devices(devices, what))


# One dispatch reads the first entries of every array on one device.
_firsts = jax.jit(lambda xs: [a[0] for a in xs])


def _single_device_value(what: str, path: str, leaf: jax.Array) -> jax.Array | None:
    """``leaf`` as one device's array holding its whole value, or None to read it to the host."""
    if len(leaf.sharding.device_set) == 1:
        return leaf
    if leaf.sharding.is_fully_replicated:
        return leaf.addressable_data(0)
    if not leaf.is_fully_addressable:
        raise MeshkitError(
            _GLOBAL_SPLIT.format(what=what, path=path, shape=leaf.shape, sharding=leaf.sharding)
        )
    return None


def _replicate(tree: Any, mesh: Mesh, what: str) -> Any:
    named, treedef = tree_paths(tree)
    out = []
    for path, leaf in named:
        whole = _single_device_value(what, path, leaf) if isinstance(leaf, jax.Array) else None
        if whole is None:  # host data, or split over this process's devices: read once
            whole = host_array(
                what, path, np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf
            )
        block = whole[None]
        out.append(_device_axis.from_rows(mesh, (mesh.size, *whole.shape), lambda _, b=block: b))
    return jax.tree_util.tree_unflatten(treedef, out)


@public
def replicate(tree: Any, devices: Sequence[Any] | None = None) -> Any:
    """One copy of every array per device, with a leading device axis (`flax.jax_utils`'s).

    Each leaf ``x`` becomes an array of shape ``(n, *x.shape)``, entry ``i`` on the ``i``-th
    device, put from the host in one batched call. With several processes it is a global
    array over every process's devices; every process must pass the same values.

    Args:
        tree: a pytree of numpy arrays, scalars or single-device / replicated ``jax.Array`` s.
        devices: the devices of the device axis; default: every device of every process.

    Examples:
        >>> import numpy as np, meshkit
        >>> r = meshkit.replicate({"w": np.ones((3, 2), np.float32), "step": 0})
        >>> r["w"].shape, r["step"].shape, len(r["w"].sharding.device_set)
        ((8, 3, 2), (8,), 8)
    """
    what = "meshkit.replicate"
    return _replicate(tree, device_axis_mesh(devices, what), what)


@public
def device_put_replicated(x: Any, devices: Sequence[Any]) -> Any:
    """``x`` copied to each of ``devices``, stacked along a new leading axis (old JAX's).

    `meshkit.replicate` with required ``devices``; they are ordered by process, then id.

    Examples:
        >>> import jax, numpy as np, meshkit
        >>> y = meshkit.device_put_replicated(np.arange(3.0), jax.local_devices()[:4])
        >>> y.shape, sorted(d.id for d in y.sharding.device_set)
        ((4, 3), [0, 1, 2, 3])
    """
    what = "meshkit.device_put_replicated"
    return _replicate(x, _device_axis.device_mesh(check_devices(devices, what)), what)


@public
def device_put_sharded(shards: Sequence[Any], devices: Sequence[Any]) -> Any:
    """Stack ``shards`` (pytrees of one structure) along a new leading axis, one per device.

    ``result[i] == shards[i]``, on the ``i``-th of ``devices`` ordered by process then id;
    never stacked anywhere. Each process puts only the shards of its own devices.

    Examples:
        >>> import jax, numpy as np, meshkit
        >>> shards = [{"x": np.full((2,), i, np.int32)} for i in range(8)]
        >>> y = meshkit.device_put_sharded(shards, jax.local_devices())
        >>> y["x"].shape, y["x"][:, 0].tolist()
        ((8, 2), [0, 1, 2, 3, 4, 5, 6, 7])
    """
    what = "meshkit.device_put_sharded"
    chosen = check_devices(devices, what)
    shards = list(shards)
    if len(shards) != len(chosen):
        raise MeshkitError(
            f"{what}: len(shards) == {len(shards)}, but len(devices) == {len(chosen)}; shard i "
            "goes to the i-th device, so there must be one shard per device.\nConsider "
            f"device_put_sharded(shards, devices[:{len(shards)}]) or passing {len(chosen)} shards."
        )
    mesh = _device_axis.device_mesh(chosen)
    named, treedef = tree_paths(shards[0])
    flats = [named]
    for i, s in enumerate(shards[1:], start=1):
        other, other_def = tree_paths(s)
        if other_def != treedef:
            raise MeshkitError(
                f"{what}: shards[{i}] has the pytree structure {other_def}, but shards[0] has "
                f"{treedef}; every shard must have the same structure.\nConsider building every "
                "shard with the same keys and nesting."
            )
        flats.append(other)
    out = []
    for k, (path, _) in enumerate(named):
        values: list[Any] = [f[k][1] for f in flats]
        arrays = all(isinstance(v, jax.Array) for v in values)
        held = [_single_device_value(what, path, v) for v in values] if arrays else [None]
        if all(h is not None for h in held):  # device to device
            values = held
        else:
            values = [host_array(what, path, np.asarray(v)) for v in values]
        _same_kind(values, path)
        shape = (mesh.size, *values[0].shape)
        out.append(_device_axis.from_rows(mesh, shape, lambda i, v=values: v[i][None]))
    return jax.tree_util.tree_unflatten(treedef, out)


def _same_kind(values: Sequence[Any], path: str) -> None:
    want = (tuple(values[0].shape), values[0].dtype)
    for i, v in enumerate(values[1:], start=1):
        got = (tuple(v.shape), v.dtype)
        if got != want:
            shown = {"got": f"{got[1]}{list(got[0])}", "want": f"{want[1]}{list(want[0])}"}
            raise MeshkitError(_SHARDS_MISMATCH.format(i=i, path=path, **shown))


def _path_at(tree: Any, k: int) -> str:
    return tree_paths(tree)[0][k][0]


def _first_entry_shard(tree: Any, k: int, x: jax.Array) -> tuple[Any, jax.Array]:
    """``(device, data)``: the shard holding this process's first entry of ``x`` whole.

    ``(None, x)`` when no shard does but ``x`` is all on this process (JAX indexes it then).
    """
    sharding = x.sharding
    if (
        isinstance(sharding, NamedSharding)
        and len(sharding.mesh.axis_names) == 1
        and all(e is None for e in sharding.spec[1:])
    ):  # a 1-D mesh split at most along dimension 0: the first local shard holds it whole
        data = x.addressable_data(0)
        return data.device, data
    best = min(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    if best.data.shape[1:] != x.shape[1:]:
        if x.is_fully_addressable:
            return None, x
        raise MeshkitError(
            _ROW_SPLIT.format(path=_path_at(tree, k), shape=x.shape, sharding=x.sharding)
        )
    return best.device, best.data


def first_entries(tree: Any, what: str) -> Any:
    """``tree`` with each leaf replaced by its first local entry (one dispatch per device)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out: list[Any] = []
    reads: dict[Any, list[tuple[int, jax.Array]]] = collections.defaultdict(list)
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, jax.Array | np.ndarray):
            leaf = host_array(what, _path_at(tree, k), leaf)
        if leaf.ndim == 0:
            raise MeshkitError(
                f"{what}: the leaf at {_path_at(tree, k)} has shape (), so it has no leading "
                "(device) axis to take the first entry of.\nConsider replicated values only "
                "(meshkit.replicate or pmap_compat outputs), keeping scalars out of the pytree."
            )
        if isinstance(leaf, jax.Array):
            device, data = _first_entry_shard(tree, k, leaf)
            reads[device].append((k, data))
        out.append(leaf[0] if isinstance(leaf, np.ndarray) else None)
    for device, group in reads.items():
        data = [d for _, d in group]
        # device None: whole multi-device arrays, indexed by JAX.
        firsts = [d[0] for d in data] if device is None else _firsts(data)
        for (k, _), first in zip(group, firsts, strict=True):
            out[k] = first
    return jax.tree_util.tree_unflatten(treedef, out)


@public
def unreplicate(tree: Any) -> Any:
    """The first entry of every array of a replicated pytree (flax's), reading one shard.

    For device-axis arrays that is the entry of this process's first device, copied on that
    device in one dispatch whatever the device count. With several processes each process
    gets its own first entry. Numpy leaves give ``x[0]``.

    Examples:
        >>> import numpy as np, meshkit
        >>> state = meshkit.replicate({"w": np.arange(4.0, dtype=np.float32)})
        >>> meshkit.unreplicate(state)["w"].tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    return first_entries(tree, "meshkit.unreplicate")


@_caches.cached(maxsize=32)
def _split_onto(mesh: Mesh, count: int) -> Any:
    return jax.jit(lambda k: jax.random.split(k, count), out_shardings=_device_axis.sharding(mesh))


@public
def shard_prng_key(prng_key: Any) -> jax.Array:
    """Split a PRNG key into one key per local device (`flax.training.common_utils`'s).

    ``jax.random.split(prng_key, jax.local_device_count())``, placed as a device-axis array.
    With several processes the result is global, each process's entries its own split.

    Examples:
        >>> import jax, meshkit
        >>> meshkit.shard_prng_key(jax.random.PRNGKey(0)).shape
        (8, 2)
    """
    what = "meshkit.shard_prng_key"
    key = prng_key
    if isinstance(key, jax.Array) and len(key.sharding.device_set) != 1:
        whole = _single_device_value(what, "prng_key", key)
        key = whole if whole is not None else np.asarray(key)
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)
    shape = tuple(np.shape(key)) if not typed else tuple(key.shape)
    if typed and shape != ():
        raise MeshkitError(
            f"{what}: prng_key is an array of {shape[0]} typed keys (shape {shape}); it splits "
            "one key into one per device.\nConsider prng_key[0], or using the keys as they are "
            "if they are already one per device."
        )
    if not typed and (dtype != np.uint32 or len(shape) != 1):
        raise MeshkitError(
            f"{what}: prng_key has dtype {dtype} and shape {shape}; a key is a typed key "
            "(jax.random.key(seed), shape ()) or a raw uint32 key (jax.random.PRNGKey(seed), "
            "shape (2,)).\nConsider jax.random.key(seed), or prng_key[0] for a batch of raw keys."
        )
    mesh = _device_axis.device_mesh()
    mine = _device_axis.local_devices(mesh)
    local_mesh = _device_axis.device_mesh(mine)
    keys = _split_onto(local_mesh, len(mine))(key)
    if local_mesh is mesh:
        return keys
    again = _device_axis.from_local_array(keys, mesh, 0)
    assert again is not None  # keys lie one per local device, in mesh order
    return again
