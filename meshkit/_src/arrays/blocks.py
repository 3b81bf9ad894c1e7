"""Global arrays from each process's local data: `global_array_from_local`.

Each process passes the part of the global array its devices hold (`meshkit.process_slice`
says which); meshkit checks through the coordination service that the processes agree, puts one
numpy view per block on each local device, and assembles the global `jax.Array`.

Cost. A call is: a template of the layout (plans, shardings, the check's record), made on the
first call with that layout and reused while it repeats; numpy views (no host copy unless a
dtype cast or padding needs one); then, on CPU, one batched put per array (what
`jax.make_array_from_callback` ends in, without its per-device callbacks), which puts every
device's view in one call (XLA's CPU client aliases 64-byte-aligned host memory instead of
copying it, as `jax.device_put` does); on accelerators, one batched
``jax.device_put`` of the distinct blocks, one more that copies blocks to the other local
devices holding the same block (replicas, device to device, not from the host again), and
``jax.make_array_from_single_device_arrays``. The cross-process check (one small message per
process through the coordination service) runs in a helper thread while the blocks are
copied, so its latency hides behind the transfer.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core import compat as _compat
from ..core.errors import MeshkitError
from ..core.trees import broadcast_prefix
from ..sharding import layout as _layout
from ..sharding.spec_trees import align_specs, plain_specs
from ..sharding.specs import check_spec_for_mesh, dim_axes, is_spec_leaf, parse_spec

__all__ = ["DtypeWarning"]

Check = bool | Literal["data"]
_WHAT = "meshkit.global_array_from_local"


@dataclass(frozen=True)
class _Caller:
    name: str  # the public function messages name
    pads: bool  # whether it takes pad= (the fixes for an uneven batch suggest it)


_DEFAULT_CALLER = _Caller(_WHAT, pads=True)  # frozen: safe to share as the default
# Which public function messages name: global_batches sets it in its helper thread, spmd around
# its assembly of host arguments.
_caller: contextvars.ContextVar[_Caller] = contextvars.ContextVar(
    "meshkit_caller", default=_DEFAULT_CALLER
)


def who() -> str:
    """The public meshkit function the current assembly runs for, for messages."""
    return _caller.get().name


def set_caller(name: str) -> None:
    """Name ``name`` in this thread's messages (the thread's own context)."""
    _caller.set(_Caller(name, pads=True))


@contextlib.contextmanager
def calling(name: str, *, pads: bool) -> Iterator[None]:
    """Name ``name`` in the messages of assemblies inside the block; ``pads``: it takes pad=."""
    token = _caller.set(_Caller(name, pads))
    try:
        yield
    finally:
        _caller.reset(token)


class DtypeWarning(UserWarning):
    """64-bit data was narrowed to 32 bits because JAX's ``jax_enable_x64`` is off.

    Issued once per process and dtype. Pass ``dtype=`` to choose the type explicitly (no
    warning), or enable x64.
    """


_warned_dtypes: set[tuple[str, str]] = set()  # (from, to) narrowings warned of
Note = tuple[tuple[str, str], str]  # a narrowing's key and its warning's text

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
    dims: tuple[str, ...] | None  # dimension names from a spec string, for messages
    global_shape: tuple[int, ...]
    # From `prepare`, the plan over one element per block (it counts the blocks this process
    # holds); `plan_leaves` or `finish_padding` replace it by the plan of the global shape.
    plan: _layout.Plan
    rows: int  # the local leading size before padding


@dataclass
class Prepared:
    """What this process will contribute to one assembly, before any device transfer."""

    treedef: Any
    leaves: list[Leaf]
    mask_sharding: NamedSharding | None = None
    mask_rows: tuple[int, int] | None = None  # (real rows, padded rows) of the local mask
    mask_plan: _layout.Plan | None = None
    notes: list[Note] = field(default_factory=list)  # DtypeWarnings, for the caller's line
    # From a layout seen before (`prepare`'s templates): the leaves hold their final plans, and
    # the record, its summary and the replicas' places are those of the template.
    template: _Template | None = None


@dataclass(frozen=True)
class _Template:
    """What `prepare` decided for one layout without padding, kept while the layout repeats.

    A layout is everything `prepare` reads but the values: the pytree structure, each leaf's
    shape and dtype, the mesh or sharding, the spec, the global shape and the dtype asked for.
    Per leaf ``(path, sharding, dims, global shape, plan for the global shape, rows, dtype)``;
    no values (a template must not keep a batch alive).
    """

    treedef: Any
    leaves: tuple[tuple[str, NamedSharding, Any, tuple[int, ...], _layout.Plan, int, Any], ...]
    record: dict[str, Any]  # `describe(..., pad=False)`, shared: never mutated
    summary: str  # `summary(record)`
    replicas: tuple[tuple[int, Any, str, int], ...]  # `_replica_slots`
    # (path, dtype asked for or found, dtype used, dtype= given): the 64-bit narrowings, noted
    # on a call from the template as on any other (once per dtype and process).
    narrowings: tuple[tuple[str, np.dtype, np.dtype, bool], ...]


_templates: dict[Any, _Template] = {}
_MAX_TEMPLATES = 64


def tree_paths(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``([(path as messages show it, leaf), ...], treedef)``; the legacy helpers use it too."""
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
    if is_spec_leaf(spec):
        return [(mesh, spec)] * n_leaves
    spec = plain_specs(spec)  # flax's partition specs stand for their specs
    if is_spec_leaf(spec):
        return [(mesh, spec)] * n_leaves
    # A tree of specs: a prefix of local, its mappings matched by keys (one line if not).
    aligned = align_specs(spec, local, where=f"{who()}: spec", noun="local")
    return [(mesh, s) for s in broadcast_prefix(aligned, local, is_leaf=is_spec_leaf)]


