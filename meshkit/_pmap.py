"""`pmap_compat`: `jax.pmap`'s interface, run as ``jax.jit(jax.shard_map(...))`` over a mesh.

Each mapped argument's mapped dimension (``in_axes``) has one entry per device. The devices form
a 1-D mesh (`meshkit._device_axis`), the mapped dimension is split over it, and inside
`jax.shard_map` each device's block (one entry) loses that dimension, so the function sees what
`jax.pmap` showed it. Outputs get the dimension back at ``out_axes``, as global arrays over the
same mesh: a single process gets exactly `jax.pmap`'s arrays; several processes get arrays a
downstream `jax.jit` sees whole (or, with ``global_outputs=False``, `jax.pmap`'s process-local
arrays).

Steady state. A call looks up the compiled entry of its static arguments and keyword names, and
calls one `jax.jit` whose ``in_shardings`` put the mapped dimensions on the mesh: arrays already
there (earlier outputs) take JAX's C++ fast path, and host data in a single process is placed
by jit itself. When jit refuses the arguments (single-device arrays, another layout, a mapped
size below the device count), or in a multi-process run with host data, the arguments are
placed here one by one and the call is made again.
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import _compat, _device_axis, _dispatch
from ._errors import MeshkitError
from ._specs import spec_axes
from ._spmd import fn_name, from_host

__all__ = ["PmapFunction", "pmap_compat"]

_ANON_AXIS = "_pmap_compat"
Axis = int | None


def _check_axes_tree(value: Any, what: str, name: str) -> None:
    for leaf in jax.tree_util.tree_leaves(value, is_leaf=lambda x: x is None):
        if leaf is not None and (isinstance(leaf, bool) or not isinstance(leaf, int)):
            raise MeshkitError(
                f"meshkit.pmap_compat({name}): {what} must be ints or None (or pytree prefixes "
                f"of the arguments holding them); got {value!r}."
            )


def _axes_per_leaf(axes: Any, tree: Any, what: str, name: str) -> list[Axis]:
    """One axis (or None) per leaf of ``tree``, from the pytree prefix ``axes``."""
    if axes is None or isinstance(axes, int):
        return [axes] * len(jax.tree_util.tree_leaves(tree))
    out: list[Axis] = []
    try:
        jax.tree_util.tree_map(
            lambda ax, sub: out.extend([ax] * len(jax.tree_util.tree_leaves(sub))),
            axes, tree, is_leaf=lambda x: x is None,
        )  # fmt: skip
    except ValueError as e:
        raise MeshkitError(
            f"meshkit.pmap_compat({name}): {what} = {axes!r} is not a pytree prefix of the "
            f"arguments ({jax.tree_util.tree_structure(tree)}): {e}\n"
            "Consider one entry per argument (an int, None, or a pytree matching it)."
        ) from None
    return out


def _resolve(axis: Axis, ndim: int, where: str, what: str, name: str) -> Axis:
    """A mapped axis counted like `jax.vmap` (negative from the end), checked against ``ndim``."""
    if axis is None:
        return None
    if not -ndim <= axis < ndim:
        raise MeshkitError(
            f"meshkit.pmap_compat({name}): {what}={axis} for {where}, which has rank {ndim} "
            f"(valid: {-ndim} to {ndim - 1}, or None for an argument every device gets whole)."
        )
    return axis % ndim


@dataclass
class _Entry:
    """What one (static arguments, keyword names, device count) compiles to."""

    mesh: Mesh
    jitted: Any  # jax.jit of the body; in_shardings set when every in_axes is non-negative
    fast: bool  # in_shardings are set: jit may be called with arguments as they come


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
            raise MeshkitError(f"meshkit.pmap_compat: expected a function; got {fun!r}.")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.name = name = fn_name(fun)
        if axis_name is not None and not isinstance(axis_name, str):
            raise MeshkitError(
                f"meshkit.pmap_compat({name}): axis_name must be a string (or None); got "
                f"{axis_name!r}.\nMesh axes are named by strings; consider axis_name='batch'."
            )
        self.axis_name = axis_name
        self.mesh_axis = axis_name if axis_name is not None else _ANON_AXIS
        if isinstance(in_axes, list):
            in_axes = tuple(in_axes)
        _check_axes_tree(in_axes, "in_axes", name)
        _check_axes_tree(out_axes, "out_axes", name)
        self.in_axes = in_axes
        self.out_axes = out_axes
        self.static = _argnums(static_broadcasted_argnums, "static_broadcasted_argnums", name)
        self.donate = _argnums(donate_argnums, "donate_argnums", name)
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
        self.devices = list(devices) if devices is not None else None
        self.backend = backend
        self.global_outputs = bool(global_outputs)
        self._entries: dict[Any, _Entry] = {}
        # (argument count, jitted function) of the single-process steady state, once seen.
        self._fast: tuple[int, Any] | None = None
        # Per call key: (inner axis name, inner mapped size) once a nested pmap_compat is met.
        self._nesting: dict[Any, tuple[str, int]] = {}
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
        fast = self._fast
        if (
            fast is not None
            and not kwargs
            and len(args) == fast[0]
            and _TRACING.get() is None
            and jax.sharding.get_abstract_mesh().empty
        ):
            # The steady state: one process, no static arguments or keywords, nothing nested.
            # Every Python step here shows in the per-call time, so the lookups are skipped.
            try:
                return fast[1](*args, _NO_KWARGS)
            except MeshkitError:
                raise
            except (ValueError, _Retype):
                pass  # the general path places the arguments
        return self._run(args, kwargs, lower=False)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Lower for these arguments, like ``jax.pmap(f).lower``: ``.as_text()``, ``.compile()``."""
        return self._run(args, kwargs, lower=True)

    @property
    def calls(self) -> int:
        """How many times this function has been called in this process."""
        return self._site.calls

    def __repr__(self) -> str:
        return f"<meshkit.pmap_compat {self.name} axis_name={self.axis_name!r}>"

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        n = len(args)
        missing = [i for i in self.static if i >= n]
        if missing:
            given = sorted(set(kwargs))
            raise MeshkitError(
                f"{self._what}: static_broadcasted_argnums={self.static} but the function was "
                f"called with {n} positional argument{'s' if n != 1 else ''}"
                + (f" (and keywords {given})" if given else "")
                + ".\nStatic broadcasted arguments must be passed positionally, as with "
                "jax.pmap."
            )
        static_vals = tuple(args[i] for i in self.static)
        try:
            hash(static_vals)
        except TypeError:
            bad = next(i for i in self.static if not _hashable(args[i]))
            raise MeshkitError(
                f"{self._what}: static argument {bad} is of unhashable type "
                f"{type(args[bad]).__name__}; static_broadcasted_argnums values key the "
                "compilation cache.\nConsider a tuple instead of a list, or a frozen dataclass, "
                "or passing it as an array argument."
            ) from None
        return (n, static_vals, tuple(sorted(kwargs)))

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, lower: bool) -> Any:
        outer = _TRACING.get()
        if outer is not None and outer.fn is not self:
            return self._nested_call(outer, args, kwargs)
        try:
            return self._run_here(args, kwargs, lower=lower)
        except _NestedFound as found:
            # A pmap_compat inside this one: run again on a 2-D mesh (this axis, then its).
            key = self._key(args, kwargs)
            self._nesting[key] = (found.axis, found.size)
            for k in [k for k in self._entries if k[0] == key]:
                del self._entries[k]
            self._fast = None
            return self._run_here(args, kwargs, lower=lower)

    def _nested_call(self, outer: _Tracing, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called while an enclosing pmap_compat traces: a shard_map over this inner axis."""
        key = self._key(args, kwargs)
        n_args = len(args)
        dyn_positions, dyn_axes = self._dynamic(n_args)
        statics = dict(zip(self.static, key[1], strict=True))
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static)
        mesh = outer.mesh
        if mesh.axis_names == (self.mesh_axis,):
            raise MeshkitError(
                f"{self._what}: called inside a pmap_compat over the same axis name "
                f"{self.mesh_axis!r}; nested pmaps need different axis names."
            )
        if self.mesh_axis not in mesh.axis_names:
            leaves = jax.tree_util.tree_leaves((dyn, kwargs))
            axes = self._leaf_axes(dyn_axes, dyn, kwargs)
            sizes = [int(np.shape(x)[a % np.ndim(x)]) for x, a in zip(leaves, axes, strict=True)
                     if a is not None]  # fmt: skip
            size = sizes[0] if sizes else (self.axis_size or 1)
            raise _NestedFound(self.mesh_axis, size)
        return self._body(mesh, dyn_positions, dyn_axes, statics, n_args, dyn, kwargs, inner=True)

    def _run_here(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, lower: bool) -> Any:
        context = jax.sharding.get_abstract_mesh()
        if not context.empty:
            # Under jax.set_mesh (or traced inside another mesh's jit) shard_map must run on
            # the context's mesh; this function's mesh becomes the context for the call.
            mesh = self._mesh(None)
            if context != mesh.abstract_mesh:
                with jax.set_mesh(mesh):
                    return self._call(args, kwargs, lower=lower)
        return self._call(args, kwargs, lower=lower)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, lower: bool) -> Any:
        key = self._key(args, kwargs)
        entry = self._entries.get((key, None))
        if entry is None:
            entry = self._entry(key, None)
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static)
        run = entry.jitted.lower if lower else entry.jitted
        multi = entry.mesh.is_multi_process
        if entry.fast and not (multi and _has_host_data((dyn, kwargs))):
            try:
                out = self._finish(run(*dyn, kwargs), lower)
                if not (lower or multi or key[1] or key[2] or self._nesting):
                    self._fast = (len(args), entry.jitted)  # __call__ may go straight there
                return out
            except MeshkitError:
                raise
            except (ValueError, _Retype) as e:
                failure: Exception | None = e if isinstance(e, ValueError) else None
        else:
            failure = None
        # Slow path: find the mapped size, pick the mesh, place every argument, call again.
        placed_dyn, placed_kw, entry = self._place(key, args, dyn, kwargs)
        run = entry.jitted.lower if lower else entry.jitted
        if failure is not None and placed_dyn is None:
            raise failure
        if placed_dyn is None:
            placed_dyn, placed_kw = dyn, kwargs
        return self._finish(run(*placed_dyn, placed_kw), lower)

    def _finish(self, out: Any, lower: bool) -> Any:
        if lower or self.global_outputs or jax.process_count() == 1:
            return out
        return jax.tree_util.tree_map(_process_local, out)

    def _place(
        self,
        key: tuple[Any, ...],
        args: tuple[Any, ...],
        dyn: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Any, _Entry]:
        """The entry for these arguments' mapped size, and the arguments placed for it.

        ``(dyn, kwargs, entry)``; the arguments are None when nothing needed placing.
        """
        dyn_positions, dyn_axes = self._dynamic(len(args))
        leaves, treedef = jax.tree_util.tree_flatten((dyn, kwargs))
        axes = self._leaf_axes(dyn_axes, dyn, kwargs)
        paths = _leaf_paths((dyn, kwargs), dyn_positions)
        resolved = [
            _resolve(a, np.ndim(leaf), where, "in_axes", self.name)
            for leaf, a, where in zip(leaves, axes, paths, strict=True)
        ]
        processes = jax.process_count()
        sizes = {
            _local_size(leaf, r, processes) for leaf, r in zip(leaves, resolved, strict=True)
            if r is not None
        }  # fmt: skip
        if len(sizes) > 1:
            raise MeshkitError(self._mapped_size_error(leaves, axes, paths, -1))
        per_process = sizes.pop() if sizes else None
        default = self._entries[(key, None)].mesh
        mine = len(_device_axis.local_devices(default))
        if per_process == mine or per_process is None:
            entry = self._entries[(key, None)]
        else:
            entry = self._entry(key, per_process)
        mesh = entry.mesh
        changed = False

        def put(leaf: Any, r: Axis) -> Any:
            nonlocal changed
            if isinstance(leaf, Tracer):
                return leaf
            spec = (
                _device_axis.mapped_spec(r, mesh.axis_names[0])
                if r is not None
                else (PartitionSpec())
            )
            target = NamedSharding(mesh, spec)
            if isinstance(leaf, jax.Array):
                if leaf.sharding.is_equivalent_to(target, leaf.ndim):
                    if not _explicitly_typed(leaf):
                        return leaf
                    changed = True  # same blocks, typed by an Explicit mesh: rewrapped
                    shards = [s.data for s in leaf.addressable_shards]
                    return jax.make_array_from_single_device_arrays(leaf.shape, target, shards)
                if r is not None:
                    again = _device_axis.rewrap(leaf, mesh, r)
                    if again is not None:
                        changed = True
                        return again
                changed = True
                if leaf.is_fully_addressable and mesh.is_multi_process:
                    if r is None:
                        return from_host(np.asarray(leaf), target)
                    return _device_axis.from_local(leaf, mesh, r)
                return jax.device_put(leaf, target)
            if not mesh.is_multi_process and entry.fast:
                return leaf  # host data: jit places it through in_shardings
            changed = True
            if r is None:
                return from_host(leaf, target)
            return _device_axis.from_local(leaf, mesh, r)

        placed = [put(leaf, r) for leaf, r in zip(leaves, resolved, strict=True)]
        if not changed and entry is self._entries[(key, None)]:
            return None, None, entry
        placed_dyn, placed_kw = jax.tree_util.tree_unflatten(treedef, placed)
        return placed_dyn, placed_kw, entry

    # ---- meshes -----------------------------------------------------------------------------

    def _pool(self) -> list[Any]:
        """The devices this function may map over (all of them, or devices=/backend=)."""
        if self.devices is not None:
            return self.devices
        return list(jax.devices(self.backend) if self.backend else jax.devices())

    def _mesh(self, per_process: int | None) -> Mesh:
        """The mesh for a mapped size of ``per_process`` entries in each process."""
        pool = self._pool()
        if self.devices is not None:
            mesh = _device_axis.device_mesh(pool, self.mesh_axis, what=self._what)
            local = len(_device_axis.local_devices(mesh))
            if per_process is not None and per_process != local:
                raise MeshkitError(self._size_error(per_process, local, "given in devices="))
            return mesh
        mine = [d for d in pool if d.process_index == jax.process_index()]
        n = per_process if per_process is not None else (self.axis_size or len(mine))
        if n > len(mine):
            raise MeshkitError(self._size_error(n, len(mine), "on this process"))
        if n == len(mine):
            return _device_axis.device_mesh(pool, self.mesh_axis, what=self._what)
        # Fewer entries than devices: the first n devices of each process, as jax.pmap did.
        by_process: dict[int, list[Any]] = {}
        for d in sorted(pool, key=lambda d: (d.process_index, d.id)):
            by_process.setdefault(d.process_index, []).append(d)
        chosen = [d for ds in by_process.values() for d in ds[:n]]
        return _device_axis.device_mesh(chosen, self.mesh_axis, what=self._what)

    def _nested_mesh(self, outer: int, inner_axis: str, inner: int) -> Mesh:
        """A 2-D mesh (this axis, the inner one): ``outer * inner`` devices of each process."""
        if inner_axis == self.mesh_axis:
            raise MeshkitError(
                f"{self._what}: a nested pmap_compat maps the same axis name {inner_axis!r}; "
                "nested pmaps need different axis names."
            )
        by_process: dict[int, list[Any]] = {}
        for d in sorted(self._pool(), key=lambda d: (d.process_index, d.id)):
            by_process.setdefault(d.process_index, []).append(d)
        need = outer * inner
        have = len(by_process.get(jax.process_index(), []))
        if need > have:
            raise MeshkitError(
                self._size_error(need, have, "on this process")
                + f"\n(Nested: {outer} entries of {self.mesh_axis!r} x {inner} of "
                f"{inner_axis!r}.)"
            )
        chosen = [d for ds in by_process.values() for d in ds[:need]]
        grid = np.array(chosen, dtype=object).reshape(len(by_process) * outer, inner)
        return Mesh(grid, (self.mesh_axis, inner_axis), axis_types=(AxisType.Auto,) * 2)

    @property
    def _what(self) -> str:
        return f"meshkit.pmap_compat({self.name})"

    def _size_error(self, n: int, have: int, where: str) -> str:
        return (
            f"{self._what}: the mapped axis has size {n}, which requires {n} devices, but only "
            f"{have} {'is' if have == 1 else 'are'} available {where} (jax.local_devices(): "
            f"{jax.local_device_count()}).\nEach process maps one entry per local device; "
            "consider a mapped size of at most the local device count (meshkit.shard(batch) "
            "reshapes a batch that way)."
        )

    # ---- the compiled function ----------------------------------------------------------------

    def _entry(self, key: tuple[Any, ...], per_process: int | None) -> _Entry:
        """The compiled entry of a call key (see `_key`) and a mapped size per process."""
        n_args, static_vals, kw_names = key
        full_key = (key, per_process)
        entry = self._entries.get(full_key)
        if entry is not None:
            return entry
        nested = self._nesting.get(key)
        if nested is not None and per_process is not None:
            mesh = self._nested_mesh(per_process, *nested)
        else:
            mesh = self._mesh(per_process)
        dyn_positions, dyn_axes = self._dynamic(n_args)
        fast = all(_non_negative(a) for a in dyn_axes)
        statics = dict(zip(self.static, static_vals, strict=True))

        def body(*flat: Any) -> Any:
            dyn, kwargs = flat[:-1], flat[-1]
            return self._body(mesh, dyn_positions, dyn_axes, statics, n_args, dyn, kwargs)

        body.__name__ = body.__qualname__ = self.name
        donate = tuple(j for j, i in enumerate(dyn_positions) if i in self.donate)
        if fast:
            shardings = (
                *tuple(_prefix_shardings(a, mesh) for a in dyn_axes),
                {k: NamedSharding(mesh, PartitionSpec(self.mesh_axis)) for k in kw_names},
            )
            jitted = jax.jit(body, in_shardings=shardings, donate_argnums=donate)
        else:
            jitted = jax.jit(body, donate_argnums=donate)
        entry = self._entries[full_key] = _Entry(mesh, jitted, fast)
        return entry

    def _dynamic(self, n_args: int) -> tuple[list[int], list[Any]]:
        """The positions of the non-static arguments, and their in_axes entries."""
        positions = [i for i in range(n_args) if i not in self.static]
        in_axes = self._in_axes_for(n_args)
        return positions, [in_axes[i] for i in positions]

    def _leaf_axes(self, dyn_axes: list[Any], dyn: tuple[Any, ...], kwargs: Any) -> list[Axis]:
        """The mapped axis (or None) of every leaf of ``(dyn, kwargs)``; keywords map axis 0."""
        axes: list[Axis] = []
        for prefix, arg in zip(dyn_axes, dyn, strict=True):
            axes += _axes_per_leaf(prefix, arg, "in_axes", self.name)
        return axes + [0] * len(jax.tree_util.tree_leaves(kwargs))

    def _in_axes_for(self, n_args: int) -> list[Any]:
        axes = self.in_axes
        if axes is None or isinstance(axes, int):
            return [axes] * n_args
        if not isinstance(axes, tuple):
            raise MeshkitError(
                f"{self._what}: in_axes must be an int, None, or a tuple with one entry per "
                f"positional argument; got {type(axes).__name__} {axes!r}."
            )
        if len(axes) != n_args:
            raise MeshkitError(
                f"{self._what}: in_axes has {len(axes)} entries but the function was called "
                f"with {n_args} positional arguments.\nConsider one in_axes entry per positional "
                "argument (None for an argument every device gets whole)."
            )
        return list(axes)

    def _body(
        self,
        mesh: Mesh,
        dyn_positions: list[int],
        dyn_axes: list[Any],
        statics: dict[int, Any],
        n_args: int,
        dyn: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        inner: bool = False,
    ) -> Any:
        """Trace time: specs per leaf, the mapped sizes checked, shard_map of the function.

        On a 2-D mesh (nested pmap_compat) the shard_map is manual over this function's axis
        only; ``inner``: this is the nested function, traced inside the outer one's shard_map.
        """
        name = self.mesh_axis
        size = mesh.shape[name]
        leaves, treedef = jax.tree_util.tree_flatten((dyn, kwargs))
        axes = self._leaf_axes(dyn_axes, dyn, kwargs)
        paths = _leaf_paths((dyn, kwargs), dyn_positions)
        if any(_explicitly_typed(leaf) for leaf in leaves):
            raise _Retype  # placed again, untyped, by the slow path
        resolved: list[Axis] = []
        for leaf, axis, where in zip(leaves, axes, paths, strict=True):
            r = _resolve(axis, np.ndim(leaf), where, "in_axes", self.name)
            if r is not None and np.shape(leaf)[r] != size:
                raise MeshkitError(self._mapped_size_error(leaves, axes, paths, size))
            resolved.append(r)
        specs = [
            _device_axis.mapped_spec(r, name) if r is not None else PartitionSpec()
            for r in resolved
        ]

        def per_device(*blocks: Any) -> Any:
            local = [
                jax.lax.squeeze(b, (r,)) if r is not None else b
                for b, r in zip(blocks, resolved, strict=True)
            ]
            d_args, kw = jax.tree_util.tree_unflatten(treedef, local)
            it = iter(d_args)
            full = [statics[i] if i in statics else next(it) for i in range(n_args)]
            return self._outputs_per_device(self.fun(*full, **kw))

        out_specs = _prefix_map(self.out_axes, lambda a: _out_spec(a, name))

        def mapped(check_vma: bool) -> Any:
            extra: dict[str, Any] = {}
            if len(mesh.axis_names) > 1:
                extra["axis_names"] = {name}
            if not inner:
                extra["mesh"] = mesh
            token = _TRACING.set(_Tracing(self, mesh))
            try:
                return jax.shard_map(
                    per_device,
                    in_specs=tuple(specs),
                    out_specs=out_specs,
                    check_vma=check_vma,
                    **extra,
                )(*leaves)
            finally:
                _TRACING.reset(token)

        try:
            result = mapped(True)
        except NotImplementedError:
            # Collectives with axis_index_groups have no replication typing: traced untyped,
            # they run (and out_axes=None can no longer be checked for them).
            result = mapped(False)
        except AssertionError:
            # shard_map's replication typing asserts on a collective over an unbound axis name;
            # traced again without it, JAX names the axis.
            try:
                mapped(False)
            except NameError as e:
                found = re.search(r"unbound axis name: (.+?)\.", str(e))
                axis = found.group(1) if found else "?"
                fix = (
                    f"Consider axis_name={axis!r} in pmap_compat."
                    if self.axis_name is None
                    else f"Consider naming {self.axis_name!r} in the collective."
                )
                raise MeshkitError(
                    f"{self._what}: a collective names the axis {axis!r}, which is not bound "
                    f"here; the function maps the axis {self.axis_name!r}.\n{fix}"
                ) from None
            raise
        return self._move_negative_outputs(result)

    def _out_axes_per_leaf(self, out: Any) -> list[Axis]:
        return _axes_per_leaf(self.out_axes, out, "out_axes", self.name)

    def _outputs_per_device(self, out: Any) -> Any:
        """Each output gets its mapped dimension back (size 1); out_axes=None ones are checked."""
        leaves, treedef = jax.tree_util.tree_flatten(out)
        axes = self._out_axes_per_leaf(out)
        paths = [
            f"output{jax.tree_util.keystr(p)}"
            for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]
        ]
        result = []
        for leaf, axis, where in zip(leaves, axes, paths, strict=True):
            leaf = jax.numpy.asarray(leaf)
            if axis is None:
                if self.mesh_axis in _compat.varying_axes(leaf):
                    raise MeshkitError(
                        f"{self._what}: out_axes=None for {where} (shape {leaf.shape}) promises "
                        f"the same value on every device, but it varies over the mapped axis "
                        f"{self.axis_name!r}: it depends on a mapped argument.\njax.pmap would "
                        "have returned device 0's value without a word. Consider reducing it "
                        f"first (jax.lax.pmean(x, {self.axis_name!r}) or psum), or out_axes=0 to "
                        "get every device's value."
                    )
                result.append(leaf)
                continue
            ndim = leaf.ndim + 1
            if not -ndim <= axis < ndim:
                raise MeshkitError(
                    f"{self._what}: out_axes={axis} for {where}, which has rank {leaf.ndim} "
                    f"per device ({ndim} with the mapped axis; valid: {-ndim} to {ndim - 1})."
                )
            at = axis if axis >= 0 else 0  # negative: moved into place after shard_map
            result.append(jax.numpy.expand_dims(leaf, at))
        return jax.tree_util.tree_unflatten(treedef, result)

    def _move_negative_outputs(self, out: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(out)
        axes = self._out_axes_per_leaf(out)
        moved = [
            jax.numpy.moveaxis(leaf, 0, axis % leaf.ndim) if axis is not None and axis < 0 else leaf
            for leaf, axis in zip(leaves, axes, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, moved)

    def _mapped_size_error(
        self, leaves: list[Any], axes: list[Axis], paths: list[str], size: int
    ) -> str:
        rows = []
        sizes = set()
        for leaf, axis, where in zip(leaves, axes, paths, strict=True):
            if axis is None:
                continue
            r = axis % np.ndim(leaf)
            n = np.shape(leaf)[r]
            sizes.add(n)
            rows.append(f"  {where}: shape {tuple(np.shape(leaf))}, mapped axis {r} of size {n}")
        if len(sizes) > 1:
            return (
                f"{self._what}: the mapped arguments have different sizes along their mapped "
                "axes:\n" + "\n".join(rows) + "\nEvery mapped axis must have one entry per "
                "device; consider in_axes=None for an argument every device gets whole."
            )
        (n,) = sizes
        processes = jax.process_count()
        local = size // processes if processes > 1 else size
        if processes > 1:
            n //= processes
        return self._size_error(n, local, "on this process")


@dataclass
class _Tracing:
    """The pmap_compat whose function is being traced (for nested pmap_compat calls)."""

    fn: PmapFunction
    mesh: Mesh


_TRACING: contextvars.ContextVar[_Tracing | None] = contextvars.ContextVar(
    "meshkit_pmap_tracing", default=None
)


class _NestedFound(Exception):
    """Raised while tracing: a pmap_compat inside another; the outer one builds a 2-D mesh."""

    def __init__(self, axis: str, size: int) -> None:
        self.axis = axis
        self.size = size


_NO_KWARGS: dict[str, Any] = {}


class _Retype(Exception):
    """Raised while tracing: an argument is typed by an Explicit mesh; place it and retry."""


def _explicitly_typed(x: Any) -> bool:
    """Whether ``x``'s type carries a sharding over Explicit mesh axes (shard_map rejects it)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or not spec_axes(sharding.spec):
        return False
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _has_host_data(tree: Any) -> bool:
    return not all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(tree))


