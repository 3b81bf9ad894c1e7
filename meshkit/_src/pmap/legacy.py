"""The flax-era device-axis placement: what pmap-era code imports to put values on devices.

`replicate`, `unreplicate`, `device_put_replicated`, `device_put_sharded` and `shard_prng_key`
keep the signatures and results of the functions they stand in for (``flax.jax_utils``, old
``jax``), in one process and in several; the data helpers built on them (`shard`,
`prefetch_to_device`, `pad_shard_unpad`, `get_metrics`) are in `meshkit._src.pmap.legacy_data`.
Arrays with a device axis are meshkit's device-axis arrays (`meshkit._src.pmap.device_axis`): in
one process exactly what `jax.pmap` takes and returns, shape ``(devices, ...)``; with several
processes global arrays whose leading dimension has ``jax.device_count()`` entries, each process
holding its own, so they pass to `meshkit.pmap_compat` (and to `jax.jit`) without copies.

Costs. `replicate` puts one copy per device, from the host in one batched call (never ``n``
stacked copies anywhere). `unreplicate` reads one shard of one device, whatever the device
count: a single dispatch that copies that shard's first entry on its device, where ``x[0]`` on
a `jax.pmap` output gathers the whole array first.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..arrays.blocks import tree_paths
from ..core import caches as _caches
from ..core.errors import MeshkitError
from ..core.tracebacks import public
from . import device_axis as _device_axis

__all__ = [
    "device_axis_mesh",
    "device_put_replicated",
    "device_put_sharded",
    "first_entries",
    "host_array",
    "replicate",
    "shard_prng_key",
    "unreplicate",
]

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

_SHARDS_LENGTH = """\
meshkit.device_put_sharded: len(shards) == {shards}, but len(devices) == {devices}; shard i \
goes to the i-th device, so there must be one shard per device.
Consider device_put_sharded(shards, devices[:{shards}]) or passing {devices} shards."""

_SHARDS_MISMATCH = """\
meshkit.device_put_sharded: shards[{i}] at {path} is {got}, but shards[0] is {want}; the \
shards are stacked into one array per leaf, so every shard must have the same shape and dtype.
Consider padding or casting the shards to one shape and dtype first."""

_SHARDS_TREE = """\
meshkit.device_put_sharded: shards[{i}] has the pytree structure {got}, but shards[0] has \
{want}; every shard must have the same structure.
Consider building every shard with the same keys and nesting."""


def _shown(leaf: Any) -> str:
    text = repr(leaf)
    return text if len(text) <= 60 else text[:57] + "..."


def host_array(what: str, path: str, leaf: Any) -> np.ndarray:
    """A host leaf as numpy in the dtype JAX will use (as `jax.device_put` does, silently)."""
    if not isinstance(leaf, np.ndarray | np.generic | bool | int | float | complex) and not hasattr(
        leaf, "__array__"
    ):
        raise MeshkitError(
            _NOT_ARRAY.format(what=what, path=path, kind=type(leaf).__name__, shown=_shown(leaf))
        )
    value = np.asarray(leaf)
    if not (value.dtype == np.bool_ or jax.numpy.issubdtype(value.dtype, np.number)):
        raise MeshkitError(
            _NOT_ARRAY.format(
                what=what, path=path, kind=f"array of dtype {value.dtype}", shown=_shown(leaf)
            )
        )
    target = np.dtype(jax.dtypes.canonicalize_dtype(value.dtype))
    return value if value.dtype == target else value.astype(target)


def _devices_arg(devices: Any, what: str) -> list[Any]:
    """``devices`` checked: a non-empty sequence of distinct devices, some of this process."""
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


def device_axis_mesh(devices: Any, what: str) -> Mesh:
    """The 1-D device-axis mesh over ``devices`` (None: every device of every process)."""
    if devices is None:
        return _device_axis.device_mesh(what=what)
    return _device_axis.device_mesh(_devices_arg(devices, what), what=what)


def _sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, _device_axis.mapped_spec(0, mesh.axis_names[0]))


# One jitted function each, cached by JAX per input signature; each runs on its input's device.
_expand = jax.jit(lambda a: a[None])
_firsts = jax.jit(lambda xs: [a[0] for a in xs])


def _from_host_rows(mesh: Mesh, row_shape: tuple[int, ...], row: Callable[[int], Any]) -> Any:
    """A device-axis array whose entry ``i`` is ``row(i)`` (shape ``(1, *row_shape)``).

    One batched put of this process's entries (``make_array_from_callback``); on CPU,
    64-byte-aligned numpy memory is used in place, as `jax.device_put` does.
    """
    shape = (mesh.size, *row_shape)
    return jax.make_array_from_callback(shape, _sharding(mesh), lambda index: row(_start(index)))


def _start(index: Any) -> int:
    """Where a block's leading range starts (``make_array_from_callback`` passes slices)."""
    return index[0].start or 0


