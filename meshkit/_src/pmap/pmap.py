"""`pmap_compat`: `jax.pmap`'s interface and results, run as ``jax.jit(jax.shard_map(...))``.

Each mapped argument's mapped dimension (``in_axes``) has one entry per device. The devices form
a 1-D mesh (`meshkit._src.pmap.device_axis`), the mapped dimension is split over it, and inside
`jax.shard_map` each device's block (one entry) loses that dimension, so the function sees what
`jax.pmap` showed it. Outputs get the dimension back at ``out_axes``. By default they are what
`jax.pmap` returns in every process count: in a multi-process run, arrays of this process's
entries over its own devices; ``global_outputs=True`` gives global arrays over every device.

A call is classified before anything runs, never retried:

1. the call's structure (positional count, static values, keyword names, pytree) selects a
   cached layout: each leaf's mapped axis and name for messages;
2. if JAX is tracing (``jax.jit``, ``jax.grad``, ``jax.make_jaxpr`` around the call), the
   function is traced over this process's devices, as `jax.pmap` does;
3. otherwise, when every leaf is already an array laid out as the cached entry expects (the
   steady state: earlier outputs fed back), the entry's jit is called at once;
4. otherwise each leaf is classified (placed as needed / host data / process-local device
   array / another layout) and placed, and the entry for its mapped size is called.

An entry (one `jax.jit` over the flat leaves) is traced once per signature. Outputs promised
equal on every device (``out_axes=None``) are checked on that trace by `meshkit._src.spmd.variance`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..core import compat as _compat
from ..core.errors import MeshkitError, MeshkitIndexError, MeshkitNameError, MeshkitTypeError
from ..runtime import dispatch as _dispatch
from ..sharding.specs import spec_axes
from ..spmd import placement as _placement
from ..spmd import variance as _variance
from ..spmd.spmd import fn_name, from_host, user_stacklevel
from . import axes
from . import device_axis as _device_axis
from .stages import Lowered, Stage, signature

__all__ = ["PmapFunction", "UncheckedOutputWarning", "pmap_compat"]

_ANON_AXIS = "_pmap_compat"


class UncheckedOutputWarning(UserWarning):
    """An ``out_axes=None`` output of a `pmap_compat` function could not be checked.

    `pmap_compat` checks that such an output is the same on every device; where its value
    passes through something the check cannot follow (a collective with
    ``axis_index_groups``, an ``io_callback``, a primitive over the mapped axis it has no rule
    for) it warns once per function and output, and returns device 0's value as `jax.pmap`
    does.
    """


@dataclass
class _Entry:
    """One `jax.jit` over the flat leaves: a mesh, resolved mapped axes, tracing or not."""

    mesh: Mesh
    resolved: tuple[axes.Axis, ...]
    jitted: Any
    targets: list[NamedSharding]  # each leaf's sharding when already placed
    multi: bool  # the mesh spans processes
    paths: tuple[str, ...]  # each leaf's name in messages
    local_out: bool  # outputs become this process's entries (jax.pmap's multi-process arrays)
    out_leaves: list[tuple[str, axes.Axis]] = field(default_factory=list)  # filled while tracing
    checked: bool = False  # out_axes=None outputs analysed


class PmapFunction:
    """A function mapped over devices like `jax.pmap`; made by `meshkit.pmap_compat`."""

    def __init__(
        self,
        fun: Callable[..., Any],
        axis_name: Hashable | None,
        *,
        in_axes: Any,
        out_axes: Any,
        static_broadcasted_argnums: int | Sequence[int],
        devices: Sequence[Any] | None,
        backend: str | None,
        axis_size: int | None,
        donate_argnums: int | Sequence[int],
        global_outputs: bool,
    ) -> None:
        if not callable(fun):
            raise MeshkitTypeError(
                f"meshkit.pmap_compat: Expected a callable value, got {fun!r}.\n"
                "Consider passing the per-device function first, or using pmap_compat as a "
                "decorator."
            )
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.name = name = fn_name(fun)
        if axis_name is not None and not isinstance(axis_name, str):
            raise MeshkitTypeError(
                f"meshkit.pmap_compat({name}): axis_name must be a string (or None); got "
                f"{axis_name!r}.\nMesh axes are named by strings; consider axis_name='batch'."
            )
        self.axis_name = axis_name
        self.mesh_axis = axis_name if axis_name is not None else _ANON_AXIS
        if isinstance(in_axes, list):
            in_axes = tuple(in_axes)
        axes.check_axes_tree(in_axes, "in_axes", name)
        axes.check_axes_tree(out_axes, "out_axes", name)
        self.in_axes = in_axes
        self.out_axes = out_axes
        # Every out_axes entry is None or non-negative: each output's sharding is known before
        # tracing (negative ones depend on the output's rank).
        self._out_axes_fixed = all(
            a is None or a >= 0
            for a in jax.tree_util.tree_leaves(out_axes, is_leaf=lambda x: x is None)
        )
        self._checks_outputs = any(
            a is None for a in jax.tree_util.tree_leaves(out_axes, is_leaf=lambda x: x is None)
        )
        self.static = axes.argnums(static_broadcasted_argnums, "static_broadcasted_argnums", name)
        self.donate = axes.argnums(donate_argnums, "donate_argnums", name)
        both = set(self.static) & set(self.donate)
        if both:
            raise MeshkitError(
                f"meshkit.pmap_compat({name}): argument(s) {sorted(both)} are both static and "
                "donated; a static argument is a Python value, it has no buffer to donate."
            )
        if axis_size is not None and (
            isinstance(axis_size, bool) or not isinstance(axis_size, int) or axis_size < 1
        ):
            raise MeshkitError(
                f"meshkit.pmap_compat({name}): axis_size must be a positive int; got {axis_size!r}."
            )
        self.axis_size = axis_size
        if devices is not None and backend is not None:
            raise MeshkitError(
                f"meshkit.pmap_compat({name}): give devices= or backend=, not both (as jax.pmap)."
            )
        if devices is not None and not list(devices):
            raise MeshkitError(
                f"meshkit.pmap_compat({name}): 'devices' argument to pmap must be non-empty, or "
                "None.\nConsider devices=None (every device of every process) or a list such "
                "as jax.local_devices()."
            )
        self.devices = list(devices) if devices is not None else None
        self.backend = backend
        self.global_outputs = bool(global_outputs)
        self._layouts: dict[Any, axes.Layout] = {}
        self._entries: dict[Any, _Entry] = {}
        # Per structure of the arguments (calls without keywords or statics): the entry the
        # last call used, for the steady-state test of the next.
        self._steady: dict[Any, _Entry] = {}
        self._warned: set[str] = set()
        self._site = _dispatch.CallSite(
            "pmap_compat",
            name,
            info={
                "axis_name": axis_name,
                "params": _dispatch.param_names(fun),
                "origin": _dispatch.origin(fun),
                "static_argnums": self.static,
            },
        )

    # ---- calls ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _dispatch.enter(self._site, args)
        if not (kwargs or self.static):
            # The steady state of a loop: no keywords or statics, every leaf already placed
            # as the entry of this structure expects, nothing tracing. Each step here shows in
            # the per-call time, so this path does only what deciding needs.
            leaves, treedef = jax.tree_util.tree_flatten(args)
            entry = self._steady.get(treedef)
            if entry is not None and _compat.idle() and _placement.placed(leaves, entry.targets):
                out = entry.jitted(*leaves)
                return jax.tree_util.tree_map(_process_local, out) if entry.local_out else out
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        outer = _TRACING.get()
        if outer is not None and outer is not self:
            return self._nested(args, kwargs)
        key = axes.call_key(args, kwargs, self.static, self._what, self.name)
        leaves, treedef = jax.tree_util.tree_flatten((self._dyn(args), kwargs))
        entry, placed = self._classify(key, treedef, leaves)
        if not (kwargs or self.static) and _compat.idle():
            self._steady[jax.tree_util.tree_structure(args)] = entry
        with _mesh_context(entry.mesh):
            self._check_outputs(entry, placed)
            return self._finish(entry.jitted(*placed), entry)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a method decorator: ``self`` becomes the first argument, as with `jax.pmap`."""
        if obj is None:
            return self
        return functools.partial(self, obj)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower for these arguments, like ``jax.pmap(f).lower``: ``.as_text()``, ``.compile()``.

        The compiled function takes the same arguments as this one (static ones may be left
        out, as with `jax.jit`) and returns the same outputs.
        """
        key = axes.call_key(args, kwargs, self.static, self._what, self.name)
        leaves, treedef = jax.tree_util.tree_flatten((self._dyn(args), kwargs))
        entry, placed = self._classify(key, treedef, leaves)
        with _mesh_context(entry.mesh):
            self._check_outputs(entry, placed)
            lowered = entry.jitted.lower(*placed)
        stage = Stage(
            what=self._what,
            static=self.static,
            key=key,
            treedef=treedef,
            paths=entry.paths,
            given=signature(leaves),
            dynamic=self._dyn,
            place=functools.partial(self._place, entry=entry),
            finish=functools.partial(self._finish, entry=entry),
        )
        return Lowered(stage, lowered)

    @property
    def calls(self) -> int:
        """How many times this function has been called in this process."""
        return self._site.calls

    def __repr__(self) -> str:
        return f"<meshkit.pmap_compat {self.name} axis_name={self.axis_name!r}>"

    @property
    def _what(self) -> str:
        return f"meshkit.pmap_compat({self.name})"

    # ---- classification ---------------------------------------------------------------------

    def _dyn(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.static:
            return args
        return tuple(a for i, a in enumerate(args) if i not in self.static)

    def _classify(
        self, key: tuple[Any, ...], treedef: Any, leaves: list[Any]
    ) -> tuple[_Entry, list[Any]]:
        """The entry for this call and its leaves placed for it (the call's slow path)."""
        dyn, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        layout = self._layouts.get((key, treedef))
        if layout is None:
            layout = axes.layout(
                self.in_axes, self.static, self.donate, key[0], dyn, kwargs, self._what
            )
            self._layouts[(key, treedef)] = layout
        resolved = tuple(
            axes.resolve(a, np.ndim(leaf), where, "in_axes", self.name)
            for leaf, a, where in zip(leaves, layout.axes, layout.paths, strict=True)
        )
        tracing = not _compat.trace_state_clean()
        processes = jax.process_count()
        sizes = {
            _local_size(leaf, r, processes)
            for leaf, r in zip(leaves, resolved, strict=True)
            if r is not None
        }
        if len(sizes) > 1:
            raise MeshkitError(self._mapped_size_error(leaves, resolved, layout.paths))
        if sizes:
            size = sizes.pop()
        elif self.axis_size is not None:
            size = self.axis_size
        else:
            raise MeshkitError(
                f"{self._what}: pmap requires at least one argument with a mapped axis.\nEvery "
                "in_axes entry is None; consider in_axes=0 for the argument with one entry per "
                "device, or axis_size= to map a function of no mapped argument."
            )
        mesh = self._mesh(size, tracing and processes > 1)
        entry_key = (key, treedef, resolved, mesh, tracing)
        entry = self._entries.get(entry_key)
        if entry is None:
            entry = self._entries[entry_key] = self._entry(
                key, treedef, layout, resolved, mesh, tracing
            )
        if tracing:
            return entry, leaves
        return entry, self._place(leaves, entry, treedef)

    def _place(self, leaves: list[Any], entry: _Entry, treedef: Any = None) -> list[Any]:
        """Every leaf placed for ``entry`` (`meshkit._src.spmd.placement`'s classes).

        Host data goes in one batch: in one process a batched put (jit would place it too, but
        it traces a numpy argument and a placed array separately); across processes it is this
        process's entries, assembled with the others' as `meshkit.global_array_from_local`
        does, with its check that the processes' structure, shapes and dtypes agree.
        """
        placed = [
            self._put(leaf, r, target, entry)
            for leaf, r, target in zip(leaves, entry.resolved, entry.targets, strict=True)
        ]
        host = [
            i
            for i, leaf in enumerate(placed)
            if _placement.is_host(leaf) and not _placement.is_abstract(leaf)
        ]
        if not host:
            return placed
        across = jax.process_count() > 1
        values = [_host_value(placed[i], across) for i in host]
        targets = [entry.targets[i] for i in host]
        if entry.multi:
            structure = None
            if treedef is not None:
                keep = set(host)
                structure = jax.tree_util.tree_unflatten(
                    treedef, [v if i in keep else None for i, v in enumerate(placed)]
                )
            values = _placement.assemble(
                [(entry.paths[i], v) for i, v in zip(host, values, strict=True)],
                entry.mesh,
                [t.spec for t in targets],
                what=self._what,
                tag="pmap_compat",
                structure=structure,
            )
        else:
            values = _placement.put_host(values, targets)
        for i, value in zip(host, values, strict=True):
            placed[i] = value
        return placed

    def _put(self, leaf: Any, r: axes.Axis, target: NamedSharding, entry: _Entry) -> Any:
        """One leaf, placed for ``entry``'s mesh (no copy where the data is already there)."""
        mesh = entry.mesh
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
            if entry.multi and leaf.is_fully_addressable:
                # A process-local array: jax.pmap's output, or this function's own.
                again = _device_axis.from_local_array(leaf, mesh, r)
                if again is not None:
                    return again
                if r is None:
                    return from_host(np.asarray(leaf), target)
                return _device_axis.from_local(leaf, mesh, r)
            return jax.device_put(leaf, target)
        return leaf  # host data: placed with the others by _place

    # ---- meshes -----------------------------------------------------------------------------

    def _pool(self) -> list[Any]:
        """The devices this function may map over (all of them, or devices=/backend=)."""
        if self.devices is not None:
            return self.devices
        return list(jax.devices(self.backend) if self.backend else jax.devices())

    def _mesh(self, per_process: int, local_only: bool) -> Mesh:
        """The mesh for ``per_process`` entries in each process.

        ``local_only``: traced inside a transformation in a multi-process run, where `jax.pmap`
        maps over this process's devices only.
        """
        pool = self._pool()
        me = jax.process_index()
        mine = [d for d in pool if d.process_index == me]
        if local_only:
            if per_process == len(pool):  # a global array traced by an enclosing jit
                return _device_axis.device_mesh(pool, self.mesh_axis, what=self._what)
            if per_process > len(mine):
                raise MeshkitError(self._size_error(per_process, len(mine), "on this process"))
            chosen = sorted(mine, key=lambda d: d.id)[:per_process]
            return _device_axis.device_mesh(chosen, self.mesh_axis, what=self._what)
        if self.devices is not None:
            # jax.pmap maps entry i to devices[i] (in one process; across processes meshkit
            # orders them by process so that each process's entries are contiguous).
            mesh = _device_axis.device_mesh(pool, self.mesh_axis, what=self._what, keep_order=True)
            local = len(_device_axis.local_devices(mesh))
            if per_process != local:
                raise MeshkitError(self._size_error(per_process, local, "given in devices="))
            return mesh
        if per_process > len(mine):
            raise MeshkitError(self._size_error(per_process, len(mine), "on this process"))
        if per_process == len(mine):
            return _device_axis.device_mesh(pool, self.mesh_axis, what=self._what)
        # Fewer entries than devices: the first n devices of each process, as jax.pmap did.
        by_process: dict[int, list[Any]] = {}
        for d in sorted(pool, key=lambda d: (d.process_index, d.id)):
            by_process.setdefault(d.process_index, []).append(d)
        chosen = [d for ds in by_process.values() for d in ds[:per_process]]
        return _device_axis.device_mesh(chosen, self.mesh_axis, what=self._what)

    def _size_error(self, n: int, have: int, where: str) -> str:
        return (
            f"{self._what}: the mapped axis has size {n}, which requires {n} devices, but only "
            f"{have} {'is' if have == 1 else 'are'} available {where} (jax.local_devices(): "
            f"{jax.local_device_count()}).\nEach process maps one entry per local device; "
            "consider a mapped size of at most the local device count (meshkit.shard(batch) "
            "reshapes a batch that way)."
        )

    def _mapped_size_error(
        self, leaves: list[Any], resolved: tuple[axes.Axis, ...], paths: tuple[str, ...]
    ) -> str:
        rows = []
        for leaf, r, where in zip(leaves, resolved, paths, strict=True):
            if r is not None:
                n = np.shape(leaf)[r]
                rows.append(
                    f"  {where}: shape {tuple(np.shape(leaf))}, mapped axis {r} of size {n}"
                )
        return (
            f"{self._what}: the mapped arguments have different sizes along their mapped "
            "axes:\n" + "\n".join(rows) + "\nEvery mapped axis must have one entry per "
            "device; consider in_axes=None for an argument every device gets whole."
        )

    # ---- the compiled function --------------------------------------------------------------

    def _entry(
        self,
        key: tuple[Any, ...],
        treedef: Any,
        layout: axes.Layout,
        resolved: tuple[axes.Axis, ...],
        mesh: Mesh,
        tracing: bool,
    ) -> _Entry:
        name = self.mesh_axis
        specs = tuple(
            _device_axis.mapped_spec(r, name) if r is not None else PartitionSpec()
            for r in resolved
        )
        # One NamedSharding object per spec, shared by the inputs' targets and the outputs'
        # out_shardings: outputs fed back then carry the very objects the steady-state test
        # compares with, and the comparison stops at identity.
        by_spec: dict[PartitionSpec, NamedSharding] = {}

        def sharding(spec: PartitionSpec) -> NamedSharding:
            return by_spec.setdefault(spec, NamedSharding(mesh, spec))

        targets = [sharding(s) for s in specs]
        statics = dict(zip(self.static, key[1], strict=True))
        n_args = key[0]
        entry: _Entry

        def per_device(*blocks: Any) -> Any:
            local = [
                jax.lax.squeeze(b, (r,)) if r is not None else b
                for b, r in zip(blocks, resolved, strict=True)
            ]
            d_args, kw = jax.tree_util.tree_unflatten(treedef, local)
            it = iter(d_args)
            full = [statics[i] if i in statics else next(it) for i in range(n_args)]
            return self._outputs_per_device(self.fun(*full, **kw), entry)

        out_specs = axes.prefix_map(self.out_axes, lambda a: axes.out_spec(a, name))

        def body(*flat: Any) -> Any:
            entry.out_leaves.clear()
            token = _TRACING.set(self)
            try:
                out = jax.shard_map(
                    per_device, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False
                )(*flat)
            except NameError as e:
                if not str(e).startswith("Found an unbound axis name"):
                    raise  # the user's own NameError
                raise MeshkitNameError(f"{e}\n{self._unbound_axis_help(str(e))}") from None
            finally:
                _TRACING.reset(token)
            return self._place_outputs(out, mesh, constrain=out_shardings is None)

        body.__name__ = body.__qualname__ = self.name
        # Outputs split over the devices as jax.pmap returns them, even when every device
        # computed the same value (an unmapped input returned with out_axes=0): jit's
        # out_shardings where the out_axes fix them (cheaper per call), else a constraint.
        out_shardings = None
        if not tracing and self._out_axes_fixed:
            out_shardings = axes.prefix_map(
                self.out_axes, lambda a: sharding(axes.out_spec(a, name))
            )
        if tracing:
            jitted = jax.jit(body, donate_argnums=layout.donated)
        elif out_shardings is not None:
            jitted = jax.jit(
                body,
                in_shardings=targets,
                out_shardings=out_shardings,
                donate_argnums=layout.donated,
            )
        else:
            jitted = jax.jit(body, in_shardings=targets, donate_argnums=layout.donated)
        multi = mesh.is_multi_process
        local_out = multi and not self.global_outputs and not tracing
        entry = _Entry(mesh, resolved, jitted, targets, multi, layout.paths, local_out)
        return entry

    def _unbound_axis_help(self, message: str) -> str:
        axis = message.removeprefix("Found an unbound axis name: ").split(".")[0]
        fix = (
            f"Consider axis_name={axis!r} in pmap_compat."
            if self.axis_name is None
            else f"Consider naming {self.axis_name!r} in the collective."
        )
        return (
            f"{self._what}: a collective names the axis {axis!r}, which is not bound here; the "
            f"function maps the axis {self.axis_name!r}.\n{fix}"
        )

    def _outputs_per_device(self, out: Any, entry: _Entry) -> Any:
        """Each output gets its mapped dimension back (size 1); names recorded for checks."""
        with_path, treedef = jax.tree_util.tree_flatten_with_path(out)
        out_axes = axes.axes_per_output(self.out_axes, out, self.name)
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
                    f"{self._what}: out_axes={axis} for {where}, which has rank {leaf.ndim} "
                    f"per device ({ndim} with the mapped axis; valid: {-ndim} to {ndim - 1})."
                )
            at = axis if axis >= 0 else 0  # negative: moved into place after shard_map
            result.append(jax.numpy.expand_dims(leaf, at))
        return jax.tree_util.tree_unflatten(treedef, result)

    def _place_outputs(self, out: Any, mesh: Mesh, *, constrain: bool) -> Any:
        """Negative out_axes moved into place; ``constrain``: each laid out as promised."""
        leaves, treedef = jax.tree_util.tree_flatten(out)
        out_axes = axes.axes_per_output(self.out_axes, out, self.name)
        name = self.mesh_axis
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

    def _check_outputs(self, entry: _Entry, placed: list[Any]) -> None:
        """Once per entry: every ``out_axes=None`` output is the same on every device."""
        if entry.checked or not self._checks_outputs:
            return
        traced = entry.jitted.trace(*placed)  # jit keeps this trace for the call
        mapped = [r is not None for r in entry.resolved]
        verdicts = _variance.shard_map_outputs(traced.jaxpr, self.mesh_axis, mapped)
        entry.checked = True
        if verdicts is None:
            return
        for (where, axis), verdict in zip(entry.out_leaves, verdicts, strict=True):
            if axis is not None or verdict == _variance.INVARIANT:
                continue
            if verdict.level == _variance.VARYING.level:
                entry.checked = False
                raise MeshkitError(
                    f"{self._what}: out_axes=None for {where} promises the same value on every "
                    f"device, but it varies over the mapped axis {self.axis_name!r}: it depends "
                    "on a mapped argument or the device index.\njax.pmap would have returned "
                    "device 0's value without a word. Consider reducing it first "
                    f"(jax.lax.pmean(x, {self.axis_name!r}) or psum), or out_axes=0 to get every "
                    "device's value."
                )
            if where not in self._warned:
                self._warned.add(where)
                warnings.warn(
                    f"{self._what}: out_axes=None for {where} is not checked to be the same on "
                    f"every device: {verdict.reason}, which meshkit cannot follow. Device 0's "
                    "value is returned, as jax.pmap does (this warning is shown once).\nConsider "
                    "out_axes=0 and reading entry 0 yourself, or reducing the value with "
                    "jax.lax.pmean / psum over the whole axis.",
                    UncheckedOutputWarning,
                    stacklevel=user_stacklevel(),
                )

    def _finish(self, out: Any, entry: _Entry) -> Any:
        if not entry.local_out:
            return out
        return jax.tree_util.tree_map(_process_local, out)

    # ---- nested -----------------------------------------------------------------------------

    def _nested(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called while an enclosing pmap_compat traces: mapped on each of its devices by vmap.

        Old nested pmaps split devices between the two axes; today `jax.pmap` refuses them. The
        inner axis runs vectorized on each device of the outer one, so collectives over either
        axis or both compute what the old nesting computed.
        """
        outer = _TRACING.get()
        if outer is not None and outer.mesh_axis == self.mesh_axis:
            raise MeshkitError(
                f"{self._what}: called inside a pmap_compat over the same axis name "
                f"{self.mesh_axis!r}; nested pmaps need different axis names."
            )
        key = axes.call_key(args, kwargs, self.static, self._what, self.name)
        n_args = key[0]
        statics = dict(zip(self.static, key[1], strict=True))
        positions = [i for i in range(n_args) if i not in self.static]
        in_axes = axes.in_axes_for(self.in_axes, n_args, kwargs, self._what)

        def dyn_fun(*dyn: Any, **kw: Any) -> Any:
            it = iter(dyn)
            return self.fun(
                *[statics[i] if i in statics else next(it) for i in range(n_args)], **kw
            )

        mapped = jax.vmap(
            dyn_fun,
            in_axes=tuple(in_axes[i] for i in positions),
            out_axes=self.out_axes,
            axis_name=self.mesh_axis,
            axis_size=self.axis_size,
        )
        return mapped(*self._dyn(args), **kwargs)


_TRACING: contextvars.ContextVar[PmapFunction | None] = contextvars.ContextVar(
    "meshkit_pmap_tracing", default=None
)


def _mesh_context(mesh: Mesh) -> contextlib.AbstractContextManager[Any]:
    """``jax.set_mesh(mesh)`` when another mesh is the context, else nothing.

    Under ``jax.set_mesh`` (or traced inside another mesh's jit) shard_map must run on the
    context's mesh: this function's mesh becomes the context for the call.
    """
    context = jax.sharding.get_abstract_mesh()
    if context.empty or context == mesh.abstract_mesh:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def _host_value(leaf: Any, across_processes: bool) -> Any:
    """Host data as it is placed: float0 (no device type) as bool zeros across processes."""
    if not across_processes:
        return leaf
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


def _local_size(leaf: Any, axis: int, processes: int) -> int:
    """The mapped size this process contributes: global arrays count every process's entries."""
    n = int(np.shape(leaf)[axis])
    if (
        isinstance(leaf, jax.Array)
        and not isinstance(leaf, Tracer)
        and not leaf.is_fully_addressable
    ):
        return n // processes
    return n


def _process_local(x: Any) -> Any:
    """``jax.pmap``'s multi-process output: this process's entries only (no copy)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
    mapped = [d for d, e in enumerate(spec) if e is not None]
    if mapped:
        return _device_axis.local_view(x, mapped[0])
    # Replicated (out_axes=None): the same value on each local device, as jax.pmap returns it.
    mesh: Mesh = x.sharding.mesh  # type: ignore[attr-defined]
    mine = _device_axis.local_devices(mesh)
    local = _device_axis.device_mesh(mine, mesh.axis_names[0])
    by_device = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(local, PartitionSpec()), [by_device[d] for d in mine]
    )


def pmap_compat(
    fun: Callable[..., Any] | None = None,
    axis_name: Hashable | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    static_broadcasted_argnums: int | Sequence[int] = (),
    devices: Sequence[Any] | None = None,
    backend: str | None = None,
    axis_size: int | None = None,
    donate_argnums: int | Sequence[int] = (),
    global_outputs: bool = False,
) -> Any:
    """`jax.pmap`'s interface and results on mesh sharding: ``jax.jit(jax.shard_map(...))``.

    Old pmap code runs by changing ``jax.pmap`` to ``meshkit.pmap_compat``: arguments carry one
    entry per local device along their mapped axis (``in_axes``), named-axis collectives
    (``jax.lax.psum(x, axis_name)``, `meshkit.collectives`) span every device of every process,
    and outputs are what `jax.pmap` returns, in one process and in several: in a multi-process
    run each process gets arrays of its own entries over its own devices, so host reads
    (``np.asarray(out)``, ``jax.device_get(out)``, ``out[0]``) give what they gave. Differences
    from `jax.pmap`, all on the side of safety:

    * ``out_axes=None`` checks that the value is the same on every device (on the traced
      program, once per signature) instead of returning device 0's value; where the check
      cannot follow the value it warns (`UncheckedOutputWarning`);
    * negative ``in_axes`` / ``out_axes`` count from the end, as in `jax.vmap`;
    * errors name the argument, its shape, the mapped axis and the device count (with the same
      exception classes and key phrases as `jax.pmap`'s);
    * a nested ``pmap_compat`` runs vectorized on each device of the outer axis;
    * ``global_outputs=True`` (opt-in) returns global arrays over every device of every process
      instead, which a later `jax.jit`, `meshkit.gather` or a checkpointer sees whole.

    Args:
        fun: the per-device function. Omit it to use ``pmap_compat`` as a decorator (also with
            `functools.partial`, and on methods with ``static_broadcasted_argnums=(0,)``).
        axis_name: the name collectives use for the mapped axis (a string), or None.
        in_axes: which axis of each positional argument is mapped: an int, None (every device
            gets the whole argument), or a tuple with one entry (int, None or pytree prefix)
            per positional argument. Keyword arguments are mapped on axis 0.
        out_axes: where the device axis goes in each output: an int, None (the output must be
            the same on every device), or a pytree prefix of the outputs.
        static_broadcasted_argnums: positional arguments passed as Python values (hashable),
            compiled into the function.
        devices: the devices to map over (default: every device of every process). The mapped
            size must then equal this process's share of them.
        backend: the platform whose devices to use (``"cpu"``, ``"gpu"``, ``"tpu"``).
        axis_size: the mapped size when no argument is mapped.
        donate_argnums: positional arguments whose buffers may be reused for the outputs.
        global_outputs: in a multi-process run, return global arrays over every device (see
            above) instead of `jax.pmap`'s per-process arrays. No effect in one process.

    Returns:
        A `PmapFunction`: call it like the original; ``.lower(*args)`` lowers it, and the
        lowered function's ``.compile()`` is called with the same arguments.

    Raises:
        MeshkitError: a mapped size larger than the local device count or differing between
            arguments; ``in_axes`` not a prefix of the arguments; static arguments passed by
            keyword or unhashable; ``out_axes=None`` on a value that varies across devices.
            `MeshkitTypeError` (also a `TypeError`), `MeshkitIndexError` (an `IndexError`) and
            `MeshkitNameError` (a `NameError`) where `jax.pmap` raises those classes.

    Examples:
        >>> import jax, numpy as np, meshkit
        >>> n = jax.local_device_count()
        >>> @meshkit.pmap_compat(axis_name="batch")
        ... def normalize(x):
        ...     return x / jax.lax.psum(x.sum(), "batch")
        >>> out = normalize(np.ones((n, 2), np.float32))
        >>> out.shape == (n, 2), float(out.sum())
        (True, 1.0)
        >>> total = meshkit.pmap_compat(lambda x: jax.lax.psum(x, "i"), "i", out_axes=None)
        >>> total(np.arange(n, dtype=np.float32)).tolist() == float(n * (n - 1) / 2)
        True
    """

    def wrap(f: Callable[..., Any]) -> PmapFunction:
        return PmapFunction(
            f,
            axis_name,
            in_axes=in_axes,
            out_axes=out_axes,
            static_broadcasted_argnums=static_broadcasted_argnums,
            devices=devices,
            backend=backend,
            axis_size=axis_size,
            donate_argnums=donate_argnums,
            global_outputs=global_outputs,
        )

    return wrap if fun is None else wrap(fun)
