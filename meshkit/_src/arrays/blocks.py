"""A process's part of a global array, prepared: checked, cast and planned, before any transfer.

A layout seen before is taken from its `Template`. Nothing here communicates or touches a device.
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core import caches as _caches
from ..core import canonical as _canonical
from ..core.errors import MeshkitError
from ..core.trees import broadcast_prefix
from ..sharding import layout as _layout
from ..sharding.specs import (
    align_specs,
    check_spec_for_mesh,
    dim_axes,
    is_spec_leaf,
    parse_spec,
    plain_specs,
)
from .records import LeafRecord, PartRecord, pads, summary, who


class DtypeWarning(UserWarning):
    """64-bit data was narrowed to 32 bits because JAX's ``jax_enable_x64`` is off.

    Issued once per process and dtype. Pass ``dtype=`` to choose the type explicitly (no
    warning), or enable x64.
    """


DtypeWarning.__module__ = "meshkit"  # shown under the name users import it by

_warned_dtypes: set[tuple[str, str]] = set()  # (from, to) narrowings warned of
Note = tuple[tuple[str, str], str]  # a narrowing's key and its warning's text


def cast(path: str, value: np.ndarray, dtype: Any, notes: list[Note] | None) -> np.ndarray:
    """``value`` in the dtype JAX will use; a narrowing is noted (``notes`` None: silently)."""
    wanted = value.dtype if dtype is None else np.dtype(dtype)
    target = np.dtype(jax.dtypes.canonicalize_dtype(wanted))
    key = (str(wanted), str(target))
    if target != wanted and notes is not None and key not in {*_warned_dtypes, *dict(notes)}:
        source = "dtype=" if dtype is not None else f"the data at {path}"
        notes.append(
            (
                key,
                f"{who()}: {source} is {wanted}, but JAX's 64-bit mode is off, so the "
                f"global array is {target}. (Shown once per dtype.)\nConsider "
                f"dtype={target.name!r} to say so, or jax.config.update('jax_enable_x64', "
                "True) to keep 64 bits.",
            )
        )
    return value if value.dtype == target else value.astype(target)


def warn_notes(notes: list[Note], stacklevel: int) -> None:
    """Issue the dtype notes of an assembly as `DtypeWarning` s at the user's line, once each."""
    for key, text in notes:
        if key not in _warned_dtypes:
            _warned_dtypes.add(key)
            warnings.warn(text, DtypeWarning, stacklevel=stacklevel + 1)


_NOT_DIVISIBLE = """\
{what}: the local array at {path} has shape {shape}; its dimension {dim}{name} has size {size},
which does not split over this process's {k} block{s} of that dimension (the mesh axes {axes}
split the global dimension {n} ways, and process {process}'s devices hold {k} of those blocks).
{fix}"""

_NOT_RECTANGULAR = """\
{what}: under the sharding {sharding}, process {process}'s devices hold blocks of {path} that do
not form a grid (block indices per dimension: {intervals}), so no single local array can hold
them.
Consider a mesh from meshkit.make_mesh (which keeps each process's devices together), or a spec
that splits fewer dimensions across processes."""


@dataclass
class Leaf:
    """One array of the local pytree, checked and planned."""

    path: str
    value: np.ndarray
    sharding: NamedSharding
    global_shape: tuple[int, ...]
    plan: _layout.Plan  # first over one element per block, then over the global shape
    rows: int  # the local leading size before padding


@dataclass
class Prepared:
    """What this process will contribute to one assembly, before any device transfer."""

    treedef: Any
    leaves: list[Leaf]
    mask: tuple[np.ndarray, _layout.Plan, NamedSharding] | None = None  # with pad, once padded
    notes: list[Note] = field(default_factory=list)  # DtypeWarnings, for the caller's line
    template: Template | None = None  # the layout was seen before: leaves planned already


@dataclass(frozen=True)
class Template:
    """One layout's planned leaves (without values), record and replica slots, kept for reuse."""

    leaves: tuple[Leaf, ...]
    record: PartRecord  # `describe(..., pad=False)`
    summary: str  # `summary` of the record
    replicas: tuple[tuple[int, Any, str, int], ...]  # `_replica_slots`


_templates: _caches.Cache[Any, Template] = _caches.Cache(maxsize=64)
_NO_VALUE = np.empty(0)  # a template keeps no batch alive