def _from_device_rows(mesh: Mesh, rows: list[jax.Array]) -> jax.Array:
    """A device-axis array from this process's entries, already expanded to ``(1, ...)``.

    ``rows[k]`` is the entry of the k-th local device of ``mesh``; each travels device to device.
    """
    mine = _device_axis.local_devices(mesh)
    placed = jax.device_put(rows, mine)
    shape = (mesh.size, *rows[0].shape[1:])
    return jax.make_array_from_single_device_arrays(shape, _sharding(mesh), placed)


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
    local = len(_device_axis.local_devices(mesh))
    out = []
    for path, leaf in named:
        if isinstance(leaf, jax.Array):
            whole = _single_device_value(what, path, leaf)
            if whole is not None:
                out.append(_from_device_rows(mesh, [_expand(whole)] * local))
                continue
            leaf = np.asarray(leaf)  # split over this process's devices: read once
        value = host_array(what, path, leaf)
        block = value[None]
        out.append(_from_host_rows(mesh, value.shape, lambda _, b=block: b))
    return jax.tree_util.tree_unflatten(treedef, out)


@public
def replicate(tree: Any, devices: Sequence[Any] | None = None) -> Any:
    """One copy of every array per device, with a leading device axis (`flax.jax_utils`'s).

    Each leaf ``x`` becomes an array of shape ``(n, *x.shape)`` whose entry ``i`` lives on the
    ``i``-th device: in one process exactly what ``jax.pmap`` takes and returns (``n`` is the
    device count), so pmap code and `meshkit.pmap_compat` accept it as is. With several
    processes it is a global array over every process's devices (``n == jax.device_count()``),
    each process holding its own entries; every process must pass the same values (not
    checked). The copies are put from the host once per device in one batched call (a
    single-device ``jax.Array`` is copied device to device); no ``n`` stacked copies are ever
    made, on the host or on a device. As with `jax.device_put` on CPU, aligned numpy memory may
    be used in place: do not write to the numpy arrays afterwards.

    Args:
        tree: a pytree of numpy arrays, scalars or ``jax.Array`` s (on one device, or
            replicated: a global array every process holds whole).
        devices: the devices of the device axis, in any order (meshkit orders them by process,
            then id, as `pmap_compat` does); default: every device of every process.

    Returns:
        ``tree`` with each leaf replaced by its device-axis array; 64-bit data becomes 32-bit
        unless ``jax_enable_x64`` is on, as with `jax.device_put`.

    Raises:
        MeshkitError: a leaf is not numeric, or is a global array split across processes;
            ``devices`` is empty, repeats a device or holds none of this process.

    Examples:
        >>> import jax, numpy as np, meshkit
        >>> params = {"w": np.ones((3, 2), np.float32), "step": 0}
        >>> r = meshkit.replicate(params)
        >>> r["w"].shape, r["step"].shape, len(r["w"].sharding.device_set)
        ((8, 3, 2), (8,), 8)
        >>> [s.data.shape for s in r["w"].addressable_shards][:2]
        [(1, 3, 2), (1, 3, 2)]
    """
    what = "meshkit.replicate"
    return _replicate(tree, device_axis_mesh(devices, what), what)


