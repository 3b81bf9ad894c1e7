"""Back from global arrays to numpy: `local_from_global` (this process's part) and `gather`."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import caches as _caches
from ..core import canonical as _canonical
from ..core.errors import MeshkitError
from ..core.frames import public
from ..runtime import dispatch as _dispatch
from ..sharding import layout as _layout
from .blocks import tree_paths
from .records import agree_on

_AXIS = "processes"
# Debug mode compares ``to`` by value (a static argument) and the leaves' shapes.
_SITE = _dispatch.CallSite(
    "gather", "meshkit.gather", info={"params": ("x", "to"), "static_argnums": (1,)}
)


def _leaves(x: Any, what: str, *, numpy_ok: bool = False) -> tuple[list[tuple[str, Any]], Any]:
    """``x``'s leaves with their paths: jax.Arrays, and numpy (as numpy) where ``numpy_ok``."""
    named, treedef = tree_paths(x)
    for i, (where, leaf) in enumerate(named):
        if numpy_ok and isinstance(leaf, np.ndarray | np.generic):
            named[i] = (where, np.asarray(leaf))
        elif not isinstance(leaf, jax.Array):
            raise MeshkitError(
                f"{what}: the leaf at {where} is of type {type(leaf).__name__}, not a jax.Array.\n"
                "Consider passing the global arrays themselves (numpy data is already local)."
            )
    return named, treedef


@public
def local_from_global(x: Any) -> Any:
    """This process's part of global arrays, as numpy, in the layout it was given.

    The inverse of `meshkit.global_array_from_local`, for any array (``jax.jit`` outputs
    included): along each dimension, the distinct ranges this process's devices hold, in
    increasing order (`meshkit.process_slice`); replicated blocks are read once.

    Args:
        x: a `jax.Array` or a pytree of them; numpy leaves come back as they are.

    Returns:
        numpy arrays, in ``x``'s pytree structure.

    Raises:
        MeshkitError: a leaf is neither a ``jax.Array`` nor numpy, or this process's shards do
            not form a grid (`meshkit.gather` still works).

    Examples:
        >>> import numpy as np, meshkit
        >>> mesh = meshkit.make_mesh({"data": -1})
        >>> x = np.arange(32, dtype=np.float32).reshape(16, 2)
        >>> back = meshkit.local_from_global(meshkit.global_array_from_local(x, mesh, "data"))
        >>> bool((back == x).all())
        True
    """
    what = "meshkit.local_from_global"
    leaves, treedef = _leaves(x, what, numpy_ok=True)
    outs: list[np.ndarray] = []
    fetch, into = [], []
    for i, (where, leaf) in enumerate(leaves):
        if isinstance(leaf, np.ndarray):
            outs.append(leaf)  # host data is this process's already
            continue
        p = _layout.plan(leaf.sharding, tuple(leaf.shape), jax.process_index())
        if not p.rectangular:
            raise MeshkitError(
                f"{what}: this process's shards of {where} (shape {leaf.shape}, sharding "
                f"{leaf.sharding}) do not form a grid, so no single local array can hold them."
                "\nConsider meshkit.gather(x) for the whole value."
            )
        shards = {s.device: s.data for s in leaf.addressable_shards}
        for pl in p.placements:
            if pl.first:
                fetch.append(shards[pl.device])
                into.append((i, pl.local_index))
        outs.append(np.empty(p.local_shape, leaf.dtype))
    for (i, index), block in zip(into, jax.device_get(fetch), strict=True):
        outs[i][index] = block
    return jax.tree_util.tree_unflatten(treedef, outs)


@_caches.cached(maxsize=64)
def _all_gather(mesh: Mesh) -> Any:
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))


@_caches.cached(maxsize=64)
def _gather_to(mesh: Mesh, root: int) -> Any:
    n = mesh.devices.size

    def body(a: jax.Array) -> jax.Array:
        rows = [a if src == root else jax.lax.ppermute(a, _AXIS, [(src, root)]) for src in range(n)]
        return jax.numpy.concatenate(rows, axis=1)

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=PartitionSpec(_AXIS), out_specs=PartitionSpec(_AXIS)
        )
    )


