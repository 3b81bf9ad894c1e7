"""`pmap_compat`: `jax.pmap`'s interface and results, run as ``jax.jit(jax.shard_map(...))``.

A call's structure and shapes select a cached `entry`; arguments placed as it expects go
straight to its jit. Its 1-D device meshes (`device_mesh`) serve the flax-era helpers too.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, Mesh

from ..core import caches as _caches
from ..core import canonical as _canonical
from ..core import compat as _compat
from ..core.errors import MeshkitError, MeshkitTypeError, shorten
from ..core.frames import public
from ..runtime import dispatch as _dispatch
from ..spmd.placement import argnums, dynamic, is_local
from . import entry as _entry


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
        self.what = what = f"meshkit.pmap_compat({name})"
        if axis_name is not None and not isinstance(axis_name, str):
            raise MeshkitTypeError(
                f"{what}: axis_name must be a string (or None); got {axis_name!r}.\nMesh axes "
                "are named by strings; consider axis_name='batch'."
            )
        self.axis_name = axis_name
        self.mesh_axis = axis_name if axis_name is not None else "_pmap_compat"
        in_axes = tuple(in_axes) if isinstance(in_axes, list) else in_axes
        _entry.check_axes_tree(in_axes, "in_axes", name)
        _entry.check_axes_tree(out_axes, "out_axes", name)
        self.in_axes = in_axes
        self.out_axes = out_axes
        self.static = argnums(static_broadcasted_argnums, "static_broadcasted_argnums", what)
        self.donate = argnums(donate_argnums, "donate_argnums", what)
        both = set(self.static) & set(self.donate)
        if both:
            raise MeshkitError(
                f"{what}: argument(s) {sorted(both)} are both static and donated; a static "
                "argument is a Python value, it has no buffer to donate."
            )
        if axis_size is not None and (
            isinstance(axis_size, bool) or not isinstance(axis_size, int) or axis_size < 1
        ):
            raise MeshkitError(f"{what}: axis_size must be a positive int; got {axis_size!r}.")
        self.axis_size = axis_size
        if devices is not None and backend is not None:
            raise MeshkitError(f"{what}: give devices= or backend=, not both (as jax.pmap).")
        if isinstance(devices, Sequence) and not devices:  # jax.pmap's words; others below
            raise MeshkitError(
                f"{what}: 'devices' argument to pmap must be non-empty, or None.\nConsider "
                "devices=None (every device of every process) or a list such as "
                "jax.local_devices()."
            )
        self.devices = None if devices is None else check_devices(devices, what)
        self.backend = backend
        self.global_outputs = bool(global_outputs)
        out_leaves = jax.tree_util.tree_leaves(out_axes, is_leaf=lambda x: x is None)
        self.checks_outputs = any(a is None for a in out_leaves)
        self.warned: set[str] = set()  # outputs warned about (UncheckedOutputWarning)
        self._entries: dict[Any, _entry.Entry] = {}
        # Per structure of positional-only calls: the last call's entry (the steady state).
        self._steady: dict[Any, _entry.Entry] = {}
        info = {"axis_name": axis_name, "params": _dispatch.param_names(fun)}
        info |= {"origin": _dispatch.origin(fun), "static_argnums": self.static}
        self._site = _dispatch.CallSite("pmap_compat", name, info=info)

    @public
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _dispatch.enter(self._site, args)
        if not (kwargs or self.static):
            # The steady state of a loop: every leaf placed as the last entry expects.
            leaves, treedef = jax.tree_util.tree_flatten(args)
            entry = self._steady.get(treedef)
            if entry and entry.plan and entry.plan.placed(leaves) and _compat.idle():
                return entry.finish(entry.jitted(*leaves))
        outer = _entry.TRACING.get()
        if outer is not None and outer is not self:
            return self._nested(args, kwargs)
        _, _, _, entry, placed = self._prepare(args, kwargs)
        if not (kwargs or self.static) and _compat.idle():
            self._steady[jax.tree_util.tree_structure(args)] = entry
        return entry.finish(entry.jitted(*placed))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a method decorator: ``self`` becomes the first argument, as with `jax.pmap`."""
        return self if obj is None else functools.partial(self, obj)

    @public
    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower like ``jax.pmap(f).lower``; ``.compile()`` is called like this function."""
        key, treedef, leaves, entry, placed = self._prepare(args, kwargs)
        lowered = entry.jitted.lower(*placed)
        return Lowered(Stage(key, treedef, signature(leaves), entry), lowered)

    @property
    def calls(self) -> int:
        """How many times this function has been called in this process."""
        return self._site.calls

    def __repr__(self) -> str:
        return f"<meshkit.pmap_compat {self.name} axis_name={self.axis_name!r}>"

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``(key, treedef, leaves, entry, placed leaves)``: the slow path, outputs checked."""
        key = _entry.call_key(self, args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((dynamic(args, self.static), kwargs))
        tracing = not _compat.trace_state_clean()
        # The leaves' shapes fix the mapped axes and the mesh; global arrays (not process-local,
        # not traced) count every process's entries.
        shapes = tuple((np.shape(x), not (is_local(x) or isinstance(x, Tracer))) for x in leaves)
        entry = self._entries.get((key, treedef, shapes, tracing))
        if entry is None:
            entry = _entry.build(self, key, treedef, leaves, shapes, tracing)
            self._entries[(key, treedef, shapes, tracing)] = entry
        placed = leaves if tracing else entry.place(leaves, treedef)
        entry.check_outputs(placed)
        return key, treedef, leaves, entry, placed

    def _mesh(self, per_process: int, local_only: bool) -> Mesh:
        """The first ``per_process`` devices of each process (``local_only``: of this one)."""
        pool = self.devices if self.devices is not None else jax.devices(self.backend)
        name = self.mesh_axis
        if local_only and per_process == len(pool):  # a global array traced by an enclosing jit
            return device_mesh(pool, name)
        me = jax.process_index()
        if self.devices is not None and not local_only:
            # jax.pmap maps entry i to devices[i] (in one process).
            mesh = device_mesh(pool, name, keep_order=True)
            local = len(mesh.local_devices)
            if per_process != local:
                raise MeshkitError(self._size_error(per_process, local, "given in devices="))
            return mesh
        if local_only:
            pool = [d for d in pool if d.process_index == me]
        have = sum(d.process_index == me for d in pool)
        if per_process > have:
            raise MeshkitError(self._size_error(per_process, have, "on this process"))
        ordered = sorted(pool, key=lambda d: (d.process_index, d.id))
        per_host = itertools.groupby(ordered, key=lambda d: d.process_index)
        chosen = [d for _, devices in per_host for d in list(devices)[:per_process]]
        return device_mesh(chosen, name)

    def _size_error(self, n: int, have: int, where: str) -> str:
        return (
            f"{self.what}: the mapped axis has size {n}, which requires {n} devices, but only "
            f"{have} {'is' if have == 1 else 'are'} available {where} (jax.local_devices(): "
            f"{jax.local_device_count()}).\nEach process maps one entry per local device; "
            "consider a mapped size of at most the local device count (meshkit.shard(batch) "
            "reshapes a batch that way)."
        )

    def _nested(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called while an enclosing pmap_compat traces: vmap on each of its devices."""
        if _entry.TRACING.get().mesh_axis == self.mesh_axis:
            raise MeshkitError(
                f"{self.what}: called inside a pmap_compat over the same axis name "
                f"{self.mesh_axis!r}; nested pmaps need different axis names."
            )
        key = _entry.call_key(self, args, kwargs)
        dyn = dynamic(args, self.static)
        leaves, treedef = jax.tree_util.tree_flatten((dyn, kwargs))
        mapped = jax.vmap(
            lambda *xs: _entry.call(self, key, treedef, xs),
            in_axes=tuple(_entry.call_layout(self, key[0], dyn, kwargs)[0]),
            out_axes=self.out_axes,
            axis_name=self.mesh_axis,
            axis_size=self.axis_size,
        )
        return mapped(*leaves)


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
    """`jax.pmap`'s interface and results, run as ``jax.jit(jax.shard_map(...))``.

    Old pmap code runs by changing ``jax.pmap`` to ``meshkit.pmap_compat``; collectives span
    every device of every process and outputs are what `jax.pmap` returns. Unlike it,
    ``out_axes=None`` is checked to be the same on every device (`UncheckedOutputWarning`
    where it cannot be), negative axes count from the end, a nested ``pmap_compat`` runs
    vectorized on each outer device, and ``global_outputs=True`` returns global arrays over
    every process's devices. Other parameters are `jax.pmap`'s.

    Examples:
        >>> import jax, numpy as np, meshkit
        >>> n = jax.local_device_count()
        >>> @meshkit.pmap_compat(axis_name="batch")
        ... def normalize(x):
        ...     return x / jax.lax.psum(x.sum(), "batch")
        >>> out = normalize(np.ones((n, 2), np.float32))
        >>> out.shape == (n, 2), float(out.sum())
        (True, 1.0)
    """
    wrap = functools.partial(
        PmapFunction, axis_name=axis_name, in_axes=in_axes, out_axes=out_axes,
        static_broadcasted_argnums=static_broadcasted_argnums, devices=devices, backend=backend,
        axis_size=axis_size, donate_argnums=donate_argnums, global_outputs=global_outputs,
    )  # fmt: skip
    return wrap if fun is None else wrap(fun)


def check_devices(devices: Any, what: str) -> list[Any]:
    """``devices`` as a list: a non-empty sequence of distinct devices, some of this process."""
    if isinstance(devices, jax.Device):
        raise MeshkitError(
            f"{what}: devices must be a sequence of devices; got a single device ({devices}).\n"
            f"Consider devices=[{devices}] or devices=jax.local_devices()."
        )
    try:
        chosen = list(devices)
    except TypeError:
        raise MeshkitError(
            f"{what}: devices must be a sequence of devices; got {type(devices).__name__} "
            f"({shorten(repr(devices), 60)}).\nConsider devices=jax.local_devices()."
        ) from None
    if not chosen:
        raise MeshkitError(
            f"{what}: devices is empty; the result has one entry per device, so at least one "
            "device is needed.\nConsider devices=jax.local_devices()."
        )
    bad = [d for d in chosen if not isinstance(d, jax.Device)]
    if bad:
        raise MeshkitError(
            f"{what}: devices holds {type(bad[0]).__name__} ({shorten(repr(bad[0]), 60)}), not a "
            "device.\nConsider devices from jax.devices() or jax.local_devices()."
        )
    if len(set(chosen)) != len(chosen):
        twice = sorted({str(d) for d in chosen if chosen.count(d) > 1})
        raise MeshkitError(
            f"{what}: devices lists {', '.join(twice)} more than once; each device holds one "
            "entry of the device axis.\nConsider removing the repeats."
        )
    me = jax.process_index()
    if not any(d.process_index == me for d in chosen):
        raise MeshkitError(
            f"{what}: devices holds no device of this process ({me}); every process puts its "
            "entries on its own devices.\nConsider including jax.local_devices()."
        )
    return chosen


@_caches.cached(maxsize=64)
def _cached_mesh(devices: tuple[Any, ...], axis_name: str) -> Mesh:
    return Mesh(np.array(devices, dtype=object), (axis_name,), axis_types=(AxisType.Auto,))


def device_mesh(
    devices: Sequence[Any] | None = None, axis_name: str = "devices", *, keep_order: bool = False
) -> Mesh:
    """The cached 1-D mesh over ``devices`` (default: all); ``keep_order``: as given (1 process)."""
    chosen = tuple(jax.devices() if devices is None else devices)
    if not (keep_order and jax.process_count() == 1):  # each process's entries contiguous
        chosen = tuple(sorted(chosen, key=lambda d: (d.process_index, d.id)))
    return _cached_mesh(chosen, axis_name)


def signature(leaves: list[Any]) -> list[tuple[tuple[int, ...], str]]:
    """Each leaf's shape and dtype as given (before placement)."""
    return [(tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves]


@dataclass(frozen=True)
class Stage:
    """What a lowering fixed: the call key and structure, the leaves' signature, the entry."""

    key: Any
    treedef: Any
    given: list[tuple[tuple[int, ...], str]]
    entry: _entry.Entry


class Lowered:
    """``pmap_compat(f).lower(...)``: JAX's `Lowered`, with `compile` keeping f's signature."""

    def __init__(self, stage: Stage, lowered: Any) -> None:
        self._stage = stage
        self.lowered = lowered

    @public
    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        """Compile; the result is called like the pmapped function."""
        return Compiled(self._stage, self.lowered.compile(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lowered, name)  # as_text, compiler_ir, cost_analysis, ...


class Compiled:
    """A compiled `pmap_compat` function: call it with the arguments it was lowered for."""

    def __init__(self, stage: Stage, compiled: Any) -> None:
        self._stage = stage
        self.compiled = compiled

    @public
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stage = self._stage
        what, static = stage.entry.fn.what, stage.entry.fn.static
        n_args, static_vals, _ = stage.key
        if static and len(args) == n_args:  # static arguments given again: they must match
            given = tuple(args[i] for i in static)
            if given != static_vals:
                raise MeshkitTypeError(
                    f"{what}: compiled for static arguments {static_vals}, called with "
                    f"{given}.\nConsider lowering again for these values."
                )
            args = dynamic(args, static)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if treedef != stage.treedef:
            raise MeshkitTypeError(
                f"{what}: Function compiled with input pytree does not match the input "
                f"pytree it was called with.\ncompiled for: {stage.treedef}\ncalled with:  "
                f"{treedef}\nConsider calling it with the (non-static) arguments it was lowered "
                "for, or lowering again."
            )
        now = signature(leaves)
        if now != stage.given:
            assert stage.entry.plan is not None  # lowered on a mesh of devices
            rows = [
                f"  {where}: compiled for {want[1]}{list(want[0])}, called with "
                f"{got[1]}{list(got[0])}"
                for where, want, got in zip(stage.entry.plan.paths, stage.given, now, strict=True)
                if want != got
            ]
            raise MeshkitTypeError(
                f"{what}: Argument types differ from the types for which this computation "
                "was compiled.\n" + "\n".join(rows) + "\nConsider lowering again for these "
                "arguments, or calling the pmapped function itself (it compiles per signature)."
            )
        return stage.entry.finish(self.compiled(*stage.entry.place(leaves, treedef)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)  # as_text, cost_analysis, ...