def prepare(
    local: Any, mesh_or_sharding: Any, spec: Any, *, global_shape: Any, dtype: Any, pad: bool
) -> Prepared:
    """Check and plan this process's part ``local``; a layout seen before reuses its template."""
    flat, treedef = jax.tree_util.tree_flatten(local)
    key = None  # a template's: numpy leaves, a plain spec, hashable shape and dtype, no pad
    if (
        not pad
        and all(type(x) is np.ndarray for x in flat)
        and isinstance(mesh_or_sharding, Mesh | NamedSharding)
        and (spec is None or isinstance(spec, str | PartitionSpec))
        and (global_shape is None or isinstance(global_shape, tuple))
        and all(type(s) is int for s in global_shape or ())
        and (dtype is None or isinstance(dtype, str | np.dtype | type))
    ):
        shapes = tuple((x.shape, x.dtype) for x in flat)
        x64 = bool(jax.config.jax_enable_x64)  # decides the dtypes leaves are cast to
        key = (treedef, shapes, mesh_or_sharding, spec, global_shape, dtype, x64)
    template = _templates.get(key) if key is not None else None
    if template is not None:
        notes: list[Note] = []
        leaves = [
            dataclasses.replace(leaf, value=cast(leaf.path, x, dtype, notes))
            for leaf, x in zip(template.leaves, flat, strict=True)
        ]
        return Prepared(treedef, leaves, notes=notes, template=template)
    named, treedef = tree_paths(local)
    if not named:
        raise MeshkitError(f"{who()}: local holds no arrays (an empty pytree).")
    pairs = _resolve(mesh_or_sharding, spec, local, len(named))
    shapes = _shape_for(global_shape, [p for p, _ in named])
    prepared = prepare_leaves(named, treedef, pairs, shapes, dtype=dtype, pad=pad)
    if key is not None:
        plan_leaves(prepared)
        record = describe(prepared, pad=False)
        prepared.template = Template(
            tuple(dataclasses.replace(leaf, value=_NO_VALUE) for leaf in prepared.leaves),
            record,
            summary(record.wire()),
            _replica_slots(prepared.leaves),
        )
        _templates.put(key, prepared.template)
    return prepared


def tree_paths(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``([(path as messages show it, leaf), ...], treedef)``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p) or "(the array)", leaf) for p, leaf in flat], treedef


def _resolve(mesh_or_sharding: Any, spec: Any, local: Any, n_leaves: int) -> list[Any]:
    """One (mesh, spec-like) pair per leaf."""
    if isinstance(mesh_or_sharding, NamedSharding):
        if spec is not None:
            raise MeshkitError(
                f"{who()}: spec= was given with a NamedSharding, which already holds its spec "
                f"({mesh_or_sharding.spec}).\nConsider passing the mesh and the spec, or the "
                "NamedSharding alone."
            )
        if not isinstance(mesh_or_sharding.mesh, Mesh):
            raise MeshkitError(
                f"{who()}: the NamedSharding's mesh is abstract; global arrays need a mesh of "
                "devices (a jax.sharding.Mesh, e.g. from meshkit.make_mesh)."
            )
        return [(mesh_or_sharding.mesh, mesh_or_sharding.spec)] * n_leaves
    if not isinstance(mesh_or_sharding, Mesh):
        raise MeshkitError(
            f"{who()}: mesh_or_sharding must be a jax.sharding.Mesh (with spec=) or a "
            f"NamedSharding; got {type(mesh_or_sharding).__name__}."
        )
    if spec is None:
        raise MeshkitError(
            f"{who()}: with a Mesh, spec= says how the global array is split, e.g. 'data' "
            "(leading dimension over the 'data' axis) or PartitionSpec('data', None).\n"
            "Consider spec='' (a spec with no entries) for data every process holds whole."
        )
    mesh = mesh_or_sharding
    spec = plain_specs(spec)  # flax's partition specs stand for their specs
    if is_spec_leaf(spec):
        return [(mesh, spec)] * n_leaves
    # A tree of specs: a prefix of local, its mappings matched by keys (one line if not).
    aligned = align_specs(spec, local, where=f"{who()}: spec", noun="local")
    return [(mesh, s) for s in broadcast_prefix(aligned, local, is_leaf=is_spec_leaf)]


@_caches.cached(maxsize=64)
def _processes_of(mesh: Mesh) -> frozenset[int]:
    return frozenset(int(d.process_index) for d in mesh.devices.flat)