@functools.lru_cache(maxsize=64)
def _processes_of(mesh: Mesh) -> frozenset[int]:
    return frozenset(int(d.process_index) for d in mesh.devices.flat)


def _check_global_mesh(mesh: Mesh) -> None:
    processes = _processes_of(mesh)
    count = jax.process_count()
    if processes != set(range(count)):
        raise MeshkitError(
            f"{who()}: the mesh {dict(mesh.shape)} holds devices of processes "
            f"{sorted(processes)}, but the program has {count} processes; a global array needs "
            "a mesh over every process's devices.\n"
            "Consider meshkit.make_mesh(...) (all devices of all processes), not a mesh of "
            "jax.local_devices()."
        )


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
        "array; "
        "global arrays hold numbers.\nConsider numpy arrays (or scalars) at every leaf, and "
        "keeping strings and other objects out of the pytree."
    )


def _cast(path: str, value: np.ndarray, dtype: Any, notes: list[Note] | None) -> np.ndarray:
    """``value`` in the dtype JAX will use; a narrowing to 32 bits is noted once per dtype.

    ``notes`` None: narrow silently, as `jax.jit` does with host arguments (`meshkit.spmd`).
    """
    wanted = value.dtype if dtype is None else np.dtype(dtype)
    target = np.dtype(jax.dtypes.canonicalize_dtype(wanted))
    if target != wanted and notes is not None:
        _note_narrowing(path, wanted, target, dtype is not None, notes)
    return value if value.dtype == target else value.astype(target)


def _note_narrowing(
    path: str, wanted: np.dtype, target: np.dtype, given: bool, notes: list[Note]
) -> None:
    """Note a narrowing to 32 bits, unless this process has shown it for this dtype already.

    Marked as shown only when `warn_notes` issues it: a call that fails after preparing (a
    check, a transfer) leaves the warning to the next call.
    """
    key = (str(wanted), str(target))
    if key not in _warned_dtypes and all(k != key for k, _ in notes):
        source = "dtype=" if given else f"the data at {path}"
        notes.append(
            (
                key,
                f"{who()}: {source} is {wanted}, but JAX's 64-bit mode is off, so the "
                f"global array is {target}. (Shown once per dtype.)\nConsider "
                f"dtype={target.name!r} to say so, or jax.config.update('jax_enable_x64', "
                "True) to keep 64 bits.",
            )
        )


def warn_notes(notes: list[Note], stacklevel: int) -> None:
    """Issue the dtype notes of an assembly as `DtypeWarning` s at the user's line, once each."""
    for key, text in notes:
        if key not in _warned_dtypes:
            _warned_dtypes.add(key)
            warnings.warn(text, DtypeWarning, stacklevel=stacklevel + 1)


