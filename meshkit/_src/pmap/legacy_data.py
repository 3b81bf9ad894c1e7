"""The flax-era data helpers: `shard`, `prefetch_to_device`, `pad_shard_unpad`, `get_metrics`.

Same signatures and results as flax's, in one process and in several.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from ..arrays.assembly import exchange_records
from ..arrays.blocks import tree_paths
from ..arrays.to_host import local_from_global
from ..core.errors import MeshkitError
from ..core.tracebacks import public
from ..spmd.placement import argnums
from . import device_axis as _device_axis
from .legacy import device_axis_mesh, first_entries, host_array

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
    return _prefetch(iter(iterator), int(size), device_axis_mesh(devices, what))


def _prefetch(source: Iterator[Any], size: int, mesh: Any) -> Iterator[Any]:
    mine = _device_axis.local_devices(mesh)
    queue: collections.deque[Any] = collections.deque()
    failure: BaseException | None = None
    count = 0

    def place(element: Any) -> Any:
        named, treedef = tree_paths(element)
        out = []
        for path, leaf in named:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != len(mine):
                shown = ", ".join(str(d) for d in mine[:4]) + (", ..." if len(mine) > 4 else "")
                raise MeshkitError(
                    _PREFETCH_SIZE.format(
                        path=path, index=count, shape=tuple(np.shape(leaf)), local=len(mine),
                        devices=shown,
                    )
                )  # fmt: skip
            if not isinstance(leaf, jax.Array):
                leaf = host_array("meshkit.prefetch_to_device", path, leaf)
            out.append(_device_axis.from_local(leaf, mesh, 0))
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
            queue.append(place(element))
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
            extra = np.zeros((local * per_device - b, *value.shape[1:]), value.dtype)
            value = np.concatenate([value, extra]) if len(extra) else value
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
    treedef0 = jax.tree_util.tree_structure(steps[0])
    for i, step in enumerate(steps):
        treedef = jax.tree_util.tree_structure(step)
        if treedef != treedef0:
            raise MeshkitError(
                f"{what}: device_metrics[{i}] has the pytree structure {treedef}, but "
                f"device_metrics[0] has {treedef0}; the steps are stacked leaf by leaf.\n"
                "Consider returning the same metrics from every step."
            )
    host = jax.device_get([first_entries(step, what) for step in steps])  # one transfer
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *host)