def _as_numpy(path: str, leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array):
        if not leaf.is_fully_addressable:
            raise MeshkitError(
                f"{who()}: the leaf at {path} is already a global jax.Array "
                f"(shape {leaf.shape}, sharding {leaf.sharding}); local data is this process's "
                "part only.\nConsider using the array as it is, or meshkit.local_from_global(x) "
                "to get this process's part."
            )
        return np.asarray(leaf)
    if isinstance(leaf, bool | int | float | complex):
        value = np.asarray(leaf)
        return value.astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)
    if isinstance(leaf, np.ndarray | np.generic) or hasattr(leaf, "__array__"):
        value = np.asarray(leaf)
        if not (value.dtype == np.bool_ or jax.numpy.issubdtype(value.dtype, np.number)):
            raise MeshkitError(
                f"{who()}: the leaf at {path} is an array of dtype {value.dtype}; global arrays "
                "hold numbers or booleans.\nConsider encoding it as numbers, or keeping it out "
                "of the pytree."
            )
        return value
    shown = repr(leaf)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise MeshkitError(
        f"{who()}: the leaf at {path} is of type {type(leaf).__name__} ({shown}), not an "
        "array; global arrays hold numbers.\nConsider numpy arrays (or scalars) at every leaf, "
        "and keeping strings and other objects out of the pytree."
    )


def _shape_for(global_shape: Any, paths: list[str]) -> list[tuple[int, ...] | None]:
    if global_shape is None:
        return [None] * len(paths)

    def is_shape(x: Any) -> bool:
        return isinstance(x, tuple | list) and all(isinstance(s, int) for s in x)

    if is_shape(global_shape) and len(paths) != 1:
        raise MeshkitError(
            f"{who()}: global_shape={tuple(global_shape)} is one shape, but local holds "
            f"{len(paths)} arrays ({', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''})."
            "\nConsider a pytree of shapes with local's structure."
        )
    shapes = jax.tree_util.tree_leaves(global_shape, is_leaf=is_shape)
    if len(shapes) != len(paths) or not all(is_shape(s) for s in shapes):
        raise MeshkitError(
            f"{who()}: global_shape must be a shape (for a single array) or a pytree of shapes "
            f"with local's structure ({len(paths)} arrays); got {global_shape!r}."
        )
    return [tuple(s) for s in shapes]


