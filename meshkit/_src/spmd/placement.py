"""How `spmd` and `pmap_compat` put a call's arguments where jit takes them, decided up front.

Both keep a `Placed` per call structure: its jit and `ArgumentPlan`. A call moves each leaf to
its target (no copy where its blocks are there already) and puts host data in one batch (across
processes: this process's part, assembled and checked); once a call did, a later call whose
leaves all match the plan (one list comparison) goes straight to the jit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.core import ShapedArray, Tracer
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from ..arrays import assembly as _assembly
from ..arrays import blocks as _blocks
from ..arrays.records import calling
from ..coord import channel as _channel
from ..core.errors import MeshkitError
from ..debug import divergence as debug
from ..sharding.layout import ArgumentPlan
from ..sharding.specs import spec_axes


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


def is_local(leaf: Any) -> bool:
    """Process-local: host data or an array on this process's devices only (not a tracer)."""
    return is_host(leaf) or (not isinstance(leaf, Tracer) and leaf.is_fully_addressable)


@dataclass(eq=False)
class Placed:
    """The jit of one call structure and where its leaves go; ``steady`` once a call put them."""

    jitted: Any  # spmd over an AbstractMesh (met while tracing): None, the body runs in place
    plan: ArgumentPlan | None
    what: str
    tag: str  # of the assembly exchanges of this function's host arguments
    # Called as warn(where, had, spec, mesh) before resharding an array over several devices.
    warn: Callable[[str, str, Any, Mesh], None] | None
    steady: ArgumentPlan | None = field(default=None, init=False)  # the plan, once placed

    def place(self, leaves: list[Any], treedef: Any) -> list[Any]:
        """Every leaf at its target, host data put in one batch; the structure turns steady."""
        plan = self.plan
        assert plan is not None  # placing needs a mesh of devices
        placed = [
            self.move(leaf, target, where, plan.mesh)
            for leaf, target, where in zip(leaves, plan.targets, plan.paths, strict=True)
        ]
        abstract = jax.ShapeDtypeStruct | ShapedArray  # what ``.lower`` may be given: not placed
        host = [i for i, x in enumerate(placed) if is_host(x) and not isinstance(x, abstract)]
        if host and plan.mesh.is_multi_process:
            placed = assemble(plan, placed, host, what=self.what, tag=self.tag, treedef=treedef)
        elif host:
            put = jax.device_put([placed[i] for i in host], [plan.targets[i] for i in host])
            for i, x in zip(host, put, strict=True):
                placed[i] = x
        self.steady = plan
        return placed

    def move(self, leaf: Any, target: NamedSharding, where: str, mesh: Mesh) -> Any:
        """``leaf`` laid out as ``target``, no copy where its blocks are there; host data kept."""
        if is_host(leaf):  # put by `place`, in one batch; float0 as bool zeros, as jax.pmap
            float0 = getattr(leaf, "dtype", None) == jax.dtypes.float0
            return np.zeros(np.shape(leaf), bool) if float0 else leaf
        if leaf.sharding == target:
            return leaf
        if leaf.sharding.is_equivalent_to(target, leaf.ndim):
            if not spec_axes(jax.typeof(leaf).sharding.spec):  # no Explicit mesh axis in its type
                return leaf
            # The same blocks, typed by an Explicit mesh (shard_map refuses that type).
            shards = [s.data for s in leaf.addressable_shards]
            return jax.make_array_from_single_device_arrays(leaf.shape, target, shards)
        if mesh.is_multi_process and leaf.is_fully_addressable:
            # A process-local array (pmap_compat's output; spmd assembles these before).
            return multihost_utils.host_local_array_to_global_array(leaf, mesh, target.spec)
        if self.warn is not None and len(leaf.sharding.device_set) > 1:
            self.warn(where, f"sharding {leaf.sharding}", target.spec, mesh)
        return jax.device_put(leaf, target)


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