def _local_size(leaf: Any, axis: int, processes: int) -> int:
    """The mapped size this process contributes: global arrays count every process's entries."""
    n = int(np.shape(leaf)[axis])
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return n // processes
    return n


def _process_local(x: Any) -> Any:
    """``jax.pmap``'s multi-process output: this process's entries only (no copy)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
    mapped = [d for d, e in enumerate(spec) if e is not None]
    if not mapped:
        return x.addressable_data(0)
    return _device_axis.local_view(x, mapped[0])


def _non_negative(axes: Any) -> bool:
    return all(
        a is None or a >= 0 for a in jax.tree_util.tree_leaves(axes, is_leaf=lambda x: x is None)
    )


def _prefix_shardings(axes: Any, mesh: Mesh) -> Any:
    name = mesh.axis_names[0]

    def one(a: Axis) -> NamedSharding:
        spec = _device_axis.mapped_spec(a, name) if a is not None else PartitionSpec()
        return NamedSharding(mesh, spec)

    return _prefix_map(axes, one)


def _leaf_paths(tree: Any, dyn_positions: list[int]) -> list[str]:
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        first, rest = path[0], path[1:]
        if getattr(first, "idx", None) == 0:  # positional
            j = path[1].idx  # type: ignore[attr-defined]
            out.append(f"args[{dyn_positions[j]}]{jax.tree_util.keystr(path[2:])}")
        else:
            out.append(f"kwargs{jax.tree_util.keystr(rest)}")
    return out


def _prefix_map(axes: Any, fn: Callable[[Axis], Any]) -> Any:
    if axes is None or isinstance(axes, int):
        return fn(axes)
    return jax.tree_util.tree_map(fn, axes, is_leaf=lambda x: x is None)


def _out_spec(axis: Axis, name: str) -> PartitionSpec:
    if axis is None:
        return PartitionSpec()
    return _device_axis.mapped_spec(axis if axis >= 0 else 0, name)


def _argnums(value: int | Sequence[int], what: str, name: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else tuple(value)
    for i in items:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise MeshkitError(
                f"meshkit.pmap_compat({name}): {what} must be non-negative ints; got {value!r}."
            )
    return tuple(sorted(set(items)))


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
    global_outputs: bool = True,
) -> Any:
    """`jax.pmap`'s interface on mesh sharding: ``jax.jit(jax.shard_map(...))`` over the devices.

    Old pmap code runs by changing ``jax.pmap`` to ``meshkit.pmap_compat``: arguments carry one
    entry per local device along their mapped axis (``in_axes``), named-axis collectives
    (``jax.lax.psum(x, axis_name)``, `meshkit.collectives`) span every device of every process,
    and outputs have the device axis at ``out_axes``. Differences from `jax.pmap`, all on the
    side of safety:

    * outputs are global `jax.Array` s over a 1-D mesh of the devices. In one process they are
      exactly `jax.pmap`'s; with several processes their mapped axis counts every device of
      every process, so a downstream `jax.jit`, `meshkit.gather` or a checkpointer sees the
      whole value (``global_outputs=False`` gives `jax.pmap`'s process-local arrays instead);
    * ``out_axes=None`` checks that the value is the same on every device (through shard_map's
      replication typing, at trace time) instead of returning device 0's value;
    * negative ``in_axes`` / ``out_axes`` count from the end, as in `jax.vmap`;
    * errors name the argument, its shape, the mapped axis and the device count.

    Args:
        fun: the per-device function. Omit it to use ``pmap_compat`` as a decorator (also with
            `functools.partial`).
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
        axis_size: the mapped size when no argument is mapped (default: the local device
            count).
        donate_argnums: positional arguments whose buffers may be reused for the outputs.
        global_outputs: see above; the default True makes multi-process outputs global arrays.

    Returns:
        A `PmapFunction`: call it like the original; ``.lower(*args)`` lowers it.

    Raises:
        MeshkitError: a mapped size larger than the local device count or differing between
            arguments; ``in_axes`` / ``out_axes`` out of range or not matching the arguments;
            static arguments passed by keyword or unhashable; ``out_axes=None`` on a value that
            varies across devices.

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