@public
def gather(x: Any, *, to: int | Literal["all"] = "all") -> Any:
    """The whole value of global arrays, as numpy, on every process or on one.

    Each block travels once, over one device per process; the whole array never sits on every
    device.

    Args:
        x: a `jax.Array` or a pytree of them (any sharding).
        to: ``"all"`` or the process index that gets the value (the others get None); the same
            on every process.

    Returns:
        numpy arrays in ``x``'s pytree structure; None on processes other than ``to``.

    Raises:
        MeshkitError: ``to`` is not ``"all"`` or a process index; a leaf is not a
            ``jax.Array``.

    Examples:
        >>> import numpy as np, meshkit
        >>> mesh = meshkit.make_mesh({"data": 4, "model": 2})
        >>> value = np.arange(16, dtype=np.float32).reshape(4, 4)
        >>> x = meshkit.global_array_from_local(value, mesh, "data model")
        >>> meshkit.gather(x, to=0)[1]
        array([4., 5., 6., 7.], dtype=float32)
    """
    what = "meshkit.gather"
    _dispatch.enter(_SITE, (x, to))
    count = jax.process_count()
    if to != "all" and (isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < count):
        raise MeshkitError(
            f"{what}: to={to!r} is not a process; the program has {count} process"
            f"{'es' if count > 1 else ''} (0 to {count - 1}).\n"
            'Consider to="all" (every process gets the value) or to=0 (process 0 only).'
        )
    leaves, treedef = _leaves(x, what)
    me = jax.process_index()
    if count == 1:
        values = [np.asarray(jax.device_get(leaf)) for _, leaf in leaves]
        return jax.tree_util.tree_unflatten(treedef, values)
    _agree_on_call(to, leaves, treedef, what)
    plans = [_layout.plan(leaf.sharding, tuple(leaf.shape), me) for _, leaf in leaves]
    # Each block is sent by the lowest process holding it; plans are global, so every process
    # knows what every other sends: per process, (leaf index, block) in order.
    sends: list[list[tuple[int, Any]]] = [[] for _ in range(count)]
    for i, plan in enumerate(plans):
        sender: dict[Any, int] = {}
        for d, b in plan.blocks.items():
            sender[b] = min(sender.get(b, count), plan.owners[d])
        for b in sorted(sender):
            sends[sender[b]].append((i, b))

    def nbytes(i: int, block: Any) -> int:
        return math.prod(b - a for a, b in block) * leaves[i][1].dtype.itemsize

    width = max(1, *(sum(nbytes(i, b) for i, b in blocks) for blocks in sends))
    shards = [
        {plan.blocks[s.device]: s.data for s in x.addressable_shards}
        for plan, (_, x) in zip(plans, leaves, strict=True)
    ]
    sent = jax.device_get([shards[i][b] for i, b in sends[me]])
    raw = [np.ascontiguousarray(data).view(np.uint8).reshape(-1) for data in sent]
    payload = np.zeros(width, np.uint8)
    payload[: sum(r.size for r in raw)] = np.concatenate([np.empty(0, np.uint8), *raw])
    one: dict[int, Any] = {}  # each process's device of lowest id
    for d in sorted((d for _, x in leaves for d in x.sharding.device_set), key=lambda d: d.id):
        one.setdefault(int(d.process_index), d)
    mesh = Mesh(np.array([one[p] for p in sorted(one)], dtype=object), (_AXIS,))
    global_payload = jax.make_array_from_single_device_arrays(
        (count, width),
        NamedSharding(mesh, PartitionSpec(_AXIS)),
        [jax.device_put(payload.reshape(1, width), one[me])],
    )
    if to == "all":
        rows = np.asarray(_all_gather(mesh)(global_payload).addressable_shards[0].data)
    else:
        out = _gather_to(mesh, int(to))(global_payload)
        if me != to:
            out.block_until_ready()
            return None
        rows = np.asarray(out.addressable_shards[0].data).reshape(count, width)
    values = [np.empty(leaf.shape, leaf.dtype) for _, leaf in leaves]
    for p, blocks in enumerate(sends):
        offset = 0
        for i, block in blocks:
            size, shape = nbytes(i, block), [b - a for a, b in block]
            data = rows[p, offset : offset + size].view(values[i].dtype).reshape(shape)
            values[i][tuple(slice(a, b) for a, b in block)] = data
            offset += size
    return jax.tree_util.tree_unflatten(treedef, values)


def _agree_on_call(
    to: int | str, leaves: list[tuple[str, jax.Array]], treedef: Any, what: str
) -> None:
    """Raise on every process unless all gather the same arrays to the same place (else: hang)."""
    shapes = ", ".join(f"{w}: {leaf.dtype}{list(leaf.shape)}" for w, leaf in leaves)
    said = {  # each as the message shows it
        "to": f"to={to!r}",
        "structure": f"a pytree {_canonical.structure(treedef)}",
        "leaves": f"leaves [{shapes}]",
    }
    records = agree_on(
        _channel.scoped("gather", what), json.dumps(said), what, arrive="call gather",
        did=f"; this process (process {jax.process_index()}) did",
        rule="Every process must call gather, the same number of times and in the same order "
        "(it is a collective).",
    )  # fmt: skip
    if records is None:
        return
    _, groups = _missing.differences({p: json.loads(r).items() for p, r in records.items()})[0]
    raise MeshkitError(
        f"{what}: the processes called gather differently:\n{_missing.lines(groups)}\n"
        "Every process must pass the same arrays and the same to= (it is a collective: a "
        "process gathering to another place would wait for ever).\nConsider computing to= "
        "from values every process shares (to=0, not to=jax.process_index())."
    )
