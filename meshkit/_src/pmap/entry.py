"""One compiled signature of a `pmap_compat` function: its jit over shard_map, placement, outputs.

An `Entry` is one `jax.jit` over the call's flat leaves, with the `ArgumentPlan` of where each
goes (`meshkit._src.sharding.argument_plan`, shared with `spmd`): each mapped leaf's mapped
dimension is split over a 1-D device mesh, and inside `jax.shard_map` each device's block loses
that dimension, so the function sees what `jax.pmap` showed it; outputs get it back at
``out_axes``. The entry places a call's leaves (`Entry.place`: device-axis conversions without
copies where the data is already on the right devices, host data through
`meshkit._src.spmd.placement`), checks once that outputs promised equal on every device are
(`Entry.check_outputs`, by `meshkit._src.spmd.variance`), and turns outputs into what
`jax.pmap` returns (`Entry.finish`). A `Lowered` holds these callables, never the function.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from ..core.errors import MeshkitError, MeshkitIndexError, MeshkitNameError
from ..core.frames import user_stacklevel
from ..sharding.argument_plan import ArgumentPlan, argument_plan
from ..sharding.specs import spec_axes
from ..spmd import placement as _placement
from ..spmd import variance as _variance
from ..spmd.placement import from_host, jit_over_shard_map
from . import axes
from . import device_axis as _device_axis

__all__ = [
    "TRACING",
    "Entry",
    "Mapped",
    "UncheckedOutputWarning",
    "build",
    "mesh_context",
    "process_local",
]


class UncheckedOutputWarning(UserWarning):
    """An ``out_axes=None`` output of a `pmap_compat` function could not be checked.

    `pmap_compat` checks that such an output is the same on every device; where its value
    passes through something the check cannot follow (a collective with
    ``axis_index_groups``, an ``io_callback``, a primitive over the mapped axis it has no rule
    for) it warns once per function and output, and returns device 0's value as `jax.pmap`
    does.
    """


@dataclass(frozen=True, eq=False)
class Mapped:
    """What a `pmap_compat` function fixes once, as its entries compile and name it.

    Attributes:
        fun: the per-device function.
        name: its name in messages; ``what``: the call messages name.
        axis_name: the axis name the user gave (None for none); ``mesh_axis``: the mesh's.
        out_axes: as given.
        static: positions of the static arguments.
        global_outputs: return global arrays in a multi-process run.
        out_axes_fixed: every out_axes entry is None or non-negative, so each output's
            sharding is known before tracing (negative ones depend on the output's rank).
        checks_outputs: some output is promised the same on every device (out_axes=None).
        warned: the outputs already warned about (`UncheckedOutputWarning`, once each).
    """

    fun: Callable[..., Any]
    name: str
    what: str
    axis_name: Hashable | None
    mesh_axis: str
    out_axes: Any
    static: tuple[int, ...]
    global_outputs: bool
    out_axes_fixed: bool
    checks_outputs: bool
    warned: set[str] = field(default_factory=set)


# The function whose body is being traced: a pmap_compat called inside it is nested.
TRACING: contextvars.ContextVar[Mapped | None] = contextvars.ContextVar(
    "meshkit_pmap_tracing", default=None
)


@dataclass(eq=False)
class Entry:
    """One `jax.jit` over the flat leaves: a mesh, resolved mapped axes, tracing or not.

    Attributes:
        mapped: the function's settings.
        plan: where each leaf goes on the entry's mesh, and its name in messages.
        jitted: ``jax.jit`` over the body that runs `jax.shard_map`.
        resolved: each leaf's mapped axis (non-negative) or None.
        local_out: outputs become this process's entries (jax.pmap's multi-process arrays).
        out_leaves: each output's name and out axis, filled while tracing.
        checked: the out_axes=None outputs have been analysed.
    """

    mapped: Mapped
    plan: ArgumentPlan
    jitted: Any
    resolved: tuple[axes.Axis, ...]
    local_out: bool
    out_leaves: list[tuple[str, axes.Axis]] = field(default_factory=list)
    checked: bool = False

    def place(self, leaves: list[Any], treedef: Any = None) -> list[Any]:
        """Every leaf placed for this entry (`meshkit._src.spmd.placement`'s classes).

        Arrays are converted to the entry's device axis; host data goes in one batch through
        `meshkit._src.spmd.placement.put_host`: across processes it is this process's entries,
        assembled with the others' as `meshkit.global_array_from_local` does, with its check
        that the processes' structure, shapes and dtypes agree. ``treedef``: the leaves'
        structure, for messages.
        """
        plan = self.plan
        placed = [
            self.put(leaf, r, target)
            for leaf, r, target in zip(leaves, self.resolved, plan.targets, strict=True)
        ]
        if jax.process_count() > 1:
            placed = [
                _host_value(leaf)
                if _placement.is_host(leaf) and not _placement.is_abstract(leaf)
                else leaf
                for leaf in placed
            ]
        what = self.mapped.what
        return _placement.put_host(plan, placed, what=what, tag="pmap_compat", treedef=treedef)

    def put(self, leaf: Any, r: axes.Axis, target: NamedSharding) -> Any:
        """One leaf, placed for this entry's mesh (no copy where the data is already there)."""
        mesh = self.plan.mesh
        if _placement.is_abstract(leaf):
            return leaf  # lowering for shapes only (ShapeDtypeStruct, ShapedArray)
        if isinstance(leaf, jax.Array):
            sharding = leaf.sharding
            if sharding == target:
                return leaf
            if sharding.is_equivalent_to(target, leaf.ndim):
                if not _explicitly_typed(leaf):
                    return leaf
                # The same blocks, typed by an Explicit mesh (shard_map refuses that type).
                shards = [s.data for s in leaf.addressable_shards]
                return jax.make_array_from_single_device_arrays(leaf.shape, target, shards)
            if r is not None:
                again = _device_axis.rewrap(leaf, mesh, r)
                if again is not None:
                    return again
            if mesh.is_multi_process and leaf.is_fully_addressable:
                # A process-local array: jax.pmap's output, or this function's own.
                again = _device_axis.from_local_array(leaf, mesh, r)
                if again is not None:
                    return again
                if r is None:
                    return from_host(np.asarray(leaf), target)
                return _device_axis.from_local(leaf, mesh, r)
            return jax.device_put(leaf, target)
        return leaf  # host data: placed with the others by `place`

    def finish(self, out: Any) -> Any:
        """The jit's outputs as the pmapped function returns them."""
        if not self.local_out:
            return out
        return jax.tree_util.tree_map(process_local, out)

    def check_outputs(self, placed: list[Any]) -> None:
        """Once per entry: every ``out_axes=None`` output is the same on every device."""
        mapped = self.mapped
        if self.checked or not mapped.checks_outputs:
            return
        traced = self.jitted.trace(*placed)  # jit keeps this trace for the call
        is_mapped = [r is not None for r in self.resolved]
        verdicts = _variance.shard_map_outputs(traced.jaxpr, mapped.mesh_axis, is_mapped)
        self.checked = True
        if verdicts is None:
            return
        for (where, axis), verdict in zip(self.out_leaves, verdicts, strict=True):
            if axis is not None or verdict == _variance.INVARIANT:
                continue
            if verdict.level == _variance.VARYING.level:
                self.checked = False
                raise MeshkitError(
                    f"{mapped.what}: out_axes=None for {where} promises the same value on every "
                    f"device, but it varies over the mapped axis {mapped.axis_name!r}: it "
                    "depends on a mapped argument or the device index.\njax.pmap would have "
                    "returned device 0's value without a word. Consider reducing it first "
                    f"(jax.lax.pmean(x, {mapped.axis_name!r}) or psum), or out_axes=0 to get "
                    "every device's value."
                )
            if where not in mapped.warned:
                mapped.warned.add(where)
                warnings.warn(
                    f"{mapped.what}: out_axes=None for {where} is not checked to be the same on "
                    f"every device: {verdict.reason}, which meshkit cannot follow. Device 0's "
                    "value is returned, as jax.pmap does (this warning is shown once).\nConsider "
                    "out_axes=0 and reading entry 0 yourself, or reducing the value with "
                    "jax.lax.pmean / psum over the whole axis.",
                    UncheckedOutputWarning,
                    stacklevel=user_stacklevel(),
                )


def build(
    mapped: Mapped,
    key: tuple[Any, ...],
    treedef: Any,
    layout: axes.Layout,
    resolved: tuple[axes.Axis, ...],
    mesh: Mesh,
    tracing: bool,
) -> Entry:
    """The entry for one call structure (``key``, ``treedef``) on ``mesh``.

    ``layout``: the leaves' mapped axes and names; ``resolved``: their mapped axes for this
    call's ranks; ``tracing``: the call is traced by an enclosing transformation (no
    shardings: the enclosing jit places).
    """
    name = mapped.mesh_axis
    specs = tuple(
        _device_axis.mapped_spec(r, name) if r is not None else PartitionSpec() for r in resolved
    )
    # The outputs' out_shardings are the plan's objects where the specs match: outputs fed
    # back then carry the very objects the steady-state test compares with.
    plan = argument_plan(mesh, specs, layout.paths)
    sharding = plan.sharding
    statics = dict(zip(mapped.static, key[1], strict=True))
    n_args = key[0]
    entry: Entry

    def per_device(*blocks: Any) -> Any:
        local = [
            jax.lax.squeeze(b, (r,)) if r is not None else b
            for b, r in zip(blocks, resolved, strict=True)
        ]
        d_args, kw = jax.tree_util.tree_unflatten(treedef, local)
        it = iter(d_args)
        full = [statics[i] if i in statics else next(it) for i in range(n_args)]
        return _outputs_per_device(mapped, mapped.fun(*full, **kw), entry)

    out_specs = axes.prefix_map(mapped.out_axes, lambda a: axes.out_spec(a, name))

    def body(*flat: Any) -> Any:
        entry.out_leaves.clear()
        token = TRACING.set(mapped)
        try:
            out = jax.shard_map(
                per_device, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False
            )(*flat)
        except NameError as e:
            if not str(e).startswith("Found an unbound axis name"):
                raise  # the user's own NameError
            raise MeshkitNameError(f"{e}\n{_unbound_axis_help(mapped, str(e))}") from None
        finally:
            TRACING.reset(token)
        return _place_outputs(mapped, out, mesh, constrain=out_shardings is None)

    # Outputs split over the devices as jax.pmap returns them, even when every device
    # computed the same value (an unmapped input returned with out_axes=0): jit's
    # out_shardings where the out_axes fix them (cheaper per call), else a constraint.
    out_shardings = None
    if not tracing and mapped.out_axes_fixed:
        out_shardings = axes.prefix_map(mapped.out_axes, lambda a: sharding(axes.out_spec(a, name)))
    options: dict[str, Any] = {"donate_argnums": layout.donated}
    if not tracing:
        options["in_shardings"] = plan.targets
        if out_shardings is not None:
            options["out_shardings"] = out_shardings
    jitted = jit_over_shard_map(body, mapped.name, **options)
    local_out = mesh.is_multi_process and not mapped.global_outputs and not tracing
    entry = Entry(mapped, plan, jitted, resolved, local_out)
    return entry


def _unbound_axis_help(mapped: Mapped, message: str) -> str:
    axis = message.removeprefix("Found an unbound axis name: ").split(".")[0]
    fix = (
        f"Consider axis_name={axis!r} in pmap_compat."
        if mapped.axis_name is None
        else f"Consider naming {mapped.axis_name!r} in the collective."
    )
    return (
        f"{mapped.what}: a collective names the axis {axis!r}, which is not bound here; the "
        f"function maps the axis {mapped.axis_name!r}.\n{fix}"
    )


def _outputs_per_device(mapped: Mapped, out: Any, entry: Entry) -> Any:
    """Each output gets its mapped dimension back (size 1); names recorded for checks."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(out)
    out_axes = axes.axes_per_output(mapped.out_axes, out, mapped.name)
    result = []
    for (path, leaf), axis in zip(with_path, out_axes, strict=True):
        where = f"output{jax.tree_util.keystr(path)}"
        leaf = jax.numpy.asarray(leaf)
        entry.out_leaves.append((f"{where} (shape {leaf.shape})", axis))
        if axis is None:
            result.append(leaf)
            continue
        ndim = leaf.ndim + 1
        if not -ndim <= axis < ndim:
            raise MeshkitIndexError(
                f"{mapped.what}: out_axes={axis} for {where}, which has rank {leaf.ndim} "
                f"per device ({ndim} with the mapped axis; valid: {-ndim} to {ndim - 1})."
            )
        at = axis if axis >= 0 else 0  # negative: moved into place after shard_map
        result.append(jax.numpy.expand_dims(leaf, at))
    return jax.tree_util.tree_unflatten(treedef, result)


def _place_outputs(mapped: Mapped, out: Any, mesh: Mesh, *, constrain: bool) -> Any:
    """Negative out_axes moved into place; ``constrain``: each laid out as promised."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    out_axes = axes.axes_per_output(mapped.out_axes, out, mapped.name)
    name = mapped.mesh_axis
    placed = []
    for leaf, axis in zip(leaves, out_axes, strict=True):
        if axis is not None and axis < 0:
            leaf = jax.numpy.moveaxis(leaf, 0, axis % leaf.ndim)
        spec = (
            _device_axis.mapped_spec(axis % leaf.ndim, name)
            if axis is not None
            else PartitionSpec()
        )
        if constrain:
            leaf = jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))
        placed.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, placed)


