"""One compiled signature of a `pmap_compat` function: ``jax.jit(jax.shard_map(...))``.

``in_axes`` / ``out_axes`` are checked and matched to a call's leaves (messages keep
`jax.pmap`'s exception classes and key phrases). Each mapped dimension is split over a 1-D
device mesh; inside `jax.shard_map` each block loses it, so the function sees what `jax.pmap`
showed it, and outputs get it back at ``out_axes``.
"""

from __future__ import annotations

import contextvars
import warnings
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.errors import MeshkitError, MeshkitIndexError, MeshkitNameError, MeshkitTypeError
from ..core.frames import user_stacklevel
from ..core.trees import broadcast_prefix, prefix_mismatch
from ..sharding.layout import argument_plan
from ..spmd import variance as _variance
from ..spmd.placement import Placed, jit_over_shard_map

Axis = int | None

_KEYWORDS_MAPPED = (
    "Arguments passed by keyword are not compared with in_axes: each argument passed by "
    "keyword is mapped over its leading axis, as with jax.pmap."
)


def _axis_leaf(x: Any) -> bool:
    return x is None or isinstance(x, int)


def check_axes_tree(value: Any, what: str, name: str) -> None:
    """``in_axes`` / ``out_axes`` hold only ints and None (`jax.pmap`'s `TypeError` otherwise)."""
    for leaf in jax.tree_util.tree_leaves(value, is_leaf=lambda x: x is None):
        if leaf is not None and (isinstance(leaf, bool) or not isinstance(leaf, int)):
            raise MeshkitTypeError(
                f"meshkit.pmap_compat({name}): pmap {what} must be an int, None, or (nested) "
                f"container with those types as leaves, but got {value!r}.\nConsider ints (the "
                "mapped dimension) or None (an argument every device gets whole), in a tuple "
                "with one entry per positional argument."
            )


def resolve(axis: Axis, ndim: int, where: str, name: str) -> Axis:
    """A mapped axis counted like `jax.vmap` (negative from the end), checked against ``ndim``."""
    if axis is None:
        return None
    if not -ndim <= axis < ndim:
        raise MeshkitIndexError(
            f"meshkit.pmap_compat({name}): in_axes={axis} for {where}, which has rank {ndim} "
            f"(valid: {-ndim} to {ndim - 1}, or None for an argument every device gets whole)."
        )
    return axis % ndim


