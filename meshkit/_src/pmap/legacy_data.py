"""The flax-era data helpers: a batch split per device, placed ahead, padded; metrics stacked.

`shard`, `prefetch_to_device`, `pad_shard_unpad` and `get_metrics` keep the signatures and
results of flax's functions (``flax.training.common_utils``, ``flax.jax_utils``), in one process
and in several. They shape and move *batches* (and per-step metrics) for a `pmap_compat` or
``jax.pmap`` step; the device-axis placement they build on is in `meshkit._src.pmap.legacy`.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..arrays.assembly import exchange_records
from ..arrays.blocks import tree_paths
from ..arrays.to_host import local_from_global
from ..core.errors import MeshkitError
from ..core.tracebacks import public
from ..spmd.placement import argnums
from . import device_axis as _device_axis
from .legacy import device_axis_mesh, first_entries, host_array

__all__ = ["get_metrics", "pad_shard_unpad", "prefetch_to_device", "shard"]

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
    """Split the leading (batch) axis into ``(local devices, -1)`` (flax's ``shard``).

    Each leaf of shape ``(b, ...)`` is reshaped to ``(L, b // L, ...)``, ``L`` being
    ``jax.local_device_count()``: each process shards its own batch. As in flax, this is a
    reshape and nothing moves: numpy stays numpy (a view, no copy) and a ``jax.Array`` is
    reshaped by JAX. Placement is left to the consumer: `meshkit.pmap_compat` (or
    ``jax.pmap``) puts each entry on its device in one batched transfer, and with several
    processes assembles the processes' entries into one global array; `prefetch_to_device`
    does the same ahead of time.

    Args:
        xs: a pytree of arrays whose leading dimension is divisible by the local device count.

    Returns:
        ``xs`` with every leaf reshaped to ``(L, -1, *rest)``.

    Raises:
        MeshkitError: a leaf is a scalar, or its leading dimension does not divide by ``L``.

    Examples:
        >>> import numpy as np, meshkit
        >>> batch = {"image": np.zeros((32, 28, 28), np.float32), "label": np.arange(32)}
        >>> sharded = meshkit.shard(batch)
        >>> sharded["image"].shape, sharded["label"].shape, type(sharded["label"]).__name__
        ((8, 4, 28, 28), (8, 4), 'ndarray')
    """
    local = jax.local_device_count()
    named, treedef = tree_paths(xs)
    out = []
    for path, leaf in named:
        value = (
            leaf
            if isinstance(leaf, jax.Array | np.ndarray)
            else host_array("meshkit.shard", path, leaf)
        )
        shape = tuple(value.shape)
        if not shape or shape[0] % local:
            if not shape:
                raise MeshkitError(
                    f"meshkit.shard: the leaf at {path} is a scalar (shape ()); shard splits "
                    f"a leading (batch) dimension over the {local} local devices.\nConsider "
                    "meshkit.replicate for values every device needs whole."
                )
            raise MeshkitError(
                _SHARD_SIZE.format(path=path, shape=shape, size=shape[0], local=local)
            )
        out.append(value.reshape((local, shape[0] // local, *shape[1:])))
    return jax.tree_util.tree_unflatten(treedef, out)


_PREFETCH = "meshkit.prefetch_to_device"


@public
def prefetch_to_device(
    iterator: Iterable[Any], size: int, devices: Sequence[Any] | None = None
) -> Iterator[Any]:
    """Put the elements of ``iterator`` on the devices ``size`` elements ahead (flax's).

    Each element is a pytree whose leaves have one entry per local device along their leading
    axis (as `shard` makes them); each leaf becomes a device-axis array, entry ``i`` on the
    ``i``-th local device (with several processes a global array over every process's devices,
    each process contributing its own entries). While the caller works on one element, the
    next ``size`` are already being copied: at most ``size`` placed elements wait at any time
    (plus the one handed out), so memory stays bounded.

    An exception raised by ``iterator`` reaches the caller, with its own traceback, after the
    elements before it have been yielded. ``size=0`` places each element when it is asked for
    (flax's yields nothing then).

    Args:
        iterator: an iterator (or iterable) of pytrees of arrays with leading axis ``L``, the
            number of local devices among ``devices``.
        size: how many elements to place ahead (``>= 0``); 2 is usually enough.
        devices: the devices of the device axis; default: every device of every process (this
            process's local devices take its entries).

    Returns:
        An iterator over the placed elements.

    Raises:
        MeshkitError: ``size`` is negative or not an int; ``devices`` is not a valid device
            list; (while iterating) a leaf's leading dimension is not ``L``.

    Examples:
        >>> import numpy as np, meshkit
        >>> batches = (meshkit.shard({"x": np.full((16, 2), i, np.float32)}) for i in range(3))
        >>> [b["x"].shape for b in meshkit.prefetch_to_device(batches, size=2)]
        [(8, 2, 2), (8, 2, 2), (8, 2, 2)]
    """
    what = _PREFETCH
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
        raise MeshkitError(
            f"{what}: size={size!r}; size is how many elements are placed ahead of the one in "
            "use, an int >= 0.\nConsider size=2."
        )
    mesh = device_axis_mesh(devices, what)
    return _prefetch(iter(iterator), int(size), mesh)


def _prefetch(source: Iterator[Any], size: int, mesh: Mesh) -> Iterator[Any]:
    mine = _device_axis.local_devices(mesh)
    queue: collections.deque[Any] = collections.deque()
    failure: BaseException | None = None
    count = 0

    def place(element: Any, index: int) -> Any:
        named, treedef = tree_paths(element)
        out = []
        for path, leaf in named:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != len(mine):
                raise MeshkitError(
                    _PREFETCH_SIZE.format(
                        path=path, index=index, shape=tuple(np.shape(leaf)), local=len(mine),
                        devices=", ".join(str(d) for d in mine[:4])
                        + (", ..." if len(mine) > 4 else ""),
                    )
                )  # fmt: skip
            value = leaf if isinstance(leaf, jax.Array) else host_array(_PREFETCH, path, leaf)
            out.append(_device_axis.from_local(value, mesh, 0))
        return jax.tree_util.tree_unflatten(treedef, out)

    def fill(until: int) -> None:
        nonlocal failure, count
        while failure is None and len(queue) < until:
            try:
                element = next(source)
            except StopIteration:
                return
            except Exception as e:  # delivered after the elements already placed
                failure = e
                return
            queue.append(place(element, count))
            count += 1

    while True:
        fill(max(size, 1))
        if not queue:
            break
        element = queue.popleft()
        fill(size)  # the next ones travel while the caller works on this one
        yield element
    if failure is not None:
        raise failure


@public
def pad_shard_unpad(
    wrapped: Callable[..., Any],
    static_argnums: int | Sequence[int] = (0,),
    static_argnames: str | Sequence[str] = (),
    static_return: bool = False,
) -> Callable[..., Any]:
    """Pad the batch to a multiple of the local devices, shard, call, then unshard and unpad.

    flax's ``pad_shard_unpad``: the returned function takes the same arguments as ``wrapped``.
    Every array of the arguments that are not static (by default all but the first, usually
    the parameters) has a leading batch dimension ``b``, the same for all; it is padded with
    zeros to ``L * db`` rows (``L`` local devices, ``db = ceil(b / L)``, at least
    ``min_device_batch`` when that keyword is given to the returned function, so that fewer
    shapes get compiled) and reshaped to ``(L, db, ...)``, numpy on the host, like `shard`.
    ``wrapped`` (typically a `meshkit.pmap_compat` or ``jax.pmap`` function) is called with
    them; each output leaf of shape ``(L, db, ...)`` is brought to the host (this process's
    entries of a global array), reshaped to ``(L * db, ...)`` and cut to its first ``b`` rows.
    With several processes each process pads and unpads its own batch, to the per-device batch
    of the process with the most rows (agreed through the coordination service), so that the
    processes' arguments fit together.

    Args:
        wrapped: the function to call on the padded, sharded arguments.
        static_argnums: positions of arguments passed through untouched (negative counts from
            the end).
        static_argnames: names of keyword arguments passed through untouched.
        static_return: return ``wrapped`` 's outputs as they are (not unsharded, unpadded).

    Returns:
        The wrapping function, with the extra keyword ``min_device_batch``.

    Raises:
        MeshkitError: (when called) the batched arguments disagree on the batch size, one of
            their leaves is a scalar, or there is no batched argument; an output to unpad has
            fewer than two dimensions.

    Examples:
        >>> import numpy as np, meshkit
        >>> def predict(w, x):
        ...     return x * w  # on (devices, per-device batch, ...) arrays
        >>> out = meshkit.pad_shard_unpad(predict)(2.0, np.arange(10, dtype=np.float32))
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
        for i, a in enumerate(args):
            if i not in fixed:
                _batch_sizes(a, f"args[{i}]", sizes)
        for k, v in kwargs.items():
            if k not in static_names:
                _batch_sizes(v, f"{k}=", sizes)
        if not sizes:
            raise MeshkitError(
                f"meshkit.pad_shard_unpad: {name} got no batched argument (all are static: "
                f"static_argnums={statics}, static_argnames={sorted(static_names)}), so there "
                "is no batch to pad and shard.\nConsider fewer static arguments."
            )
        batches = set(sizes.values())
        if len(batches) > 1:
            listing = "\n".join(f"  {where}: {size}" for where, size in sizes.items())
            raise MeshkitError(_BATCH_SIZES.format(name=name, listing=listing))
        b = batches.pop()
        per_device = -(-b // local)
        if min_device_batch is not None:
            per_device = max(per_device, int(min_device_batch))
        if jax.process_count() > 1:
            # Every process pads to the largest per-device batch, so that their arguments fit
            # together into one global array (pmap_compat checks that they do).
            records = exchange_records(
                "pad_shard_unpad", {"per_device": per_device}, "meshkit.pad_shard_unpad"
            )
            per_device = max(int(r["per_device"]) for r in records.values())

        def pad(x: Any) -> np.ndarray:
            value = np.asarray(x)
            extra = local * per_device - b
            if extra:
                zeros = np.zeros((extra, *value.shape[1:]), value.dtype)
                value = np.concatenate([value, zeros])
            return value.reshape(local, per_device, *value.shape[1:])

        new_args = [a if i in fixed else jax.tree.map(pad, a) for i, a in enumerate(args)]
        new_kwargs = {
            k: v if k in static_names else jax.tree.map(pad, v) for k, v in kwargs.items()
        }
        out = wrapped(*new_args, **new_kwargs)
        if static_return:
            return out
        return _unpad(out, b)

    return wrapper


def _batch_sizes(tree: Any, where: str, sizes: dict[str, int]) -> None:
    named, _ = tree_paths(tree)
    for path, leaf in named:
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
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            fetched.append(local_from_global(leaf))
        else:
            fetched.append(leaf)
    host = jax.device_get(fetched)  # one batched transfer, then reshaped on the host
    rows = [np.asarray(x).reshape(-1, *np.shape(x)[2:])[:b] for x in host]
    return jax.tree_util.tree_unflatten(treedef, rows)


@public
def get_metrics(device_metrics: Sequence[Any]) -> Any:
    """Stack a list of replicated metric pytrees into one pytree of numpy arrays (flax's).

    flax's ``common_utils.get_metrics``: each element (one step's metrics, as a
    `meshkit.pmap_compat` or ``jax.pmap`` step returns them, replicated across devices) is
    unreplicated (this process's first entry, reading one shard per array), every step's
    values come to the host in one transfer, and each leaf is stacked along a new leading
    axis: leaves of shape ``s`` become ``(len(device_metrics), *s)``.

    Args:
        device_metrics: a non-empty sequence of pytrees of one structure, with a leading
            device axis on every array.

    Returns:
        The stacked metrics, numpy arrays in the elements' pytree structure.

    Raises:
        MeshkitError: ``device_metrics`` is empty, its elements differ in structure, or a leaf
            has no leading axis.

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
    treedef0 = jax.tree_util.tree_structure(steps[0])
    reads: list[tuple[int, int, jax.Array]] = []  # (step, leaf index, data)
    firsts: list[list[Any]] = []
    for i, step in enumerate(steps):
        treedef, out, step_reads = first_entries(step, what)
        if treedef != treedef0:
            raise MeshkitError(
                f"{what}: device_metrics[{i}] has the pytree structure {treedef}, but "
                f"device_metrics[0] has {treedef0}; the steps are stacked leaf by leaf.\n"
                "Consider returning the same metrics from every step."
            )
        reads += [(i, k, data) for k, _, data in step_reads]
        firsts.append(out)
    # The shards themselves come to the host (one transfer), then lose their leading entry
    # there: no device work per metric.
    host = jax.device_get([data for _, _, data in reads])
    for (i, k, _), value in zip(reads, host, strict=True):
        firsts[i][k] = np.asarray(value)[0]
    stacked = [np.stack([np.asarray(f[k]) for f in firsts]) for k in range(len(firsts[0]))]
    return jax.tree_util.tree_unflatten(treedef0, stacked)
