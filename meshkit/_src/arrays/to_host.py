"""Back from global arrays to numpy: `local_from_global` (this process's part) and `gather`.

`gather` sends each block once, from the lowest process holding it, as bytes over a
one-device-per-process mesh: no resharding to a replicated array.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..coord import agree as _agree
from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import caches as _caches
from ..core import canonical as _canonical
from ..core import env as _env
from ..core.errors import MeshkitError
from ..core.tracebacks import public
from ..runtime import dispatch as _dispatch
from ..sharding import layout as _layout

__all__ = ["gather", "local_from_global"]

_AXIS = "processes"
# Debug mode compares ``to`` by value (a static argument) and the leaves' shapes.
_SITE = _dispatch.CallSite(
    "gather", "meshkit.gather", info={"params": ("x", "to"), "static_argnums": (1,)}
)


def _leaves(x: Any, what: str, *, numpy_ok: bool = False) -> tuple[list[tuple[str, Any]], Any]:
    """``x``'s leaves with their paths: jax.Arrays, and numpy (as numpy) where ``numpy_ok``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(x)
    out: list[tuple[str, Any]] = []
    for path, leaf in flat:
        where = jax.tree_util.keystr(path) or "(the array)"
        if numpy_ok and isinstance(leaf, np.ndarray | np.generic):
            out.append((where, np.asarray(leaf)))
            continue
        if not isinstance(leaf, jax.Array):
            raise MeshkitError(
                f"{what}: the leaf at {where} is of type {type(leaf).__name__}, not a jax.Array.\n"
                "Consider passing the global arrays themselves (numpy data is already local)."
            )
        out.append((where, leaf))
    return out, treedef


def _local_plan(x: jax.Array, where: str, what: str) -> _layout.Plan:
    p = _layout.plan(x.sharding, tuple(x.shape), jax.process_index())
    if not p.rectangular:
        raise MeshkitError(
            f"{what}: this process's shards of {where} (shape {x.shape}, sharding {x.sharding}) "
            "do not form a grid, so no single local array can hold them.\n"
            "Consider meshkit.gather(x) for the whole value."
        )
    return p


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
        p = _local_plan(leaf, where, what)
        shards = {s.device: s.data for s in leaf.addressable_shards}
        for pl in p.placements:
            if pl.first:
                fetch.append(shards[pl.device])
                into.append((i, pl.local_index))
        outs.append(np.empty(p.local_shape, leaf.dtype))
    for (i, index), block in zip(into, jax.device_get(fetch), strict=True):
        outs[i][index] = block
    return jax.tree_util.tree_unflatten(treedef, outs)


def _process_mesh(devices: list[Any]) -> Mesh:
    by_process: dict[int, Any] = {}
    for d in sorted(devices, key=lambda d: d.id):
        by_process.setdefault(int(d.process_index), d)
    return Mesh(np.array([by_process[p] for p in sorted(by_process)], dtype=object), (_AXIS,))


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
    # knows what every other sends.
    owned: list[list[list[tuple[Any, ...]]]] = []  # [process][leaf] -> blocks, in order
    for p in range(count):
        per_leaf = []
        for plan in plans:
            first_owner: dict[Any, int] = {}
            for d, b in plan.blocks.items():
                first_owner[b] = min(first_owner.get(b, count), plan.owners[d])
            per_leaf.append(sorted(b for b, o in first_owner.items() if o == p))
        owned.append(per_leaf)
    itemsizes = [np.dtype(leaf.dtype).itemsize for _, leaf in leaves]

    def nbytes(blocks: list[tuple[Any, ...]], itemsize: int) -> int:
        return sum(int(np.prod([b - a for a, b in block])) * itemsize for block in blocks)

    sizes = [
        sum(nbytes(owned[p][i], itemsizes[i]) for i in range(len(leaves))) for p in range(count)
    ]
    width = max(1, max(sizes))
    payload = np.zeros(width, np.uint8)
    at = 0
    for i, (_, leaf) in enumerate(leaves):
        shards = {plans[i].blocks[s.device]: s.data for s in leaf.addressable_shards}
        for data in jax.device_get([shards[b] for b in owned[me][i]]):
            raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            payload[at : at + raw.size] = raw
            at += raw.size
    mesh = _process_mesh([d for _, leaf in leaves for d in leaf.sharding.device_set])
    mine = next(d for d in mesh.devices.flat if d.process_index == me)
    global_payload = jax.make_array_from_single_device_arrays(
        (count, width),
        NamedSharding(mesh, PartitionSpec(_AXIS)),
        [jax.device_put(payload.reshape(1, width), mine)],
    )
    if to == "all":
        rows = np.asarray(_all_gather(mesh)(global_payload).addressable_shards[0].data)
    else:
        out = _gather_to(mesh, int(to))(global_payload)
        if me != to:
            out.block_until_ready()
            return None
        rows = np.asarray(out.addressable_shards[0].data).reshape(count, width)
    values = []
    offsets = [0] * count
    for i, (_, leaf) in enumerate(leaves):
        value = np.empty(leaf.shape, leaf.dtype)
        for p in range(count):
            for block in owned[p][i]:
                shape = tuple(b - a for a, b in block)
                size = int(np.prod(shape)) * itemsizes[i]
                raw = rows[p, offsets[p] : offsets[p] + size]
                offsets[p] += size
                value[tuple(slice(a, b) for a, b in block)] = raw.view(leaf.dtype).reshape(shape)
        values.append(value)
    return jax.tree_util.tree_unflatten(treedef, values)


def _agree_on_call(
    to: int | str, leaves: list[tuple[str, jax.Array]], treedef: Any, what: str
) -> None:
    """Raise on every process unless all gather the same arrays to the same place (else: hang)."""
    shapes = [f"{w}: {leaf.dtype}{list(leaf.shape)}" for w, leaf in leaves]
    mine = json.dumps({"to": to, "structure": _canonical.structure(treedef), "leaves": shapes})
    timeout = _env.check_timeout()
    outcome = _agree.check(_channel.scoped("gather", what), mine, mine, timeout=timeout, what=what)
    if outcome.agreed:
        return
    if outcome.missing:
        missing = _missing.did_not(outcome.missing, timeout=timeout, arrive="call gather")
        raise MeshkitError(
            f"{what}: {missing}; this process (process {jax.process_index()}) "
            "did.\nEvery process must call gather, the same number of times and in the same "
            "order (it is a collective).\nConsider looking at those processes' output; "
            f"{_env.ENV_CHECK_TIMEOUT} sets the wait."
        )
    calls = {p: json.loads(r) for p, r in sorted(outcome.records.items())}
    lines = []
    for key, shown in (("to", "to="), ("structure", "a pytree "), ("leaves", "leaves ")):
        groups = _missing.by_value({p: json.dumps(call[key]) for p, call in calls.items()})
        if len(groups) > 1:
            lines = [
                f"  {_missing.processes(ps)}: {shown}{_shown(json.loads(v))}"
                for v, ps in groups.items()
            ]
            break
    raise MeshkitError(
        f"{what}: the processes called gather differently:\n" + "\n".join(lines) + "\n"
        "Every process must pass the same arrays and the same to= (it is a collective: a "
        "process gathering to another place would wait for ever).\nConsider computing to= "
        "from values every process shares (to=0, not to=jax.process_index())."
    )


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value) if isinstance(value, str) and value == "all" else str(value)