def _shape_for(global_shape: Any, paths: list[str]) -> list[tuple[int, ...] | None]:
    if global_shape is None:
        return [None] * len(paths)

    def is_shape(x: Any) -> bool:
        return isinstance(x, tuple | list) and all(isinstance(s, int) for s in x)

    if is_shape(global_shape):
        if len(paths) != 1:
            raise MeshkitError(
                f"{who()}: global_shape={tuple(global_shape)} is one shape, but local holds "
                f"{len(paths)} arrays ({', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''})."
                "\nConsider a pytree of shapes with local's structure."
            )
        return [tuple(global_shape)]
    shapes = jax.tree_util.tree_leaves(global_shape, is_leaf=is_shape)
    if len(shapes) != len(paths) or not all(is_shape(s) for s in shapes):
        raise MeshkitError(
            f"{who()}: global_shape must be a shape (for a single array) or a pytree of shapes "
            f"with local's structure ({len(paths)} arrays); got {global_shape!r}."
        )
    return [tuple(s) for s in shapes]


def _block_desc(dim: int, axes: tuple[str, ...]) -> str:
    return f"{axes}" if axes else f"(dimension {dim} is not split)"


def prepare(
    local: Any,
    mesh_or_sharding: Any,
    spec: Any,
    *,
    global_shape: Any,
    dtype: Any,
    pad: bool,
) -> Prepared:
    """Check and plan this process's contribution; no communication, no device transfer.

    A layout seen before (see `_Template`) is not checked and planned again: only the values
    are taken (and cast, if the template says so).
    """
    flat, treedef = jax.tree_util.tree_flatten(local)
    key = _layout_key(flat, treedef, mesh_or_sharding, spec, global_shape, dtype, pad)
    template = _templates.get(key) if key is not None else None
    if template is not None:
        return _from_template(template, flat)
    named, treedef = tree_paths(local)
    if not named:
        raise MeshkitError(f"{who()}: local holds no arrays (an empty pytree).")
    pairs = _resolve(mesh_or_sharding, spec, local, len(named))
    shapes = _shape_for(global_shape, [p for p, _ in named])
    prepared = prepare_leaves(named, treedef, pairs, shapes, dtype=dtype, pad=pad)
    if key is not None:
        if len(_templates) >= _MAX_TEMPLATES:
            _templates.clear()  # layouts churn: start again rather than keep the oldest
        _templates[key] = _make_template(prepared, flat, dtype)
    return prepared


def _layout_key(
    flat: list[Any],
    treedef: Any,
    mesh_or_sharding: Any,
    spec: Any,
    global_shape: Any,
    dtype: Any,
    pad: bool,
) -> Any:
    """The key of `prepare`'s template for this call; None: the call is not of a cached kind.

    Cached: numpy leaves, one spec (a string, a PartitionSpec or None) with a Mesh or a
    NamedSharding, no padding, and a global shape and dtype given as hashable values. Anything
    else is checked and planned on every call.
    """
    if pad or not all(type(x) is np.ndarray for x in flat):
        return None
    if not isinstance(mesh_or_sharding, Mesh | NamedSharding):
        return None
    if not (spec is None or isinstance(spec, str | PartitionSpec)):
        return None
    if global_shape is not None and not (
        isinstance(global_shape, tuple) and all(type(s) is int for s in global_shape)
    ):
        return None
    if not (dtype is None or isinstance(dtype, str | np.dtype | type)):
        return None
    shapes = tuple((x.shape, x.dtype) for x in flat)
    x64 = bool(jax.config.jax_enable_x64)  # decides the dtypes leaves are cast to
    return (treedef, shapes, mesh_or_sharding, spec, global_shape, dtype, x64)


