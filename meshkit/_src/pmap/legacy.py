"""The flax-era helpers (``flax.jax_utils``, old ``jax``) on device-axis arrays.

`replicate`, `unreplicate`, `device_put_*`, `shard_prng_key`, `shard`, `prefetch_to_device`,
`pad_shard_unpad` and `get_metrics`, with flax's signatures and results in any process count.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..arrays.assembly import exchange_records
from ..arrays.blocks import tree_paths
from ..arrays.to_host import local_from_global
from ..core import caches as _caches
from ..core.errors import MeshkitError, shorten
from ..core.frames import public
from ..spmd.placement import argnums
from .pmap import check_devices, device_mesh

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


SPEC = PartitionSpec("devices")  # one entry per device of a `device_mesh` (its default axis)


def host_array(what: str, path: str, leaf: Any) -> np.ndarray:
    """A numeric host leaf as numpy in the dtype JAX will use (as `jax.device_put` does)."""
    is_array = isinstance(leaf, bool | int | float | complex) or hasattr(leaf, "__array__")
    value = np.asarray(leaf) if is_array else None
    if value is None or not (
        value.dtype == np.bool_ or jax.numpy.issubdtype(value.dtype, np.number)
    ):
        kind = type(leaf).__name__ if value is None else f"array of dtype {value.dtype}"
        raise MeshkitError(
            _NOT_ARRAY.format(what=what, path=path, kind=kind, shown=shorten(repr(leaf), 60))
        )
    target = np.dtype(jax.dtypes.canonicalize_dtype(value.dtype))
    return value if value.dtype == target else value.astype(target)


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


def _stack(shards: list[Any], mesh: Mesh, what: str) -> Any:
    """Entry ``i`` of each device-axis leaf is ``shards[i]``'s; one shard: it, on every device."""

    def stack(keys: Any, *column: Any) -> jax.Array:
        path = jax.tree_util.keystr(keys) or "(the array)"
        values: list[Any] = [
            _single_device_value(what, path, v) if isinstance(v, jax.Array) else None
            for v in column
        ]
        if any(v is None for v in values):  # host data, or split over devices: read once
            values = [host_array(what, path, v) for v in column]
        want = (tuple(values[0].shape), values[0].dtype)
        for i, v in enumerate(values[1:], start=1):
            got = (tuple(v.shape), v.dtype)
            if got != want:
                sides = {"got": f"{got[1]}{list(got[0])}", "want": f"{want[1]}{list(want[0])}"}
                raise MeshkitError(_SHARDS_MISMATCH.format(i=i, path=path, **sides))
        rows = [v[None] for v in values]  # each device's (1, ...) block, never stacked
        at = lambda index: rows[(index[0].start or 0) % len(rows)]  # noqa: E731
        return jax.make_array_from_callback((mesh.size, *want[0]), NamedSharding(mesh, SPEC), at)

    return jax.tree_util.tree_map_with_path(stack, *shards)


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
    mesh = device_mesh(None if devices is None else check_devices(devices, what))
    return _stack([tree], mesh, what)


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
    return _stack([x], device_mesh(check_devices(devices, what)), what)


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
    why = "every shard must have the same structure.\nConsider building every shard with the same"
    _same_structures(shards, what, "shards", why + " keys and nesting.")
    return _stack(shards, device_mesh(chosen), what)


def _same_structures(trees: list[Any], what: str, name: str, why: str) -> None:
    first = jax.tree_util.tree_structure(trees[0])
    for i, tree in enumerate(trees[1:], start=1):
        treedef = jax.tree_util.tree_structure(tree)
        if treedef != first:
            raise MeshkitError(
                f"{what}: {name}[{i}] has the pytree structure {treedef}, but {name}[0] has "
                f"{first}; {why}"
            )


def _path_at(tree: Any, k: int) -> str:
    return tree_paths(tree)[0][k][0]


def _first_entry_shard(tree: Any, k: int, x: jax.Array) -> tuple[Any, jax.Array]:
    """``(device, data)``: the shard holding this process's first entry whole, or ``(None, x)``."""
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
    return jax.jit(lambda k: jax.random.split(k, count), out_shardings=NamedSharding(mesh, SPEC))


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
    mesh = device_mesh()
    local_mesh = device_mesh(mesh.local_devices)
    keys = _split_onto(local_mesh, local_mesh.size)(key)
    return multihost_utils.host_local_array_to_global_array(keys, mesh, SPEC)


_SHARD_SIZE = """\
meshkit.shard: the leaf at {path} has shape {shape}; its leading (batch) dimension of size \
{size} does not split over this process's {local} local devices (shard reshapes it to \
({local}, {size} // {local}, ...)).
Consider a batch size divisible by {local}, meshkit.pad_shard_unpad (which pads the last \
batch), or meshkit.global_batches(..., pad=True)."""

_PREFETCH_SIZE = """\
meshkit.prefetch_to_device: the leaf at {path} of element {index} has shape {shape}; its \
leading dimension must have one entry per local device ({local}: {devices}).
Consider meshkit.shard(batch) on each element first (it reshapes the batch to ({local}, -1, \
...))."""

