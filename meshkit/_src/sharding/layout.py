"""Which blocks of a global array each process provides, and where they sit in its local array.

A process's local array is, along each dimension, the distinct ranges its devices hold, in
increasing order, concatenated (docs/data-pipelines.md). `global_array_from_local`,
`local_from_global`, `gather` and `process_slice` all follow the cached `plan`. `spmd` and
`pmap_compat` place a call's leaves by an `ArgumentPlan`.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core import caches as _caches
from ..core.errors import MeshkitError
from ..core.frames import public
from .specs import SpecLike, check_spec_for_mesh, dim_axes, layout_problem

Interval = tuple[int, int]
Block = tuple[Interval, ...]


@dataclass(frozen=True)
class Placement:
    """One device's block: where it sits in the global array and in the process's local one."""

    device: Any
    global_index: tuple[slice, ...]
    local_index: tuple[slice, ...]
    first: bool  # the first of this process's devices holding this block (replicas repeat it)


@dataclass(frozen=True)
class Plan:
    """The layout of one (sharding, global shape) for one process."""

    process: int
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    intervals: tuple[tuple[Interval, ...], ...]  # per dim, this process's distinct ranges
    placements: tuple[Placement, ...]
    rectangular: bool  # the blocks held form a grid (a dense local array can hold them)
    blocks: dict[Any, Block]  # every device of the sharding -> its block
    owners: dict[Any, int]  # every device of the sharding -> its process


def block_counts(sharding: NamedSharding, ndim: int) -> tuple[int, ...]:
    sizes = dict(sharding.mesh.shape)
    return tuple(math.prod(sizes[a] for a in axes) for axes in dim_axes(sharding.spec, ndim))


def plan_from_blocks(blocks: dict[Any, Block], shape: Sequence[int], process: int) -> Plan:
    """Lay out ``process``'s blocks into its local array, in ``blocks``' (JAX's) device order."""
    shape = tuple(int(s) for s in shape)
    owners = {d: int(d.process_index) for d in blocks}
    mine = [(d, b) for d, b in blocks.items() if owners[d] == process]
    intervals = tuple(tuple(sorted({b[i] for _, b in mine})) for i in range(len(shape)))
    # Per dimension, where each interval starts in the local array.
    starts = [
        dict(zip(ivs, itertools.accumulate((b - a for a, b in ivs), initial=0), strict=False))
        for ivs in intervals
    ]
    seen: set[Block] = set()
    placements = []
    for device, block in mine:
        local = tuple(
            slice(starts[i][iv], starts[i][iv] + iv[1] - iv[0]) for i, iv in enumerate(block)
        )
        placements.append(
            Placement(device, tuple(slice(*iv) for iv in block), local, block not in seen)
        )
        seen.add(block)
    local_shape = tuple(sum(b - a for a, b in ivs) for ivs in intervals)
    rectangular = len(seen) == math.prod(map(len, intervals))
    return Plan(
        process, shape, local_shape, intervals, tuple(placements), rectangular, blocks, owners
    )


@_caches.cached(maxsize=512)
def plan(sharding: jax.sharding.Sharding, shape: tuple[int, ...], process: int) -> Plan:
    blocks = {
        d: tuple(i.indices(n)[:2] for i, n in zip(at, shape, strict=True))
        for d, at in sharding.devices_indices_map(tuple(shape)).items()
    }
    return plan_from_blocks(blocks, shape, process)


@dataclass(frozen=True, eq=False)
class ArgumentPlan:
    """Each leaf of one call structure: its target sharding (equal specs share one object), name."""

    mesh: Mesh
    targets: tuple[NamedSharding, ...]
    paths: tuple[str, ...]
    shardings: list[Any] = field(init=False, repr=False)  # the last placed call's (`placed`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shardings", list(self.targets))

    def placed(self, leaves: Sequence[Any]) -> bool:
        """Whether every leaf is an array laid out as its target already: one list comparison.

        The shardings of a call that passes replace equal ones, so the next compares by identity.
        """
        try:  # host data and tracers have no sharding
            now = [leaf.sharding for leaf in leaves]
        except AttributeError:
            return False
        if now != self.shardings:
            return False
        self.shardings[:] = now
        return True


@_caches.cached(maxsize=256)
def argument_plan(
    mesh: Mesh, specs: tuple[PartitionSpec, ...], paths: tuple[str, ...]
) -> ArgumentPlan:
    by_spec: dict[PartitionSpec, NamedSharding] = {}
    targets = tuple(by_spec.setdefault(s, NamedSharding(mesh, s)) for s in specs)
    return ArgumentPlan(mesh, targets, paths)


def merged(intervals: Sequence[Interval]) -> tuple[Interval, ...]:
    """Sorted intervals with touching ones joined: ``[(0, 4), (4, 8), (12, 16)]`` -> two."""
    out: list[list[int]] = []
    for a, b in intervals:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


@dataclass(frozen=True)
class ProcessSlice:
    """Which part of a global array one process provides (`meshkit.process_slice`).

    Attributes:
        process: the process this describes.
        global_shape: the global array's shape.
        local_shape: the shape of its local array for `meshkit.global_array_from_local`.
        ranges: per dimension, the ``(start, stop)`` ranges of global indices it provides, in
            increasing order; the local array is their concatenation.
        shard_index: the shard of the dataset's rows this process loads, out of
            ``shard_count``; processes of one replica group share it.
        shard_count: the number of distinct row sets processes provide.
        replicas: the processes that provide exactly the same data as this one, itself included.
    """

    process: int
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    shard_index: int
    shard_count: int
    replicas: tuple[int, ...]

    @property
    def index(self) -> tuple[slice, ...]:
        """The local block as one slice per dimension, when every dimension is one range.

        Raises:
            MeshkitError: the layout is non-contiguous; use ``ranges`` or ``take``.
        """
        if any(len(r) != 1 for r in self.ranges):
            raise MeshkitError(
                f"ProcessSlice.index: process {self.process} provides non-contiguous ranges "
                f"{[list(r) for r in self.ranges]}, which one slice per dimension cannot "
                "express.\nConsider ProcessSlice.ranges, or ProcessSlice.take(global_value)."
            )
        return tuple(slice(r[0][0], r[0][1]) for r in self.ranges)

    @public
    def take(self, global_value: Any) -> np.ndarray:
        """Cut this process's local array out of the whole global value (a numpy array-like).

        Examples:
            >>> import numpy as np, meshkit
            >>> mesh = meshkit.make_mesh({"data": -1})
            >>> part = meshkit.process_slice(mesh, "data", (16, 3))
            >>> part.take(np.arange(48).reshape(16, 3)).shape  # one process holds it all
            (16, 3)
        """
        value = np.asarray(global_value)
        if value.shape != self.global_shape:
            raise MeshkitError(
                f"ProcessSlice.take: the value has shape {value.shape}, but this slice is of a "
                f"global array of shape {self.global_shape}."
            )
        index = [np.concatenate([np.arange(a, b) for a, b in r]) for r in self.ranges]
        return value[np.ix_(*index)] if index else value.copy()


@public
def process_slice(
    mesh: Mesh,
    spec: SpecLike,
    global_shape: Sequence[int],
    *,
    process: int | None = None,
) -> ProcessSlice:
    """Which index ranges of a global array a process must provide, and how a loader shards.

    Args:
        mesh: the mesh the global array will live on.
        spec: how it is sharded: a `jax.sharding.PartitionSpec` or a spec string.
        global_shape: the global array's shape.
        process: which process to describe (default: this one).

    Returns:
        A `ProcessSlice`: its ``ranges`` (per dimension), ``local_shape``, the
        data-loader pair ``(shard_index, shard_count)`` for the leading dimension, and the
        processes of its replica group.

    Raises:
        MeshkitError: the spec names an axis the mesh lacks, is longer than the shape, or a
            dimension does not split evenly; ``process`` is out of range.

    Examples:
        >>> import meshkit
        >>> mesh = meshkit.make_mesh({"data": -1, "model": 2})
        >>> part = meshkit.process_slice(mesh, "data _", (64, 10))
        >>> part.ranges, part.shard_index, part.shard_count  # one process: all of it
        ((((0, 64),), ((0, 10),)), 0, 1)
    """
    what = "meshkit.process_slice"
    try:
        if isinstance(global_shape, str | bytes):
            raise TypeError
        shape = tuple(operator.index(s) for s in global_shape)
    except TypeError:
        raise MeshkitError(
            f"{what}: global_shape must be a tuple of ints; got {global_shape!r}."
        ) from None
    if any(s < 0 for s in shape):
        raise MeshkitError(f"{what}: global_shape {shape} has a negative size.")
    partition = check_spec_for_mesh(spec, mesh, f"{what}: spec")
    found = layout_problem(shape, partition, dict(mesh.shape))
    if found is not None:
        rule, fix = found
        raise MeshkitError(f"{what}: spec {partition}, global shape {shape}: {rule}.\n{fix}")
    processes = sorted({int(d.process_index) for d in mesh.devices.flat})
    me = jax.process_index() if process is None else process
    if me not in processes:
        raise MeshkitError(
            f"{what}: process={me} holds no device of the mesh; its processes are {processes}."
        )
    return describe_plan(plan(NamedSharding(mesh, partition), shape, me))


def describe_plan(p: Plan) -> ProcessSlice:
    processes = sorted(set(p.owners.values()))
    held = {q: sorted({b for d, b in p.blocks.items() if p.owners[d] == q}) for q in processes}
    rows = {q: tuple(sorted({b[0] for b in held[q]})) if p.global_shape else () for q in processes}
    row_sets = sorted(set(rows.values()))
    mine = held[p.process]
    return ProcessSlice(
        process=p.process,
        global_shape=p.global_shape,
        local_shape=p.local_shape,
        ranges=tuple(merged(ivs) for ivs in p.intervals),
        shard_index=row_sets.index(rows[p.process]),
        shard_count=len(row_sets),
        replicas=tuple(q for q in processes if held[q] == mine),
    )