@public
def device_put_replicated(x: Any, devices: Sequence[Any]) -> Any:
    """``x`` copied to each of ``devices``, stacked along a new leading axis (old JAX's).

    The removed ``jax.device_put_replicated``: each leaf of shape ``s`` becomes an array of
    shape ``(len(devices), *s)``, one copy per device. The result is a device-axis array over
    ``devices`` (as `meshkit.replicate` makes, which this is with required ``devices``); the
    devices are ordered by process, then id.

    Args:
        x: a pytree of numpy arrays, scalars or single-device / replicated ``jax.Array`` s.
        devices: a non-empty sequence of devices (with at least one of this process).

    Returns:
        ``x`` with each leaf replaced by its device-axis array.

    Raises:
        MeshkitError: ``devices`` is empty, not a sequence of devices, repeats a device or
            holds none of this process; a leaf is not numeric.

    Examples:
        >>> import jax, numpy as np, meshkit
        >>> y = meshkit.device_put_replicated(np.arange(3.0), jax.local_devices()[:4])
        >>> y.shape, sorted(d.id for d in y.sharding.device_set)
        ((4, 3), [0, 1, 2, 3])
    """
    what = "meshkit.device_put_replicated"
    mesh = _device_axis.device_mesh(_devices_arg(devices, what), what=what)
    return _replicate(x, mesh, what)


@public
def device_put_sharded(shards: Sequence[Any], devices: Sequence[Any]) -> Any:
    """Stack ``shards`` along a new leading axis, shard ``i`` being entry ``i`` (old JAX's).

    The removed ``jax.device_put_sharded``: ``shards`` is a sequence of pytrees of one
    structure whose leaves share shape and dtype; the result has that structure, each leaf of
    shape ``(len(devices), *shape)`` with ``result[i] == shards[i]``, one entry per device and
    never stacked anywhere. The devices are ordered by process, then id (as `pmap_compat`
    does), and entry ``i`` sits on the ``i``-th of them: on ``devices[i]`` whenever
    ``devices`` is in that order already (``jax.devices()``, ``jax.local_devices()``). With
    several processes and devices of several processes, every process passes every shard and
    puts only those of its own devices.

    Args:
        shards: one pytree per device (numpy arrays, scalars or single-device ``jax.Array`` s).
        devices: a non-empty sequence of devices, as long as ``shards``.

    Returns:
        The stacked device-axis arrays, in the shards' pytree structure.

    Raises:
        MeshkitError: ``len(shards) != len(devices)``; the shards differ in structure, shape
            or dtype; ``devices`` is empty, repeats a device or holds none of this process.

    Examples:
        >>> import jax, numpy as np, meshkit
        >>> shards = [{"x": np.full((2,), i, np.int32)} for i in range(8)]
        >>> y = meshkit.device_put_sharded(shards, jax.local_devices())
        >>> y["x"].shape, y["x"][:, 0].tolist()
        ((8, 2), [0, 1, 2, 3, 4, 5, 6, 7])
    """
    what = "meshkit.device_put_sharded"
    chosen = _devices_arg(devices, what)
    shards = list(shards)
    if len(shards) != len(chosen):
        raise MeshkitError(_SHARDS_LENGTH.format(shards=len(shards), devices=len(chosen)))
    mesh = _device_axis.device_mesh(chosen, what=what)
    # Entry i is shards[i], on the i-th device of the mesh's order.
    flat = list(mesh.devices.flat)
    entries = [flat.index(d) for d in _device_axis.local_devices(mesh)]
    named, treedef = tree_paths(shards[0])
    flats = [named]
    for i, s in enumerate(shards[1:], start=1):
        other, other_def = tree_paths(s)
        if other_def != treedef:
            raise MeshkitError(_SHARDS_TREE.format(i=i, got=other_def, want=treedef))
        flats.append(other)
    out = []
    for k, (path, _) in enumerate(named):
        leaves = [flat[k][1] for flat in flats]
        if all(isinstance(leaf, jax.Array) for leaf in leaves):
            arrays: list[jax.Array] = leaves
            _same_kind(arrays, path)
            holders = [_single_device_value(what, path, a) for a in arrays]
            if all(h is not None for h in holders):
                out.append(_from_device_rows(mesh, [_expand(holders[i]) for i in entries]))
                continue
        values = [host_array(what, path, np.asarray(leaf)) for leaf in leaves]
        _same_kind(values, path)
        out.append(_from_host_rows(mesh, values[0].shape, lambda i, v=values: v[i][None]))
    return jax.tree_util.tree_unflatten(treedef, out)


