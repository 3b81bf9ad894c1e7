"""How `spmd` and `pmap_compat` put a call's arguments where jit takes them, decided up front.

Host data is put in one batch (across processes: this process's part, assembled and checked).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import ShapedArray, Tracer
from jax.sharding import NamedSharding

from ..arrays import assembly as _assembly
from ..arrays import blocks as _blocks
from ..arrays.records import calling
from ..coord import channel as _channel
from ..core.errors import MeshkitError
from ..debug import divergence as debug
from ..sharding.layout import ArgumentPlan


def argnums(
    value: int | Sequence[int], what: str, caller: str, *, from_end: bool = False
) -> tuple[int, ...]:
    """Argument positions as ints: sorted and unique, or (``from_end``) negative ones allowed."""
    items = (value,) if isinstance(value, int) else tuple(value)
    for i in items:
        if isinstance(i, bool) or not isinstance(i, int) or (i < 0 and not from_end):
            kind = "ints" if from_end else "non-negative ints"
            raise MeshkitError(f"{caller}: {what} must be {kind}; got {value!r}.")
    return items if from_end else tuple(sorted(set(items)))


def dynamic(args: tuple[Any, ...], static: tuple[int, ...]) -> tuple[Any, ...]:
    if not static:
        return args
    return tuple(a for i, a in enumerate(args) if i not in static)


def from_host(value: Any, target: NamedSharding) -> jax.Array:
    """Host data, the same in every process, as a global array laid out by ``target``."""
    arr = np.asarray(value)
    return jax.make_array_from_callback(arr.shape, target, lambda idx: arr[idx])


def jit_over_shard_map(
    body: Callable[..., Any], name: str, **jit_options: Any
) -> Callable[..., Any]:
    """``jax.jit(body, **jit_options)`` with ``body`` named ``name`` (for HLO dumps, profiles)."""
    body.__name__ = body.__qualname__ = name
    return jax.jit(body, **jit_options)


def is_host(leaf: Any) -> bool:
    """Host data: anything that is not a `jax.Array` (numpy, scalars, array-likes)."""
    return not isinstance(leaf, jax.Array)


def is_abstract(leaf: Any) -> bool:
    """A shape and dtype without data (what ``.lower`` may be given): never placed."""
    return isinstance(leaf, jax.ShapeDtypeStruct | ShapedArray)


def is_local(leaf: Any) -> bool:
    """Process-local: host data or an array on this process's devices only (not a tracer)."""
    return is_host(leaf) or (not isinstance(leaf, Tracer) and leaf.is_fully_addressable)


def put_host(
    plan: ArgumentPlan, leaves: list[Any], *, what: str, tag: str, treedef: Any
) -> list[Any]:
    """``leaves`` with their host data placed at the plan's targets (assembled across processes)."""
    host = [i for i, leaf in enumerate(leaves) if is_host(leaf) and not is_abstract(leaf)]
    if not host:
        return leaves
    if plan.mesh.is_multi_process:
        return assemble(plan, leaves, host, what=what, tag=tag, treedef=treedef)
    put = jax.device_put([leaves[i] for i in host], [plan.targets[i] for i in host])
    placed = dict(zip(host, put, strict=True))
    return [placed.get(i, leaf) for i, leaf in enumerate(leaves)]


def assemble(
    plan: ArgumentPlan,
    leaves: list[Any],
    chosen: list[int],
    *,
    what: str,
    tag: str,
    treedef: Any,
    specs: Sequence[Any] | None = None,
) -> list[Any]:
    """``leaves`` with the ``chosen`` ones, this process's parts, assembled into global arrays."""
    keep = set(chosen)
    structure = treedef.unflatten([leaf if i in keep else None for i, leaf in enumerate(leaves)])
    shown = list(specs) if specs is not None else [plan.targets[i].spec for i in chosen]
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
                [(plan.paths[i], leaves[i]) for i in chosen],
                jax.tree_util.tree_structure(structure),
                [(plan.mesh, s) for s in shown],
                [None] * len(chosen),
                dtype=None,
                pad=False,
                warn_dtypes=False,  # jit narrows host data silently; so do spmd and pmap_compat
            )
        )
    placed = dict(zip(chosen, jax.tree_util.tree_leaves(tree), strict=True))
    return [placed.get(i, leaf) for i, leaf in enumerate(leaves)]


@contextlib.contextmanager
def failures_published(tag: str) -> Iterator[None]:
    """Publish an error raised inside to the processes waiting in an assembly under ``tag``."""
    try:
        yield
    except Exception as e:
        tagged = _assembly.check_tag(_channel.scoped(tag, "meshkit.spmd"))
        _assembly.publish_failure(tagged, e)
        raise
