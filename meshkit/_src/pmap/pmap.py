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

An entry (`meshkit._src.pmap.entry`: one `jax.jit` over the flat leaves, with an argument plan
as `spmd` has, `meshkit._src.sharding.argument_plan`) is traced once per signature. Outputs
promised equal on every device (``out_axes=None``) are checked on that trace by
`meshkit._src.spmd.variance`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh

from ..core import canonical as _canonical
from ..core import compat as _compat
from ..core.errors import MeshkitError, MeshkitTypeError
from ..core.tracebacks import public
from ..runtime import dispatch as _dispatch
from ..spmd.placement import argnums, dynamic
from . import axes
from . import device_axis as _device_axis
from .entry import TRACING, Entry, Mapped, build, mesh_context, process_local
from .stages import Lowered, Stage, signature

__all__ = ["PmapFunction", "pmap_compat"]

_ANON_AXIS = "_pmap_compat"


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
        self.name = name = _canonical.function_name(fun)
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
        what = f"meshkit.pmap_compat({name})"
        self.static = argnums(static_broadcasted_argnums, "static_broadcasted_argnums", what)
        self.donate = argnums(donate_argnums, "donate_argnums", what)
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
        out_leaves = jax.tree_util.tree_leaves(out_axes, is_leaf=lambda x: x is None)
        self._mapped = Mapped(
            fun=fun,
            name=name,
            what=what,
            axis_name=axis_name,
            mesh_axis=self.mesh_axis,
            out_axes=out_axes,
            static=self.static,
            global_outputs=self.global_outputs,
            out_axes_fixed=all(a is None or a >= 0 for a in out_leaves),
            checks_outputs=any(a is None for a in out_leaves),
        )
        self._layouts: dict[Any, axes.Layout] = {}
        self._entries: dict[Any, Entry] = {}
        # Per structure of the arguments (calls without keywords or statics): the entry the
        # last call used, for the steady-state test of the next. A call inside jax.set_mesh
        # is not steady: it runs in this function's mesh (`mesh_context`).
        self._steady: dict[Any, Entry] = {}
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

    @public
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _dispatch.enter(self._site, args)
        if not (kwargs or self.static):
            # The steady state of a loop: no keywords or statics, every leaf already placed
            # as the entry of this structure expects, nothing tracing. Each step here shows in
            # the per-call time, so this path does only what deciding needs.
            leaves, treedef = jax.tree_util.tree_flatten(args)
            entry = self._steady.get(treedef)
            if entry is not None and entry.plan.placed(leaves) and _compat.idle():
                out = entry.jitted(*leaves)
                return jax.tree_util.tree_map(process_local, out) if entry.local_out else out
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        outer = TRACING.get()
        if outer is not None and outer is not self._mapped:
            return self._nested(args, kwargs)
        key = axes.call_key(args, kwargs, self.static, self._what, self.name)
        leaves, treedef = jax.tree_util.tree_flatten((dynamic(args, self.static), kwargs))
        entry, placed = self._classify(key, treedef, leaves)
        if not (kwargs or self.static) and _compat.idle():
            self._steady[jax.tree_util.tree_structure(args)] = entry
        with mesh_context(entry.plan.mesh):
            entry.check_outputs(placed)
            return entry.finish(entry.jitted(*placed))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a method decorator: ``self`` becomes the first argument, as with `jax.pmap`."""
        if obj is None:
            return self
        return functools.partial(self, obj)

    @public
    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower for these arguments, like ``jax.pmap(f).lower``: ``.as_text()``, ``.compile()``.

        The compiled function takes the same arguments as this one (static ones may be left
        out, as with `jax.jit`) and returns the same outputs.
        """
        key = axes.call_key(args, kwargs, self.static, self._what, self.name)
        leaves, treedef = jax.tree_util.tree_flatten((dynamic(args, self.static), kwargs))
        entry, placed = self._classify(key, treedef, leaves)
        with mesh_context(entry.plan.mesh):
            entry.check_outputs(placed)
            lowered = entry.jitted.lower(*placed)
        stage = Stage(
            what=self._what,
            static=self.static,
            key=key,
            treedef=treedef,
            paths=entry.plan.paths,
            given=signature(leaves),
            dynamic=functools.partial(dynamic, static=self.static),
            place=entry.place,
            finish=entry.finish,
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

    def _classify(
        self, key: tuple[Any, ...], treedef: Any, leaves: list[Any]
    ) -> tuple[Entry, list[Any]]:
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
            entry = self._entries[entry_key] = build(
                self._mapped, key, treedef, layout, resolved, mesh, tracing
            )
        if tracing:
            return entry, leaves
        return entry, entry.place(leaves, treedef)

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

    # ---- nested -----------------------------------------------------------------------------

    def _nested(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called while an enclosing pmap_compat traces: mapped on each of its devices by vmap.

        Old nested pmaps split devices between the two axes; today `jax.pmap` refuses them. The
        inner axis runs vectorized on each device of the outer one, so collectives over either
        axis or both compute what the old nesting computed.
        """
        outer = TRACING.get()
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
        return mapped(*dynamic(args, self.static), **kwargs)


@public
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