def _same_kind(values: Sequence[Any], path: str) -> None:
    want = (tuple(values[0].shape), values[0].dtype)
    for i, v in enumerate(values[1:], start=1):
        got = (tuple(v.shape), v.dtype)
        if got != want:
            raise MeshkitError(
                _SHARDS_MISMATCH.format(
                    i=i, path=path, got=f"{got[1]}{list(got[0])}", want=f"{want[1]}{list(want[0])}"
                )
            )


def _path_at(tree: Any, k: int) -> str:
    """The path of leaf ``k`` of ``tree``, for messages (computed only when one is needed)."""
    return tree_paths(tree)[0][k][0]


def _first_entry_shard(tree: Any, k: int, x: jax.Array) -> tuple[Any, jax.Array]:
    """``(device, data)``: the shard holding this process's first entry of ``x`` whole.

    ``(None, x)`` when no shard does but ``x`` is all on this process (JAX indexes it then).
    """
    sharding = x.sharding
    if isinstance(sharding, NamedSharding) and len(sharding.mesh.axis_names) == 1:
        # A 1-D mesh (device-axis arrays, pmap outputs): the first local device in mesh order
        # holds the first local entry; with nothing split but dimension 0, it holds it whole.
        spec = sharding.spec
        if all(e is None for e in spec[1:]):
            data = x.addressable_data(0)
            return data.device, data
    shards = x.addressable_shards
    best = min(shards, key=lambda s: s.index[0].start or 0)  # ties: the first, in mesh order
    data = best.data
    if data.shape[1:] != x.shape[1:]:
        if x.is_fully_addressable:
            return None, x
        raise MeshkitError(
            _ROW_SPLIT.format(path=_path_at(tree, k), shape=x.shape, sharding=x.sharding)
        )
    return best.device, data


Reads = list[tuple[int, Any, jax.Array]]  # (leaf index, device or None, data)