def mesh_context(mesh: Mesh | AbstractMesh) -> contextlib.AbstractContextManager[Any]:
    """``jax.set_mesh(mesh)`` when another mesh is the context, else nothing.

    Under ``jax.set_mesh`` (or traced inside another mesh's jit) shard_map must run on the
    context's mesh: this function's mesh becomes the context for the call.
    """
    assert isinstance(mesh, Mesh)  # an entry's mesh is made of devices
    context = jax.sharding.get_abstract_mesh()
    if context.empty or context == mesh.abstract_mesh:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def _host_value(leaf: Any) -> Any:
    """Host data as it is placed across processes: float0 (no device type) as bool zeros."""
    value = np.asarray(leaf)
    if value.dtype == jax.dtypes.float0:
        return np.zeros(value.shape, bool)  # as jax.pmap does across processes
    return value


def _explicitly_typed(x: Any) -> bool:
    """Whether ``x``'s type carries a sharding over Explicit mesh axes (shard_map rejects it)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or not spec_axes(sharding.spec):
        return False
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def process_local(x: Any) -> Any:
    """``jax.pmap``'s multi-process output: this process's entries only (no copy)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
    mapped = [d for d, e in enumerate(spec) if e is not None]
    return _device_axis.local_view(x, mapped[0] if mapped else None)
