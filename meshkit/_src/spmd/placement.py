"""Classify, then call: how `spmd` and `pmap_compat` decide where each argument goes.

Both entries compile one `jax.jit` per signature whose ``in_shardings`` say where every leaf of
the arguments must live. Before calling it they classify the leaves, never try the call and
retry on failure:

* **placed**: a `jax.Array` whose sharding is the target: passed as it is. When every leaf is
  placed (the steady state: earlier outputs fed back) the call goes straight to jit, after one
  comparison per leaf (`placed`);
* **host data** (numpy, Python scalars): in one process, put on the devices in one batched
  `jax.device_put` (`put_host`; jit would place it too, but it traces a numpy argument and a
  placed array separately); in a multi-process run it is *this process's part*, assembled with
  the other processes' parts as `meshkit.global_array_from_local` does, with its check that the
  parts fit together (`assemble`);
* **process-local device arrays** in a multi-process run: the same as host data (the caller may
  first rewrap ones already on the right local devices without a copy);
* **another layout**: moved (the caller decides whether that deserves a warning).

Tracers (the call is being traced by an enclosing transformation) are never placed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.core import ShapedArray, Tracer
from jax.sharding import Mesh, NamedSharding

from ..arrays import assembly as _assembly
from ..arrays import blocks as _blocks
from ..arrays.caller import calling
from ..coord import channel as _channel
from ..debug import divergence as debug

__all__ = ["assemble", "is_abstract", "is_host", "is_local", "placed", "put_host"]


def placed(leaves: Sequence[Any], targets: list[NamedSharding]) -> bool:
    """Whether every leaf is an array already laid out as its target (no host data).

    Only for calls made outside any trace (`meshkit._src.core.compat.idle`): a tracer is not tested
    for. One list comparison (identity first, then equality, per element), the cheapest test
    of 50 leaves measured here.
    """
    return [getattr(leaf, "sharding", None) for leaf in leaves] == targets


def is_host(leaf: Any) -> bool:
    """Host data: anything that is not a `jax.Array` (numpy, scalars, array-likes)."""
    return not isinstance(leaf, jax.Array)


def is_abstract(leaf: Any) -> bool:
    """A shape and dtype without data (what ``.lower`` may be given): never placed."""
    return isinstance(leaf, jax.ShapeDtypeStruct | ShapedArray)


def is_local(leaf: Any) -> bool:
    """Process-local: host data or an array on this process's devices only (not a tracer)."""
    return not isinstance(leaf, jax.Array) or (
        not isinstance(leaf, Tracer) and leaf.is_fully_addressable
    )


def put_host(values: list[Any], targets: list[NamedSharding]) -> list[jax.Array]:
    """Host data of a single-process call, laid out as ``targets``, in one batched put."""
    if not values:
        return []
    return list(jax.device_put(values, targets))


def assemble(
    named: list[tuple[str, Any]],
    mesh: Mesh,
    specs: list[Any],
    *,
    what: str,
    tag: str,
    structure: Any = None,
) -> list[jax.Array]:
    """This process's parts of a multi-process call's arguments, as global arrays.

    One assembly for all of them (``named``: each leaf with its name in messages; ``specs``:
    its spec on ``mesh``), as `meshkit.global_array_from_local` defines the parts: along a
    dimension split across processes, the rows this process's devices hold; other dimensions
    whole. The processes compare structure, shapes and dtypes once per call through the
    coordination service (and, in debug mode, the data of blocks that several processes
    provide), and a mismatch is a `MeshkitError` naming the processes on every one of them.
    ``structure``: the arguments as messages show them, with the leaves of ``named`` in
    flattening order and None elsewhere (default: a flat list).
    """
    if not named:
        return []
    treedef = jax.tree_util.tree_structure([0] * len(named) if structure is None else structure)
    with calling(what, pads=False):
        assembly = _assembly.Assembly(
            _channel.scoped(tag, what),
            what,
            pad=False,
            check="data" if debug.enabled() else True,
            sizes_known=True,
        )
        tree, _ = assembly.run(
            lambda: _blocks.prepare_leaves(
                named,
                treedef,
                [(mesh, s) for s in specs],
                [None] * len(named),
                dtype=None,
                pad=False,
                warn_dtypes=False,  # jit narrows host data silently; so do spmd and pmap_compat
            )
        )
    return list(jax.tree_util.tree_leaves(tree))


def publish_failure(tag: str, error: BaseException) -> None:
    """Tell the processes waiting in an `assemble` under ``tag`` that this one failed first."""
    _assembly.publish_failure(_assembly.check_tag(_channel.scoped(tag, "meshkit.spmd")), error)