def _make_template(prepared: Prepared, flat: list[np.ndarray], dtype: Any) -> _Template:
    """The template of ``prepared`` (just made from the numpy leaves ``flat``), planned."""
    plan_leaves(prepared)
    record = describe(prepared, pad=False)
    leaves = tuple(
        (
            leaf.path,
            leaf.sharding,
            leaf.dims,
            leaf.global_shape,
            leaf.plan,
            leaf.rows,
            leaf.value.dtype,
        )
        for leaf in prepared.leaves
    )
    narrowings = []
    for x, leaf in zip(flat, prepared.leaves, strict=True):
        wanted = x.dtype if dtype is None else np.dtype(dtype)
        if leaf.value.dtype != wanted:
            narrowings.append((leaf.path, wanted, leaf.value.dtype, dtype is not None))
    template = _Template(
        prepared.treedef,
        leaves,
        record,
        summary(record),
        _replica_slots(prepared.leaves),
        tuple(narrowings),
    )
    prepared.template = template
    return template


def _from_template(template: _Template, flat: list[np.ndarray]) -> Prepared:
    notes: list[Note] = []
    for path, wanted, target, given in template.narrowings:
        _note_narrowing(path, wanted, target, given, notes)
    leaves = [
        Leaf(path, x if x.dtype == target else x.astype(target), sharding, dims, shape, plan, rows)
        for x, (path, sharding, dims, shape, plan, rows, target) in zip(
            flat, template.leaves, strict=True
        )
    ]
    return Prepared(template.treedef, leaves, notes=notes, template=template)


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
    """`prepare` for leaves already named and paired with their (mesh, spec-like).

    ``named`` holds ``(path, leaf)`` in the flattening order of ``treedef``; ``shapes`` the
    given global shape of each leaf (None: inferred). `meshkit.spmd` enters here with the
    host leaves of its arguments, named as its messages name them.
    """
    me = jax.process_index()
    checked_meshes: set[int] = set()
    leaves = []
    notes: list[Note] = []
    for (path, leaf), (mesh, spec_like), given in zip(named, pairs, shapes, strict=True):
        if id(mesh) not in checked_meshes:
            _check_global_mesh(mesh)
            checked_meshes.add(id(mesh))
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
        value = _cast(path, value, dtype, notes if warn_dtypes else None)
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
                fix = (
                    _pad_fix(k)
                    if d == 0
                    else f"Consider a size divisible by {k}, or a spec that does not split "
                    f"dimension {d}."
                )
                raise MeshkitError(
                    _NOT_DIVISIBLE.format(
                        what=who(), path=path, shape=value.shape, dim=d,
                        name=f" ({dims[d]!r})" if dims else "", size=size, k=k,
                        s="" if k == 1 else "s", axes=_block_desc(d, dim_axes(partition,
                        value.ndim)[d]), n=n, process=me, fix=fix,
                    )
                )  # fmt: skip
            inferred.append(-(-size // k) * n)
        shape = tuple(inferred)
        if given is not None:
            _check_given(path, value, given, shape, held, counts, pad, me)
            shape = tuple(given)
        leaves.append(
            Leaf(path, value, sharding, dims, shape, unit, value.shape[0] if value.ndim else 0)
        )
    prepared = Prepared(treedef, leaves, notes=notes)
    if pad:
        _prepare_mask(prepared)
    return prepared


def _pad_fix(k: int) -> str:
    """The fix for a local batch that does not split over this process's ``k`` blocks."""
    if _caller.get().pads:
        return (
            "Consider pad=True to pad the last, smaller batch (a mask marks the padding), or a "
            f"local batch divisible by {k}."
        )
    return (
        f"Consider a local batch divisible by {k}, or padding the last, smaller batch first: "
        "meshkit.global_array_from_local(..., pad=True) returns it padded with a mask."
    )


def _check_given(
    path: str,
    value: np.ndarray,
    given: tuple[int, ...],
    inferred: tuple[int, ...],
    held: tuple[int, ...],
    counts: tuple[int, ...],
    pad: bool,
    me: int,
) -> None:
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


def _prepare_mask(prepared: Prepared) -> None:
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
    prepared.mask_sharding = NamedSharding(first.sharding.mesh, PartitionSpec(lead or None))


def finish_padding(prepared: Prepared, block_rows: int) -> None:
    """Pad every leaf's leading dimension to ``block_rows`` per block held; plan the mask."""
    me = jax.process_index()
    for leaf in prepared.leaves:
        k = leaf.plan.local_shape[0]
        n = _layout.block_counts(leaf.sharding, leaf.value.ndim)[0]
        rows = block_rows * k
        if rows != leaf.rows:
            padded = np.zeros((rows, *leaf.value.shape[1:]), leaf.value.dtype)
            padded[: leaf.rows] = leaf.value
            leaf.value = padded
        leaf.global_shape = (block_rows * n, *leaf.global_shape[1:])
    first = prepared.leaves[0]
    prepared.mask_rows = (first.rows, first.value.shape[0])
    for leaf in prepared.leaves:
        leaf.plan = _layout.plan(leaf.sharding, leaf.global_shape, me)
    assert prepared.mask_sharding is not None
    prepared.mask_plan = _layout.plan(prepared.mask_sharding, first.global_shape[:1], me)


def block_rows(prepared: Prepared) -> int:
    first = prepared.leaves[0]
    return -(-first.rows // first.plan.local_shape[0])


def plan_leaves(prepared: Prepared) -> None:
    """Replace the unit plans by the plans for the global shapes (no padding)."""
    if prepared.template is not None:
        return  # planned when the template was made
    me = jax.process_index()
    for leaf in prepared.leaves:
        leaf.plan = _layout.plan(leaf.sharding, leaf.global_shape, me)


def describe(prepared: Prepared, *, pad: bool) -> dict[str, Any]:
    """This process's record for the cross-process comparison (JSON-serialisable).

    From a template (a layout seen before), the template's record: do not mutate it.
    """
    if prepared.template is not None and not pad:
        return prepared.template.record
    leaves = []
    for leaf in prepared.leaves:
        shape: list[Any] = list(leaf.global_shape)
        if pad and shape:
            shape[0] = "?"
        axes = [list(a) for a in dim_axes(leaf.sharding.spec, leaf.value.ndim)]
        leaves.append([leaf.path, str(leaf.value.dtype), axes, shape, list(leaf.value.shape)])
    record: dict[str, Any] = {"status": "data", "tree": str(prepared.treedef), "leaves": leaves}
    if pad:
        record["block_rows"] = block_rows(prepared)
    return record


def summary(record: dict[str, Any]) -> str:
    """What must be equal in every process: all of the record but the local shapes.

    The ``replicas`` digests are compared per replica group (`meshkit._src.coord.agree` groups),
    not here.
    """
    compared = {k: v for k, v in record.items() if k != "replicas"}
    if "leaves" in compared:
        compared["leaves"] = [leaf[:4] for leaf in compared["leaves"]]
    return json.dumps(compared, sort_keys=True)


def replica_digests(prepared: Prepared, *, full: bool) -> dict[str, tuple[int, str]]:
    """A digest of every block this process holds that other processes hold too (replicas).

    Returned as `meshkit._src.coord.agree` groups: ``"leaf path@block start"`` -> (the lowest
    process holding the block, the digest). ``full``: a CRC-32 of the whole block; otherwise of
    about `_SAMPLE` elements spread over it (a few KiB whatever the block's size). The leaves must
    hold their final plans (after `plan_leaves` or `finish_padding`).
    """
    template = prepared.template
    slots = template.replicas if template is not None else _replica_slots(prepared.leaves)
    groups: dict[str, tuple[int, str]] = {}
    for i, local_index, name, reference in slots:
        view = prepared.leaves[i].value[local_index]
        groups[name] = (reference, _digest(view) if full else _sampled_digest(view))
    return groups


def _replica_slots(leaves: list[Leaf]) -> tuple[tuple[int, Any, str, int], ...]:
    """The blocks this process holds that other processes hold too (replicas).

    ``(leaf index, local index of the block, "leaf path@block start", the lowest process
    holding the block)``, from the leaves' final plans.
    """
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


def _sampled_digest(block: np.ndarray) -> str:
    """CRC-32 of about `_SAMPLE` elements at evenly spaced positions, plus the shape."""
    size = block.size
    if size <= _SAMPLE:
        sample = np.ascontiguousarray(block)
    else:
        positions = np.linspace(0, size - 1, _SAMPLE, dtype=np.int64)
        sample = np.ascontiguousarray(block[np.unravel_index(positions, block.shape)])
    return f"{zlib.crc32(sample.reshape(-1).view(np.uint8)):08x}:{block.shape}"


def _digest(block: np.ndarray) -> str:
    # CRC-32 (zlib releases the GIL) runs at about 3 GB/s per core here, four times blake2b:
    # the check looks for loaders that went astray, not for an adversary.
    return f"{zlib.crc32(np.ascontiguousarray(block).reshape(-1).view(np.uint8)):08x}"


def _groups(values: dict[int, Any]) -> str:
    by: dict[str, list[int]] = {}
    for pid, v in sorted(values.items()):
        by.setdefault(str(v), []).append(pid)
    return "\n".join(
        f"  process{'es' if len(p) > 1 else ''} {','.join(map(str, p))}: {v}" for v, p in by.items()
    )


def raise_failures(records: dict[int, dict[str, Any]], what: str = _WHAT) -> None:
    """Raise a `MeshkitError` naming the processes that reported a failure instead of data."""
    failed = {p: r for p, r in records.items() if r.get("status") == "error"}
    if failed:
        lines = "\n".join(f"  process {p}: {r['message']}" for p, r in sorted(failed.items()))
        raise MeshkitError(
            f"{what}: process{'es' if len(failed) > 1 else ''} "
            f"{','.join(map(str, sorted(failed)))} failed before the processes compared their "
            f"data:\n{lines}\nEvery process stops here too (the program cannot go on with "
            "some processes missing)."
        )


def compare(records: dict[int, dict[str, Any]], what: str = _WHAT) -> None:
    """Raise a `MeshkitError` naming the processes and the pytree path where records differ."""
    raise_failures(records, what)
    trees = {p: r.get("tree") for p, r in records.items()}  # absent: sizes agreed already
    if len(set(trees.values())) > 1:
        raise MeshkitError(
            f"{what}: processes passed pytrees of different structure:\n{_groups(trees)}\n"
            "Every process must pass the same structure (same keys, same number of arrays).\n"
            "Consider building batches with the same code and keys on every process."
        )
    first = min(records)
    for i, leaf in enumerate(records[first].get("leaves", ())):
        path = leaf[0]
        for field_index, name in ((1, "dtype"), (2, "split"), (3, "global shape")):
            seen = {p: r["leaves"][i][field_index] for p, r in records.items()}
            if len({json.dumps(v) for v in seen.values()}) > 1:
                shown = {
                    p: f"{r['leaves'][i][1]}{r['leaves'][i][4]} (global {r['leaves'][i][3]}, "
                    f"split over {[tuple(a) for a in r['leaves'][i][2]]})"
                    for p, r in records.items()
                }
                uneven = (
                    "pass pad=True"
                    if _caller.get().pads
                    else "pad it first with meshkit.global_array_from_local(..., pad=True)"
                )
                raise MeshkitError(
                    f"{what}: processes disagree on the {name} of {path}:\n{_groups(shown)}\n"
                    "Processes must pass local arrays that fit together into one global array "
                    "(local shape = global shape / processes along each split dimension).\n"
                    f"Consider checking each process's loader; for an uneven last batch {uneven}."
                )
    if any("replicas" in r for r in records.values()):
        _compare_replicas(records, what)


def _compare_replicas(records: dict[int, dict[str, Any]], what: str) -> None:
    """Name the processes whose replicas of one block differ (``replicas``: their digests)."""
    owners: dict[str, dict[int, str]] = {}
    for p, r in sorted(records.items()):
        for name, (_, digest) in r.get("replicas", {}).items():
            owners.setdefault(name, {})[p] = digest
    for name, digests in sorted(owners.items()):
        if len(set(digests.values())) > 1:
            by: dict[str, list[int]] = {}
            for p, dg in digests.items():
                by.setdefault(dg, []).append(p)
            groups = " vs ".join(str(ps) for ps in by.values())
            path, _, start = name.rpartition("@")
            raise MeshkitError(
                f"{what}: processes {groups} hold the same block of {path} (starting at "
                f"{start}) as replicas, but passed different data for it.\n"
                "Processes in a replica group (meshkit.process_slice(...).replicas) must "
                "load identical data; consider seeding their loaders by shard_index, not by "
                "process index."
            )


def _all_from_host(prepared: Prepared) -> bool:
    """Whether every block, replicas included, goes from the host: one batched put per array.

    On CPU a device-to-device copy of a replica is a memcpy like the host one, but a host buffer
    aligned for XLA is aliased rather than copied, and `jax.make_array_from_callback` puts all
    of an array's blocks in one call (about a fifth of the overhead of a list put of the same
    views). Accelerators copy replicas device to device, faster than from pageable host memory.
    """
    return all(
        pl.device.platform == "cpu" for leaf in prepared.leaves for pl in leaf.plan.placements[:1]
    )


def _mask_value(prepared: Prepared) -> np.ndarray | None:
    """This process's padding mask (True on real rows), when `pad=True` made one."""
    if prepared.mask_plan is None or prepared.mask_rows is None:
        return None
    real, rows = prepared.mask_rows
    mask = np.zeros(rows, bool)
    mask[:real] = True
    return mask


_orders: dict[tuple[NamedSharding, tuple[int, ...]], tuple[list[Any], list[Any]]] = {}


def _put_order(plan: _layout.Plan, sharding: NamedSharding) -> tuple[list[Any], list[Any]]:
    """Local devices in the order JAX lists them, and the local index of each one's block."""
    key = (sharding, plan.global_shape)
    order = _orders.get(key)
    if order is None:
        if len(_orders) >= 512:
            _orders.clear()
        by_device = {pl.device: pl.local_index for pl in plan.placements}
        devices = list(sharding.addressable_devices_indices_map(plan.global_shape))
        order = _orders[key] = (devices, [by_device[d] for d in devices])
    return order


def _from_host(value: np.ndarray, plan: _layout.Plan, sharding: NamedSharding) -> jax.Array:
    """One global array, every local device's block put from the host view in one call."""
    devices, indices = _put_order(plan, sharding)
    blocks = [value[index] for index in indices]
    return _compat.put_blocks(plan.global_shape, value.dtype, sharding, blocks, devices)


def transfer(prepared: Prepared) -> list[jax.Array]:
    """The global array of every leaf, then the mask if any.

    On CPU every block goes from the host (`_all_from_host`); elsewhere the distinct blocks go
    from the host in one batched put and replicas are copied device to device in another.
    """
    jobs: list[tuple[np.ndarray, _layout.Plan, NamedSharding]] = [
        (leaf.value, leaf.plan, leaf.sharding) for leaf in prepared.leaves
    ]
    mask = _mask_value(prepared)
    if mask is not None and prepared.mask_plan is not None and prepared.mask_sharding is not None:
        jobs.append((mask, prepared.mask_plan, prepared.mask_sharding))
    if _all_from_host(prepared):
        return [_from_host(value, plan, sharding) for value, plan, sharding in jobs]
    views, targets, where = [], [], []
    for i, (value, plan, _) in enumerate(jobs):
        for j, pl in enumerate(plan.placements):
            if pl.first:
                views.append(value[pl.local_index])
                targets.append(pl.device)
                where.append((i, j))
    placed = jax.device_put(views, targets)
    out: list[list[Any]] = [[None] * len(plan.placements) for _, plan, _ in jobs]
    by_block: dict[tuple[int, Any], jax.Array] = {}
    for (i, j), array in zip(where, placed, strict=True):
        out[i][j] = array
        by_block[(i, repr(jobs[i][1].placements[j].global_index))] = array
    copies, copy_targets, copy_where = [], [], []
    for i, (_, plan, _) in enumerate(jobs):
        for j, pl in enumerate(plan.placements):
            if not pl.first:
                copies.append(by_block[(i, repr(pl.global_index))])
                copy_targets.append(pl.device)
                copy_where.append((i, j))
    if copies:
        for (i, j), array in zip(copy_where, jax.device_put(copies, copy_targets), strict=True):
            out[i][j] = array
    return [
        jax.make_array_from_single_device_arrays(plan.global_shape, sharding, out[i])
        for i, (_, plan, sharding) in enumerate(jobs)
    ]


def assemble(prepared: Prepared, arrays: list[jax.Array]) -> tuple[Any, jax.Array | None]:
    """The global arrays in local's pytree, and the mask (None without padding)."""
    n = len(prepared.leaves)
    mask = arrays[n] if len(arrays) > n else None
    return jax.tree_util.tree_unflatten(prepared.treedef, arrays[:n]), mask