def prepare_leaves(
    named: list[tuple[str, Any]],
    treedef: Any,
    pairs: list[tuple[Mesh, Any]],
    shapes: list[tuple[int, ...] | None],
    *,
    dtype: Any,
    pad: bool,
    warn_dtypes: bool = True,
) -> Prepared:
    """Check and cast ``(path, leaf)`` pairs, each with its (mesh, spec) and global shape or None.

    `meshkit.spmd` enters here with its host arguments, named as its messages name them.
    """
    me, count = jax.process_index(), jax.process_count()
    leaves = []
    notes: list[Note] = []
    for (path, leaf), (mesh, spec_like), given in zip(named, pairs, shapes, strict=True):
        processes = _processes_of(mesh)
        if len(processes) != count:
            raise MeshkitError(
                f"{who()}: the mesh {dict(mesh.shape)} holds devices of processes "
                f"{sorted(processes)}, but the program has {count} processes; a global "
                "array needs a mesh over every process's devices.\nConsider "
                "meshkit.make_mesh(...) (all devices of all processes), not a mesh of "
                "jax.local_devices()."
            )
        partition = check_spec_for_mesh(
            spec_like if spec_like is not None else PartitionSpec(), mesh, f"{who()}: spec"
        )
        value = _as_numpy(path, leaf)
        dims = parse_spec(spec_like).dims if isinstance(spec_like, str) else None
        if len(partition) > value.ndim:
            raise MeshkitError(
                f"{who()}: the spec {partition} for {path} has {len(partition)} entries, but the "
                f"array has shape {value.shape} ({value.ndim} dimensions).\n"
                "Consider one spec entry per dimension at most (missing ones are not split)."
            )
        if dims is not None and len(dims) != value.ndim:
            raise MeshkitError(
                f"{who()}: the spec string {spec_like!r} names {len(dims)} "
                f"dimension{'s' if len(dims) != 1 else ''}, but the array at {path} has shape "
                f"{value.shape} ({value.ndim} dimensions)."
            )
        value = cast(path, value, dtype, notes if warn_dtypes else None)
        sharding = NamedSharding(mesh, partition)
        counts = _layout.block_counts(sharding, value.ndim)
        unit = _layout.plan(sharding, counts, me)
        if not unit.rectangular:
            raise MeshkitError(
                _NOT_RECTANGULAR.format(
                    what=who(), sharding=sharding, process=me, path=path,
                    intervals=[[a for a, _ in ivs] for ivs in unit.intervals],
                )
            )  # fmt: skip
        held = unit.local_shape  # blocks this process holds along each dimension
        inferred = []
        for d, (size, k, n) in enumerate(zip(value.shape, held, counts, strict=True)):
            if size % k and not (pad and d == 0):
                if d:
                    fix = (
                        f"Consider a size divisible by {k}, or a spec that does not split "
                        f"dimension {d}."
                    )
                elif pads():
                    fix = (
                        "Consider pad=True to pad the last, smaller batch (a mask marks the "
                        f"padding), or a local batch divisible by {k}."
                    )
                else:
                    fix = (
                        f"Consider a local batch divisible by {k}, or padding the last, smaller "
                        "batch first: meshkit.global_array_from_local(..., pad=True) returns it "
                        "padded with a mask."
                    )
                raise MeshkitError(
                    _NOT_DIVISIBLE.format(
                        what=who(), path=path, shape=value.shape, dim=d,
                        name=f" ({dims[d]!r})" if dims else "", size=size, k=k,
                        s="" if k == 1 else "s", axes=dim_axes(partition, value.ndim)[d] or
                        f"(dimension {d} is not split)", n=n, process=me, fix=fix,
                    )
                )  # fmt: skip
            inferred.append(-(-size // k) * n)
        shape = tuple(inferred)
        if given is not None:
            _check_given(path, value, given, shape, held, counts, pad, me)
            shape = tuple(given)
        leaves.append(Leaf(path, value, sharding, shape, unit, value.shape[0] if value.ndim else 0))
    prepared = Prepared(treedef, leaves, notes=notes)
    if pad:
        _check_one_batch_layout(prepared)
    return prepared


def _check_given(
    path: str, value: np.ndarray, given: tuple[int, ...], inferred: tuple[int, ...],
    held: tuple[int, ...], counts: tuple[int, ...], pad: bool, me: int,
) -> None:  # fmt: skip
    if len(given) != value.ndim:
        raise MeshkitError(
            f"{who()}: global_shape {given} for {path} has {len(given)} dimensions, but the local "
            f"array has shape {value.shape}."
        )
    for d, (g, i, k, n) in enumerate(zip(given, inferred, held, counts, strict=True)):
        if pad and d == 0:
            if g % n or g // n * k < value.shape[0]:
                raise MeshkitError(
                    f"{who()}: global_shape {given} for {path} leaves process {me} room for "
                    f"{g // n * k if not g % n else '(not a whole number of)'} rows of its "
                    f"{value.shape[0]} (it holds {k} of the {n} blocks of dimension 0).\n"
                    f"Consider a leading size that is a multiple of {n} and at least "
                    f"{-(-value.shape[0] // k) * n}."
                )
        elif g != i:
            raise MeshkitError(
                f"{who()}: global_shape {given} for {path} does not match the local data: the "
                f"local array has shape {value.shape}, and process {me} holds {k} of the {n} "
                f"blocks of dimension {d}, so that dimension's global size is "
                f"{value.shape[d]} / {k} * {n} = {i}, not {g}.\n"
                "Consider leaving global_shape out (meshkit infers it), or passing the local "
                "data process_slice(mesh, spec, global_shape) describes."
            )


def _check_one_batch_layout(prepared: Prepared) -> None:
    first = prepared.leaves[0]
    lead = dim_axes(first.sharding.spec, max(1, first.value.ndim))[0]
    for leaf in prepared.leaves:
        if leaf.value.ndim == 0:
            raise MeshkitError(
                f"{who()}: pad=True pads the leading (batch) dimension, but {leaf.path} is a "
                "scalar.\nConsider passing scalars in a separate call."
            )
        axes = dim_axes(leaf.sharding.spec, leaf.value.ndim)[0]
        if leaf.rows != first.rows or axes != lead or leaf.sharding.mesh != first.sharding.mesh:
            raise MeshkitError(
                f"{who()}: pad=True needs every array to share the leading (batch) dimension, "
                f"split the same way, for one mask to describe them; {first.path} has "
                f"{first.rows} rows split over {lead}, {leaf.path} has {leaf.rows} rows split "
                f"over {axes}.\nConsider separate calls for arrays with different batch layouts."
            )


def plan_leaves(prepared: Prepared, rows_per_block: int | None = None) -> None:
    """Plan the leaves for their global shapes; with ``rows_per_block``, padded to it first."""
    if prepared.template is not None:
        return  # planned when the template was made
    me = jax.process_index()
    for leaf in prepared.leaves:
        if rows_per_block is not None:
            k, n = leaf.plan.local_shape[0], leaf.plan.global_shape[0]  # blocks: held, in all
            rows = rows_per_block * k
            if rows != leaf.rows:
                padded = np.zeros((rows, *leaf.value.shape[1:]), leaf.value.dtype)
                padded[: leaf.rows] = leaf.value
                leaf.value = padded
            leaf.global_shape = (rows_per_block * n, *leaf.global_shape[1:])
        leaf.plan = _layout.plan(leaf.sharding, leaf.global_shape, me)
    if rows_per_block is None:
        return
    first = prepared.leaves[0]  # the mask
    lead = dim_axes(first.sharding.spec, first.value.ndim)[0]
    sharding = NamedSharding(first.sharding.mesh, PartitionSpec(lead or None))
    real = np.arange(first.value.shape[0]) < first.rows
    prepared.mask = (real, _layout.plan(sharding, first.global_shape[:1], me), sharding)


def block_rows(prepared: Prepared) -> int:
    first = prepared.leaves[0]
    return -(-first.rows // first.plan.local_shape[0])


def describe(prepared: Prepared, *, pad: bool) -> PartRecord:
    """This process's record for the cross-process comparison (a template's, if it has one)."""
    if prepared.template is not None and not pad:
        return prepared.template.record
    rows = block_rows(prepared) if pad else None
    leaves = []
    for leaf in prepared.leaves:
        shape: list[Any] = list(leaf.global_shape)
        if pad and shape:
            shape[0] = "?"
        axes = [list(a) for a in dim_axes(leaf.sharding.spec, leaf.value.ndim)]
        leaves.append(
            LeafRecord(leaf.path, str(leaf.value.dtype), axes, shape, list(leaf.value.shape))
        )
    return PartRecord(
        tree=_canonical.structure(prepared.treedef), leaves=tuple(leaves), block_rows=rows
    )


def replica_digests(prepared: Prepared, *, full: bool) -> dict[str, tuple[int, str]]:
    """``{"path@block start": (lowest holder, digest)}`` of the blocks other processes hold too.

    ``full``: a CRC-32 of each whole block; otherwise of about `_SAMPLE` elements spread over it.
    """
    template = prepared.template
    slots = template.replicas if template is not None else _replica_slots(prepared.leaves)
    return {
        name: (holder, _digest(prepared.leaves[i].value[index], full))
        for i, index, name, holder in slots
    }


def _replica_slots(leaves: list[Leaf]) -> tuple[tuple[int, Any, str, int], ...]:
    """``(leaf index, local index, "path@block start", lowest holder)`` of each replicated block."""
    slots = []
    for i, leaf in enumerate(leaves):
        plan = leaf.plan
        holders: dict[Any, set[int]] = {}
        for device, block in plan.blocks.items():
            holders.setdefault(block, set()).add(plan.owners[device])
        for pl in plan.placements:
            block = plan.blocks[pl.device]
            if not pl.first or len(holders[block]) < 2:
                continue
            start = tuple(s.start or 0 for s in pl.global_index)
            slots.append((i, pl.local_index, f"{leaf.path}@{start}", min(holders[block])))
    return tuple(slots)


_SAMPLE = 1024  # elements a sampled replica digest reads, spread evenly over the block


def _digest(block: np.ndarray, full: bool) -> str:
    """CRC-32 (fast; for loaders gone astray, not attacks) of the block or a sample, and shape."""
    if full or block.size <= _SAMPLE:
        sample = np.ascontiguousarray(block)
    else:
        positions = np.linspace(0, block.size - 1, _SAMPLE, dtype=np.int64)
        sample = np.ascontiguousarray(block[np.unravel_index(positions, block.shape)])
    return f"{zlib.crc32(sample.reshape(-1).view(np.uint8)):08x}:{block.shape}"