def call_key(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """(positional count, static values, keyword names): checked, hashable."""
    what, static = fn.what, fn.static
    n = len(args)
    if static and max(static) >= n:
        given = sorted(set(kwargs))
        raise MeshkitError(
            f"{what}: pmapped function has static_broadcasted_argnums={static} but "
            f"was called with only {n} positional argument{'s' if n != 1 else ''}"
            + (f" (and keywords {given})" if given else "")
            + ". All static broadcasted arguments must be passed positionally, as with "
            "jax.pmap."
        )
    static_vals = tuple(args[i] for i in static)
    for i, v in zip(static, static_vals, strict=True):
        try:
            hash(v)
        except TypeError:
            raise MeshkitError(
                f"{what}: Non-hashable static arguments are not supported, as this "
                f"can lead to unexpected cache-misses. Static argument (index {i}) of "
                f"type {type(v)} for function {fn.name} is non-hashable.\nThe "
                "static_broadcasted_argnums values key the compilation cache; consider a "
                "tuple instead of a list, a frozen dataclass, or passing it as an array "
                "argument."
            ) from None
    return (n, static_vals, tuple(sorted(kwargs)) if kwargs else ())


def call_layout(fn: Any, n_args: int, dyn: tuple[Any, ...], kwargs: Any) -> tuple[Any, ...]:
    """A call structure's in_axes per leaf (keywords: 0) and names, the donated leaves' indices."""
    in_axes, what = fn.in_axes, fn.what
    positions = [i for i in range(n_args) if i not in fn.static]
    if not (_axis_leaf(in_axes) or isinstance(in_axes, tuple)):
        raise MeshkitError(
            f"{what}: in_axes must be an int, None, or a tuple with one entry per "
            f"positional argument; got {type(in_axes).__name__} {in_axes!r}."
        )
    if isinstance(in_axes, tuple) and len(in_axes) != n_args:
        raise MeshkitError(
            f"{what}: in_axes is not a pytree prefix of the positional arguments: at "
            f"pmap in_axes[0], in_axes has a tuple of length {len(in_axes)} where the "
            f"arguments have a tuple of length {n_args}."
            + (f"\n{_KEYWORDS_MAPPED}" if kwargs else "")
            + "\nConsider one in_axes entry per positional argument (None for an argument "
            "every device gets whole)."
        )
    dyn_axes = tuple(in_axes[i] if isinstance(in_axes, tuple) else in_axes for i in positions)
    mismatch = prefix_mismatch(
        dyn_axes, tuple(dyn), is_leaf=_axis_leaf, path=(jax.tree_util.SequenceKey(0),)
    )
    if mismatch is not None:
        where, have, want = mismatch
        raise MeshkitError(
            f"{what}: in_axes is not a pytree prefix of the positional arguments: at "
            f"pmap in_axes{where}, in_axes has {have} where the arguments have {want}."
            + (f"\n{_KEYWORDS_MAPPED}" if kwargs else "")
            + "\nConsider one in_axes entry per positional argument: an int, None, or a "
            "pytree prefix of that argument holding them."
        )
    axes = broadcast_prefix(dyn_axes, tuple(dyn), is_leaf=_axis_leaf)
    axes += [0] * len(jax.tree_util.tree_leaves(kwargs))
    paths, donated = [], []
    for k, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path((dyn, kwargs))[0]):
        if path[0].idx == 1:  # type: ignore[attr-defined]
            paths.append(f"kwargs{jax.tree_util.keystr(path[1:])}")
            continue
        pos = positions[path[1].idx]  # type: ignore[attr-defined]
        paths.append(f"args[{pos}]{jax.tree_util.keystr(path[2:])}")
        if pos in fn.donate:
            donated.append(k)
    return axes, tuple(paths), tuple(donated)


def call(fn: Any, key: tuple[Any, ...], treedef: Any, leaves: Any) -> Any:
    """``fn``'s function on a call's flat leaves, its static arguments put back in place."""
    d_args, kw = jax.tree_util.tree_unflatten(treedef, list(leaves))
    it = iter(d_args)
    statics = dict(zip(fn.static, key[1], strict=True))
    return fn.fun(*[statics[i] if i in statics else next(it) for i in range(key[0])], **kw)


def out_spec(axis: Axis, name: str) -> PartitionSpec:
    """The spec of an output with out axis ``axis`` (negative ones are moved after shard_map)."""
    return PartitionSpec() if axis is None else PartitionSpec(*([None] * max(axis, 0)), name)


class UncheckedOutputWarning(UserWarning):
    """An ``out_axes=None`` output of a `pmap_compat` function could not be checked.

    Where the value passes through something the check cannot follow (a collective with
    ``axis_index_groups``, an ``io_callback``), device 0's value is returned, as `jax.pmap`
    does, with this warning once per function and output.
    """


# The PmapFunction whose body is being traced: a pmap_compat called inside it is nested.
TRACING: contextvars.ContextVar[Any] = contextvars.ContextVar("meshkit_pmap_tracing", default=None)