_BATCH_SIZES = """\
meshkit.pad_shard_unpad: the batched arguments of {name} have different batch (leading) \
sizes:
{listing}
Every array that is not static is padded and split along its leading axis, so all must share \
one batch size.
Consider static_argnums= / static_argnames= for arguments that are not batched."""


@public
def shard(xs: Any) -> Any:
    """Reshape each leaf's leading (batch) axis to ``(local devices, -1)`` (flax's ``shard``).

    A reshape only: numpy stays numpy (a view); `pmap_compat` places the entries later.

    Examples:
        >>> import numpy as np, meshkit
        >>> meshkit.shard({"label": np.arange(32)})["label"].shape
        (8, 4)
    """
    local = jax.local_device_count()
    named, treedef = tree_paths(xs)
    out = []
    for path, leaf in named:
        if not isinstance(leaf, jax.Array | np.ndarray):
            leaf = host_array("meshkit.shard", path, leaf)
        shape = tuple(leaf.shape)
        if not shape:
            raise MeshkitError(
                f"meshkit.shard: the leaf at {path} is a scalar (shape ()); shard splits a "
                f"leading (batch) dimension over the {local} local devices.\nConsider "
                "meshkit.replicate for values every device needs whole."
            )
        if shape[0] % local:
            raise MeshkitError(
                _SHARD_SIZE.format(path=path, shape=shape, size=shape[0], local=local)
            )
        out.append(leaf.reshape((local, shape[0] // local, *shape[1:])))
    return jax.tree_util.tree_unflatten(treedef, out)


@public
def prefetch_to_device(
    iterator: Iterable[Any], size: int, devices: Sequence[Any] | None = None
) -> Iterator[Any]:
    """Put the elements of ``iterator`` on the devices ``size`` elements ahead (flax's).

    Each leaf (one entry per local device along axis 0, as `shard` makes) becomes a
    device-axis array. An error of ``iterator`` is raised after the elements before it.
    ``size=0`` places each element when it is asked for.

    Examples:
        >>> import numpy as np, meshkit
        >>> batches = (meshkit.shard({"x": np.full((16, 2), i, np.float32)}) for i in range(3))
        >>> [b["x"].shape for b in meshkit.prefetch_to_device(batches, size=2)]
        [(8, 2, 2), (8, 2, 2), (8, 2, 2)]
    """
    what = "meshkit.prefetch_to_device"
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
        raise MeshkitError(
            f"{what}: size={size!r}; size is how many elements are placed ahead of the one in "
            "use, an int >= 0.\nConsider size=2."
        )
    mesh = device_mesh(None if devices is None else check_devices(devices, what))
    return _prefetch(enumerate(iterator), int(size), mesh)


def _prefetch(source: Iterator[tuple[int, Any]], size: int, mesh: Mesh) -> Iterator[Any]:
    mine = mesh.local_devices

    def place(index: int, element: Any) -> Any:
        named, treedef = tree_paths(element)
        out = []
        for path, leaf in named:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != len(mine):
                listed = ", ".join(str(d) for d in mine[:4]) + (", ..." if len(mine) > 4 else "")
                raise MeshkitError(
                    _PREFETCH_SIZE.format(
                        path=path, index=index, shape=tuple(np.shape(leaf)), local=len(mine),
                        devices=listed,
                    )
                )  # fmt: skip
            if not isinstance(leaf, jax.Array):
                leaf = host_array("meshkit.prefetch_to_device", path, leaf)
            out.append(leaf)
        out = multihost_utils.host_local_array_to_global_array(out, mesh, SPEC)
        return jax.tree_util.tree_unflatten(treedef, out)

    queue: collections.deque[Any] = collections.deque()
    while True:
        try:
            index, element = next(source)
        except StopIteration:
            break
        except Exception:  # delivered after the elements already placed
            yield from queue
            raise
        queue.append(place(index, element))
        if len(queue) > size:  # the next ones travel while the caller works on this one
            yield queue.popleft()
    yield from queue


@public
def pad_shard_unpad(
    wrapped: Callable[..., Any],
    static_argnums: int | Sequence[int] = (0,),
    static_argnames: str | Sequence[str] = (),
    static_return: bool = False,
) -> Callable[..., Any]:
    """Pad the batch to a multiple of the local devices, shard, call, then unshard and unpad.

    flax's ``pad_shard_unpad``: every non-static argument's leaves share a batch size ``b``;
    they are zero-padded to ``(L, db, ...)`` (``L`` local devices, ``db = ceil(b / L)``, at
    least the returned function's ``min_device_batch=``), ``wrapped`` is called, and each
    output is brought to the host, reshaped and cut to ``b`` rows (unless
    ``static_return``). With several processes all pad to the largest per-device batch.

    Examples:
        >>> import numpy as np, meshkit
        >>> out = meshkit.pad_shard_unpad(lambda w, x: x * w)(2.0, np.arange(10, dtype=np.float32))
        >>> out.shape, out.tolist()[-3:]
        ((10,), [14.0, 16.0, 18.0])
    """
    statics = argnums(static_argnums, "static_argnums", "meshkit.pad_shard_unpad", from_end=True)
    static_names = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)
    name = getattr(wrapped, "__name__", type(wrapped).__name__)

    @functools.wraps(wrapped)
    def wrapper(*args: Any, min_device_batch: int | None = None, **kwargs: Any) -> Any:
        local = jax.local_device_count()
        fixed = {i % len(args) for i in statics if -len(args) <= i < len(args)}
        sizes: dict[str, int] = {}
        batched = [(f"args[{i}]", a) for i, a in enumerate(args) if i not in fixed]
        batched += [(f"{k}=", v) for k, v in kwargs.items() if k not in static_names]
        for where, tree in batched:
            _batch_sizes(tree, where, sizes)
        if not sizes:
            raise MeshkitError(
                f"meshkit.pad_shard_unpad: {name} got no batched argument (all are static: "
                f"static_argnums={statics}, static_argnames={sorted(static_names)}), so there "
                "is no batch to pad and shard.\nConsider fewer static arguments."
            )
        if len(set(sizes.values())) > 1:
            listing = "\n".join(f"  {where}: {size}" for where, size in sizes.items())
            raise MeshkitError(_BATCH_SIZES.format(name=name, listing=listing))
        b = next(iter(sizes.values()))
        per_device = max(-(-b // local), int(min_device_batch or 0))
        if jax.process_count() > 1:
            # Every process pads to the largest per-device batch, so that the parts fit.
            records = exchange_records(
                "pad_shard_unpad", {"per_device": per_device}, "meshkit.pad_shard_unpad"
            )
            per_device = max(int(r["per_device"]) for r in records.values())

        def pad(x: Any) -> np.ndarray:
            value = np.asarray(x)
            value = np.pad(value, [(0, local * per_device - b)] + [(0, 0)] * (value.ndim - 1))
            return value.reshape(local, per_device, *value.shape[1:])

        new_args = [a if i in fixed else jax.tree.map(pad, a) for i, a in enumerate(args)]
        new_kwargs = {
            k: v if k in static_names else jax.tree.map(pad, v) for k, v in kwargs.items()
        }
        out = wrapped(*new_args, **new_kwargs)
        return out if static_return else _unpad(out, b)

    return wrapper


def _batch_sizes(tree: Any, where: str, sizes: dict[str, int]) -> None:
    for path, leaf in tree_paths(tree)[0]:
        label = where + ("" if path == "(the array)" else path)
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise MeshkitError(
                f"meshkit.pad_shard_unpad: {label} is a global jax.Array (shape {leaf.shape}); "
                "pad_shard_unpad pads and shards this process's batch.\nConsider "
                "meshkit.local_from_global(x) for this process's part."
            )
        if np.ndim(leaf) == 0:
            raise MeshkitError(
                f"meshkit.pad_shard_unpad: {label} is a scalar, but arguments that are not "
                "static are batches, padded and split along their leading axis.\nConsider "
                "static_argnums= / static_argnames= for it."
            )
        sizes[label] = int(np.shape(leaf)[0])


def _unpad(out: Any, b: int) -> Any:
    named, treedef = tree_paths(out)
    fetched: list[Any] = []
    for path, leaf in named:
        if np.ndim(leaf) < 2:
            raise MeshkitError(
                f"meshkit.pad_shard_unpad: the output at {path} has shape "
                f"{tuple(np.shape(leaf))}; outputs are unsharded from (devices, per-device "
                "batch, ...), so each needs those two leading axes.\nConsider "
                "static_return=True and unpadding the outputs yourself."
            )
        global_ = isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        fetched.append(local_from_global(leaf) if global_ else leaf)
    host = jax.device_get(fetched)  # one batched transfer, then reshaped on the host
    rows = [np.asarray(x).reshape(-1, *np.shape(x)[2:])[:b] for x in host]
    return jax.tree_util.tree_unflatten(treedef, rows)


@public
def get_metrics(device_metrics: Sequence[Any]) -> Any:
    """Stack a list of replicated metric pytrees into one pytree of numpy arrays (flax's).

    Each step's metrics are unreplicated, all come to the host in one transfer, and each leaf
    of shape ``s`` becomes ``(len(device_metrics), *s)``.

    Examples:
        >>> import numpy as np, meshkit
        >>> steps = [meshkit.replicate({"loss": np.float32(l)}) for l in (0.5, 0.25)]
        >>> meshkit.get_metrics(steps)
        {'loss': array([0.5 , 0.25], dtype=float32)}
    """
    what = "meshkit.get_metrics"
    steps = list(device_metrics)
    if not steps:
        raise MeshkitError(
            f"{what}: device_metrics is empty; it stacks one pytree per step.\nConsider "
            "calling it once some steps' metrics are collected."
        )
    why = (
        "the steps are stacked leaf by leaf.\nConsider returning the same metrics from every step."
    )
    _same_structures(steps, what, "device_metrics", why)
    host = jax.device_get([first_entries(step, what) for step in steps])  # one transfer
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *host)