def first_entries(tree: Any, what: str) -> tuple[Any, list[Any], Reads]:
    """``(treedef, leaves, reads)``: host leaves already indexed, device reads left to do."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out: list[Any] = []
    reads: Reads = []
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
            reads.append((k, *_first_entry_shard(tree, k, leaf)))
            out.append(None)
        else:
            out.append(leaf[0])
    return treedef, out, reads


@public
def unreplicate(tree: Any) -> Any:
    """The first entry of every array of a replicated pytree (flax's), reading one shard.

    For device-axis arrays (`meshkit.replicate`, `pmap_compat` and ``jax.pmap`` outputs) that
    is the entry of this process's first device: its shard alone is read and copied on that
    device (one dispatch per device holding such shards, whatever the device count), where
    ``x[0]`` gathers the whole array. The cost and the answer do not depend on the number of
    devices. With several processes each process gets its own first entry (entry ``p * L`` of
    process ``p`` with ``L`` local devices), not entry 0: for replicated values, the value.

    Other arrays are accepted too: a ``jax.Array`` whose first entry no single shard holds
    whole (one split along another axis, on this process's devices) is indexed by JAX
    (``x[0]``, which gathers); numpy arrays give ``x[0]`` (a numpy view).

    Args:
        tree: a pytree of arrays with a leading (device) axis.

    Returns:
        ``tree`` with each ``jax.Array`` leaf replaced by its first local entry, a
        ``jax.Array`` on the device that held it; numpy leaves by ``x[0]``.

    Raises:
        MeshkitError: a leaf has no leading axis (a scalar), is not an array, or is a global
            array whose first local entry is split over several devices.

    Examples:
        >>> import numpy as np, meshkit
        >>> state = meshkit.replicate({"w": np.arange(4.0, dtype=np.float32)})
        >>> w = meshkit.unreplicate(state)["w"]
        >>> w.shape, w.tolist(), w.devices() == {state["w"].addressable_shards[0].device}
        ((4,), [0.0, 1.0, 2.0, 3.0], True)
    """
    treedef, out, reads = first_entries(tree, "meshkit.unreplicate")
    if reads:
        by_device: dict[Any, list[tuple[int, jax.Array]]] = collections.defaultdict(list)
        for k, device, data in reads:
            by_device[device].append((k, data))
        for device, group in by_device.items():
            if device is None:  # whole multi-device arrays: JAX's own indexing
                for k, data in group:
                    out[k] = data[0]
                continue
            for (k, _), first in zip(group, _firsts([d for _, d in group]), strict=True):
                out[k] = first
    return jax.tree_util.tree_unflatten(treedef, out)


def _single(x: jax.Array) -> bool:
    return len(x.sharding.device_set) == 1


@_caches.cached(maxsize=32)
def _split_onto(mesh: Mesh, count: int) -> Any:
    return jax.jit(lambda k: jax.random.split(k, count), out_shardings=_sharding(mesh))


@public
def shard_prng_key(prng_key: Any) -> jax.Array:
    """Split a PRNG key into one key per local device (`flax.training.common_utils`'s).

    The keys are ``jax.random.split(prng_key, jax.local_device_count())``, the same values
    as flax gives, already placed as a device-axis array: key ``i`` on this process's ``i``-th
    device. With several processes the result is global (``jax.device_count()`` keys), each
    process's entries being its own split of its own key: pass each process a different key
    (e.g. ``jax.random.fold_in(key, jax.process_index())``) for different randomness per
    process, as with flax.

    Args:
        prng_key: one key: a typed key (``jax.random.key``, shape ``()``) or a raw ``uint32``
            key (``jax.random.PRNGKey``, shape ``(2,)`` for the default implementation).

    Returns:
        The keys, typed like ``prng_key``, with a leading device axis.

    Raises:
        MeshkitError: ``prng_key`` is not a single key (a batch of keys, another dtype).

    Examples:
        >>> import jax, numpy as np, meshkit
        >>> keys = meshkit.shard_prng_key(jax.random.PRNGKey(0))
        >>> keys.shape, keys.dtype
        ((8, 2), dtype('uint32'))
        >>> bool((np.asarray(keys) == np.asarray(jax.random.split(jax.random.PRNGKey(0), 8))).all())
        True
        >>> meshkit.shard_prng_key(jax.random.key(0)).shape
        (8,)
    """
    what = "meshkit.shard_prng_key"
    key = prng_key
    if isinstance(key, jax.Array) and not _single(key):
        whole = _single_device_value(what, "prng_key", key)
        key = whole if whole is not None else np.asarray(key)
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)
    shape = tuple(np.shape(key)) if not typed else tuple(key.shape)
    if typed and shape != ():
        raise MeshkitError(
            f"{what}: prng_key is an array of {shape[0] if shape else 0} typed keys (shape "
            f"{shape}); it splits one key into one per device.\nConsider prng_key[0], or "
            "using the keys as they are if they are already one per device."
        )
    if not typed and (dtype != np.uint32 or len(shape) != 1):
        raise MeshkitError(
            f"{what}: prng_key has dtype {dtype} and shape {shape}; a key is a typed key "
            "(jax.random.key(seed), shape ()) or a raw uint32 key (jax.random.PRNGKey(seed), "
            "shape (2,)).\nConsider jax.random.key(seed), or prng_key[0] for a batch of raw keys."
        )
    mesh = _device_axis.device_mesh(what=what)
    mine = _device_axis.local_devices(mesh)
    local_mesh = _device_axis.device_mesh(mine, mesh.axis_names[0], what=what)
    keys = _split_onto(local_mesh, len(mine))(key)
    if local_mesh is mesh:
        return keys
    shards = {s.device: s.data for s in keys.addressable_shards}
    shape = (mesh.size, *keys.shape[1:])
    return jax.make_array_from_single_device_arrays(
        shape, _sharding(mesh), [shards[d] for d in mine]
    )