@dataclass(eq=False)
class Entry(Placed):
    """One `jax.jit` over a call's flat leaves, on one mesh, for one set of mapped axes."""

    fn: Any  # the PmapFunction
    resolved: tuple[Axis, ...]
    local_out: bool
    out_leaves: list[tuple[str, Axis]] = field(default_factory=list)  # (name, axis), traced
    checked: bool = False

    def finish(self, out: Any) -> Any:
        return jax.tree_util.tree_map(_local_view, out) if self.local_out else out

    def check_outputs(self, placed: list[Any]) -> None:
        """Once per entry: every ``out_axes=None`` output is the same on every device."""
        fn = self.fn
        if self.checked or not fn.checks_outputs:
            return
        traced = self.jitted.trace(*placed)  # jit keeps this trace for the call
        is_mapped = [r is not None for r in self.resolved]
        verdicts = _variance.shard_map_outputs(traced.jaxpr, fn.mesh_axis, is_mapped)
        self.checked = True
        if verdicts is None:
            return
        for (where, axis), verdict in zip(self.out_leaves, verdicts, strict=True):
            if axis is not None or verdict == _variance.INVARIANT:
                continue
            if verdict.level == _variance.VARYING.level:
                self.checked = False
                raise MeshkitError(
                    f"{fn.what}: out_axes=None for {where} promises the same value on every "
                    f"device, but it varies over the mapped axis {fn.axis_name!r}: it "
                    "depends on a mapped argument or the device index.\njax.pmap would have "
                    "returned device 0's value without a word. Consider reducing it first "
                    f"(jax.lax.pmean(x, {fn.axis_name!r}) or psum), or out_axes=0 to get "
                    "every device's value."
                )
            if where not in fn.warned:
                fn.warned.add(where)
                warnings.warn(
                    f"{fn.what}: out_axes=None for {where} is not checked to be the same on "
                    f"every device: {verdict.reason}, which meshkit cannot follow. Device 0's "
                    "value is returned, as jax.pmap does (this warning is shown once).\nConsider "
                    "out_axes=0 and reading entry 0 yourself, or reducing the value with "
                    "jax.lax.pmean / psum over the whole axis.",
                    UncheckedOutputWarning,
                    stacklevel=user_stacklevel(),
                )


def build(
    fn: Any, key: tuple[Any, ...], treedef: Any, leaves: list[Any], shapes: Any, tracing: bool
) -> Entry:
    """The entry of a call structure and its leaves' shapes: axes resolved, mesh chosen, jit made.

    ``shapes``: each leaf's shape and whether it is a global array (its mapped axis then counts
    every process's entries); ``tracing``: under an enclosing trace, so no input shardings.
    """
    dyn, kw = jax.tree_util.tree_unflatten(treedef, leaves)
    axes, paths, donated = call_layout(fn, key[0], dyn, kw)
    resolved = tuple(
        resolve(a, len(shape), where, fn.name)
        for (shape, _), a, where in zip(shapes, axes, paths, strict=True)
    )
    processes = jax.process_count()
    mapped = [
        (shape, r, where, shape[r] // processes if is_global else shape[r])
        for (shape, is_global), r, where in zip(shapes, resolved, paths, strict=True)
        if r is not None
    ]
    sizes = {n for *_, n in mapped}
    if len(sizes) > 1:
        rows = [
            f"  {where}: shape {shape}, mapped axis {r} of size {shape[r]}"
            for shape, r, where, _ in mapped
        ]
        raise MeshkitError(
            f"{fn.what}: the mapped arguments have different sizes along their mapped "
            "axes:\n" + "\n".join(rows) + "\nEvery mapped axis must have one entry per "
            "device; consider in_axes=None for an argument every device gets whole."
        )
    if not sizes and fn.axis_size is None:
        raise MeshkitError(
            f"{fn.what}: pmap requires at least one argument with a mapped axis.\nEvery "
            "in_axes entry is None; consider in_axes=0 for the argument with one entry per "
            "device, or axis_size= to map a function of no mapped argument."
        )
    mesh = fn._mesh(sizes.pop() if sizes else fn.axis_size, tracing and processes > 1)
    name = fn.mesh_axis
    specs = tuple(out_spec(r, name) for r in resolved)
    plan = argument_plan(mesh, specs, paths)

    def per_device(*blocks: Any) -> Any:
        local = [
            jax.lax.squeeze(b, (r,)) if r is not None else b
            for b, r in zip(blocks, resolved, strict=True)
        ]
        return _outputs_per_device(entry, call(fn, key, treedef, local))

    out_specs = jax.tree.map(lambda a: out_spec(a, name), fn.out_axes, is_leaf=lambda x: x is None)

    def body(*flat: Any) -> Any:
        entry.out_leaves.clear()
        token = TRACING.set(fn)
        try:  # shard_map runs on the context mesh: this one, whatever the caller's is
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                out = jax.shard_map(
                    per_device, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False
                )(*flat)
                return _place_outputs(entry, out, mesh)
        except NameError as e:
            if not str(e).startswith("Found an unbound axis name"):
                raise  # the user's own NameError
            axis = str(e).removeprefix("Found an unbound axis name: ").split(".")[0]
            fix = (
                f"Consider axis_name={axis!r} in pmap_compat."
                if fn.axis_name is None
                else f"Consider naming {fn.axis_name!r} in the collective."
            )
            raise MeshkitNameError(
                f"{e}\n{fn.what}: a collective names the axis {axis!r}, which is not bound "
                f"here; the function maps the axis {fn.axis_name!r}.\n{fix}"
            ) from None
        finally:
            TRACING.reset(token)

    options = {} if tracing else {"in_shardings": plan.targets}
    jitted = jit_over_shard_map(body, fn.name, donate_argnums=donated, **options)
    local_out = mesh.is_multi_process and not fn.global_outputs and not tracing
    entry = Entry(jitted, plan, fn.what, "pmap_compat", None, fn, resolved, local_out)
    return entry


def _outputs_per_device(entry: Entry, out: Any) -> Any:
    """Each output gets its mapped dimension back (size 1); names recorded for checks."""
    fn = entry.fn
    mismatch = prefix_mismatch(fn.out_axes, out, is_leaf=_axis_leaf)
    if mismatch is not None:
        where, have, want = mismatch
        raise MeshkitError(
            f"{fn.what}: out_axes = {fn.out_axes!r} is not a pytree prefix of the outputs "
            f"({jax.tree_util.tree_structure(out)}): at out_axes{where}, out_axes has {have} "
            f"where the outputs have {want}.\n"
            "Consider one entry per output (an int, None, or a pytree matching it)."
        )
    axes = broadcast_prefix(fn.out_axes, out, is_leaf=_axis_leaf)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(out)
    result = []
    for (path, leaf), axis in zip(with_path, axes, strict=True):
        where = f"output{jax.tree_util.keystr(path)}"
        leaf = jax.numpy.asarray(leaf)
        entry.out_leaves.append((f"{where} (shape {leaf.shape})", axis))
        if axis is None:
            result.append(leaf)
            continue
        ndim = leaf.ndim + 1
        if not -ndim <= axis < ndim:
            raise MeshkitIndexError(
                f"{fn.what}: out_axes={axis} for {where}, which has rank {leaf.ndim} "
                f"per device ({ndim} with the mapped axis; valid: {-ndim} to {ndim - 1})."
            )
        result.append(jax.numpy.expand_dims(leaf, max(axis, 0)))  # negative: moved later
    return jax.tree_util.tree_unflatten(treedef, result)


def _place_outputs(entry: Entry, out: Any, mesh: Mesh) -> Any:
    """Negative out_axes moved into place; every output split as `jax.pmap` returns it.

    A constraint, also where every device computed the same value; outputs fed back then pass
    `ArgumentPlan.placed` (their shardings equal the plan's targets).
    """
    leaves, treedef = jax.tree_util.tree_flatten(out)
    placed = []
    for leaf, (_, axis) in zip(leaves, entry.out_leaves, strict=True):
        if axis is not None and axis < 0:
            leaf = jax.numpy.moveaxis(leaf, 0, axis % leaf.ndim)
        dim = None if axis is None else axis % leaf.ndim
        spec = out_spec(dim, entry.fn.mesh_axis)
        placed.append(jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec)))
    return jax.tree_util.tree_unflatten(treedef, placed)


def _local_view(x: jax.Array) -> jax.Array:
    """This process's entries of a device-axis array (what `jax.pmap` returns), no copy."""
    named: Any = x.sharding  # a NamedSharding over a concrete mesh
    return multihost_utils.global_array_to_host_local_array(x, named.mesh, named.spec)
