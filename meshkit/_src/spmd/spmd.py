"""`spmd`: per-device code over a mesh, as ``jax.jit(jax.shard_map(f, ...))`` with input placement.

An `SpmdFunction` keeps one `Layout` per mesh and argument structure.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jax.tree_util import keystr

from ..arrays import assembly as _assembly
from ..coord import channel as _channel
from ..core import canonical as _canonical
from ..core import compat as _compat
from ..core.errors import MeshkitError
from ..core.frames import hide_frames, public, user_stacklevel
from ..core.trees import broadcast_prefix
from ..debug import divergence as _debug_check
from ..runtime import dispatch as _dispatch
from ..sharding.layout import argument_plan
from ..sharding.specs import (
    align_specs,
    as_partition_spec,
    check_spec_for_mesh,
    describe_node,
    dim_axes,
    has_mapping,
    is_spec_leaf,
    map_specs,
    parse_spec,
    plain_specs,
    spec_axes,
)
from . import placement as _placement
from .placement import Placed, argnums, dynamic


class ReshardWarning(UserWarning):
    """An argument of an spmd function arrived laid out differently from its ``in_specs``.

    meshkit moves it with one reshard per call and warns once per function and argument.
    """


_RESHARD_FIX = """\
Consider producing it with that sharding (for example as the out_specs of the step that makes
it), or moving it once outside the loop: jax.device_put(x, {target})."""


@dataclass(eq=False)
class Layout(Placed):
    """One mesh and structure of the dynamic arguments: its jit and plan, specs and leaves."""

    mesh: Mesh | AbstractMesh
    specs: tuple[Any, ...]  # one spec tree per argument, in the argument's node types
    leaves: list[tuple[PartitionSpec, Any, str]]  # per leaf: spec, spec as written, name
    out_specs: Any  # checked against the mesh


_TAG = "spmd"  # the coordination-service exchanges of spmd's host arguments


class SpmdFunction:
    """A per-device function bound to a mesh and specs; made by `meshkit.spmd`.

    Calling it runs the function on every device of the mesh, with each argument split per
    ``in_specs``, and returns global arrays laid out per ``out_specs``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        mesh: Mesh | None,
        in_specs: Any,
        out_specs: Any,
        check_vma: bool,
        donate_argnums: int | Sequence[int],
        static_argnums: int | Sequence[int],
    ) -> None:
        if not callable(fn):
            raise MeshkitError(f"meshkit.spmd: expected a function; got {fn!r}.")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = _canonical.function_name(fn)
        self.what = what = f"meshkit.spmd({self.name})"
        if mesh is not None and not isinstance(mesh, Mesh):
            raise MeshkitError(
                f"{what}: mesh must be a jax.sharding.Mesh (e.g. from "
                f"meshkit.make_mesh) or None for the mesh of jax.set_mesh; got {mesh!r}."
            )
        self.static_argnums = argnums(static_argnums, "static_argnums", what)
        self.donate_argnums = argnums(donate_argnums, "donate_argnums", what)
        if isinstance(in_specs, Mapping):
            raise MeshkitError(
                f"{what}: in_specs must be one spec for every argument, or a "
                f"tuple with one entry per positional argument; got {describe_node(in_specs)}.\n"
                "Consider in_specs=(specs,) if it describes the first argument."
            )
        in_specs = plain_specs(in_specs)  # flax's boxes of specs stand for their specs
        static = self.static_argnums
        if (  # in_specs may hold None at the static positions (one entry per parameter)
            static
            and isinstance(in_specs, tuple | list)
            and all(i < len(in_specs) and in_specs[i] is None for i in static)
        ):
            in_specs = tuple(s for i, s in enumerate(in_specs) if i not in static)
        self.in_specs = tuple(in_specs) if isinstance(in_specs, list) else in_specs
        self.out_specs = plain_specs(out_specs)
        for tree, name in ((self.in_specs, "in_specs"), (out_specs, "out_specs")):
            map_specs(_check_leaf, tree, f"spmd({self.name}): {name}")
        # out_specs with mappings are matched to the outputs by keys (see `_body`).
        self.keyed_out = has_mapping(self.out_specs)
        self.check_vma = bool(check_vma)
        self.mesh = mesh
        info = {"mesh": mesh, "params": _dispatch.param_names(fn), "origin": _dispatch.origin(fn)}
        info["static_argnums"] = self.static_argnums
        self._site = _dispatch.CallSite("spmd", self.name, info=info)
        self._warned: set[str] = set()
        self._layouts: dict[Any, Layout] = {}  # by mesh and treedef of the dynamic arguments
        # treedef, plan.shardings, jit, and the arrays' type when they are the arguments
        self._last: tuple[Any, list[Any], Any, type | None] | None = None
        if mesh is not None:
            self._mesh_specs(mesh)  # checked at once

    def warn_reshard(
        self, where: str, have: str, want: PartitionSpec, mesh: Mesh | AbstractMesh
    ) -> None:
        if where in self._warned:
            return
        self._warned.add(where)
        target = f"NamedSharding(mesh, {want})"
        warnings.warn(
            f"meshkit.spmd({self.name}): {where} arrived with {have}, but in_specs asks for "
            f"{want} on the mesh {dict(mesh.shape)}; it is resharded on every call (this "
            f"warning is shown once).\n{_RESHARD_FIX.format(target=target)}",
            ReshardWarning,
            stacklevel=user_stacklevel(),
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # as `public`, without its frame (each call saved counts here)
        # A loop's steady state: the last placed call's structure on the bound mesh, each leaf
        # laid out as that call put it (as `ArgumentPlan.placed`), nothing observing: to jit.
        last = self._last
        quiet = not _dispatch.observers and _debug_check.state.settings is None  # as `enter` sees
        if last is not None and not kwargs and quiet:
            if (kind := last[3]) is not None:  # arrays only, all of one kind: the leaves
                now = [a.sharding if type(a) is kind else None for a in args]
            else:
                static = self.static_argnums
                leaves, tree = jax.tree_util.tree_flatten(dynamic(args, static) if static else args)
                try:  # host data and tracers have no sharding: they are placed
                    now = [leaf.sharding for leaf in leaves] if tree == last[0] else None
                except AttributeError:
                    now = None
            if now is not None and now == last[1]:
                last[1][:] = now  # equal shardings replaced: the next call compares by identity
                self._site.calls += 1  # `_dispatch.count`
                _debug_check.latest = self._site
                return last[2](*args)
        try:
            return self._enter(args, kwargs)
        except MeshkitError as e:
            hide_frames(e)
            raise  # bare: no frame of its own

    def _enter(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs:
            raise MeshkitError(
                f"{self.what} takes positional arguments only (in_specs are positional); got "
                f"keywords {sorted(kwargs)}."
            )
        _dispatch.enter(self._site, args)
        mesh = self._call_mesh()
        if not isinstance(mesh, Mesh):  # traced inside jax.jit: shard_map over the abstract mesh
            return self._body(mesh, *args)
        return self._call(mesh, args)

    @public
    def lower(self, *args: Any) -> Any:
        """Lower for these arguments, like `jax.jit(...).lower` (to inspect HLO or compile)."""
        mesh = self._call_mesh()
        if not isinstance(mesh, Mesh):
            raise MeshkitError(f"{self.what}.lower needs a concrete mesh.")
        return self._call(mesh, args, lower=True)

    @property
    def calls(self) -> int:
        """How many times this function has been called in this process."""
        return self._site.calls

    def __repr__(self) -> str:
        mesh = dict(self.mesh.shape) if self.mesh is not None else "from jax.set_mesh"
        return f"<meshkit.spmd {self.name} mesh={mesh}>"

    def _call_mesh(self) -> Mesh | AbstractMesh:
        """The bound mesh, or the enclosing ``jax.set_mesh``'s (abstract while tracing)."""
        if self.mesh is not None:
            return self.mesh
        traced = not _compat.trace_state_clean()
        mesh = jax.sharding.get_abstract_mesh() if traced else jax.sharding.get_mesh()
        if mesh.empty:
            raise MeshkitError(
                f"{self.what} has no mesh: it was made with mesh=None and "
                f"{'traced' if traced else 'called'} outside `with jax.set_mesh(mesh):`.\n"
                "Consider passing mesh= to meshkit.spmd."
            )
        return mesh

    def _mesh_specs(self, mesh: Mesh | AbstractMesh) -> tuple[Any, Any]:
        """``in_specs`` and ``out_specs`` checked against ``mesh``."""
        check = lambda spec, where: check_spec_for_mesh(spec, mesh, where)  # noqa: E731
        in_specs = map_specs(check, self.in_specs, f"{self.what}: in_specs")
        return in_specs, map_specs(check, self.out_specs, f"{self.what}: out_specs")

    def _layout(self, mesh: Mesh | AbstractMesh, dyn: tuple[Any, ...], treedef: Any) -> Layout:
        layout = self._layouts.get((mesh, treedef))
        if layout is not None:
            return layout
        in_specs, out_specs = self._mesh_specs(mesh)
        raw = self.in_specs
        if is_spec_leaf(raw):
            specs: tuple[Any, ...] = (in_specs,) * len(dyn)
            raws: tuple[Any, ...] = (raw,) * len(dyn)
        else:
            if len(raw) != len(dyn):
                raise MeshkitError(
                    f"{self.what}: in_specs has {len(raw)} entries but the "
                    f"function was called with {len(dyn)} (non-static) positional arguments.\n"
                    "Consider one spec (or pytree of specs) per argument; static_argnums take "
                    "none."
                )
            raws = tuple(
                align_specs(r, a, where=f"{self.what}: in_specs[{i}]")
                for i, (r, a) in enumerate(zip(raw, dyn, strict=True))
            )
            specs = tuple(map_specs(as_partition_spec, r, "in_specs") for r in raws)
        # Per leaf of ``dyn`` in flattening order: its spec, its spec as written, its name.
        paths = [f"args{keystr(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(dyn)[0]]
        per_leaf = [broadcast_prefix(tree, dyn, is_leaf=is_spec_leaf) for tree in (specs, raws)]
        leaves = list(zip(*per_leaf, paths, strict=True))
        jitted = plan = None
        if isinstance(mesh, Mesh):  # an AbstractMesh (met while tracing): body only
            plan = argument_plan(mesh, tuple(s for s, _, _ in leaves), tuple(w for *_, w in leaves))
            jitted = _placement.jit_over_shard_map(
                lambda *args: self._body(mesh, *args),
                self.name,
                in_shardings=jax.tree_util.tree_unflatten(treedef, plan.targets),
                static_argnums=self.static_argnums,
                donate_argnums=self.donate_argnums,
            )
        warn = self.warn_reshard
        layout = Layout(jitted, plan, self.what, _TAG, warn, mesh, specs, leaves, out_specs)
        self._layouts[(mesh, treedef)] = layout
        return layout

    def _body(self, mesh: Mesh | AbstractMesh, *args: Any) -> Any:
        static = self.static_argnums
        dyn = dynamic(args, static)
        flat, treedef = jax.tree_util.tree_flatten(dyn)
        layout = self._layout(mesh, dyn, treedef)
        self._check_args(flat, layout)
        if any(t == AxisType.Explicit for t in mesh.axis_types):
            # Every value gets the sharding type its spec asks for.
            for k, (leaf, (s, _, where)) in enumerate(zip(flat, layout.leaves, strict=True)):
                have = getattr(jax.typeof(leaf), "sharding", None)
                have_spec = have.spec if have is not None else PartitionSpec()
                if dim_axes(have_spec, np.ndim(leaf)) != dim_axes(s, np.ndim(leaf)):
                    if spec_axes(have_spec):
                        self.warn_reshard(where, f"a value typed {have_spec}", s, mesh)
                    flat[k] = jax.reshard(leaf, NamedSharding(mesh, s))
            dyn = jax.tree_util.tree_unflatten(treedef, flat)
        # Outputs matched to out_specs by keys go through shard_map in out_specs' node types;
        # ``back`` holds what turns them back: the output's treedef and its leaves' order.
        back: list[Any] = []
        where = f"{self.what}: out_specs"

        def per_device(*local: Any) -> Any:
            it = iter(local)
            full = [args[i] if i in static else next(it) for i in range(len(args))]
            out = self.fn(*full)
            raws = align_specs(self.out_specs, out, where=where, noun="the output")
            per_leaf = broadcast_prefix(raws, out, is_leaf=is_spec_leaf)
            with_path, treedef = jax.tree_util.tree_flatten_with_path(out)
            for (path, leaf), raw in zip(with_path, per_leaf, strict=True):
                dims = parse_spec(raw).dims if isinstance(raw, str) else None
                if dims is not None and len(dims) != np.ndim(leaf):  # a block has the output's rank
                    raise MeshkitError(
                        f"{self.what}: output out{keystr(path)} has rank {np.ndim(leaf)} but its "
                        f"spec {raw!r} names {_count(len(dims), 'dimension')}."
                    )
            if not self.keyed_out:
                return out
            order = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
            order = align_specs(self.out_specs, order, where=where, back=True)
            back[:] = [treedef, jax.tree_util.tree_leaves(order)]
            return align_specs(self.out_specs, out, where=where, back=True)

        result = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=layout.specs,
            out_specs=layout.out_specs,
            check_vma=self.check_vma,
        )(*dyn)
        if not self.keyed_out:
            return result
        treedef, order = back
        by_index = dict(zip(order, jax.tree_util.tree_leaves(result), strict=True))
        return jax.tree_util.tree_unflatten(treedef, [by_index[i] for i in range(len(order))])

    def _check_args(self, flat: list[Any], layout: Layout) -> None:
        """Rank and divisibility of every leaf against its spec, with dims named."""
        sizes = layout.mesh.shape
        for leaf, (s, raw, where) in zip(flat, layout.leaves, strict=True):
            shape = np.shape(leaf)
            dims = parse_spec(raw).dims if isinstance(raw, str) else None
            if dims is not None and len(dims) != len(shape):
                raise MeshkitError(
                    f"{self.what}: {where} has shape {tuple(shape)} (rank {len(shape)}) "
                    f"but its spec {raw!r} names {_count(len(dims), 'dimension')}."
                )
            if len(s) > len(shape):
                raise MeshkitError(
                    f"{self.what}: {where} has shape {tuple(shape)} (rank {len(shape)}) "
                    f"but its spec {s} has {_count(len(s), 'entry', 'entries')}.\nConsider a "
                    f"spec with at most {_count(len(shape), 'entry', 'entries')}, or P() for an "
                    "argument every device gets whole."
                )
            for d, axes in enumerate(dim_axes(s, len(shape))):
                n = math.prod(sizes[a] for a in axes)
                if axes and shape[d] % n:
                    label = f"dimension {d} ({dims[d]!r})" if dims else f"dimension {d}"
                    raise MeshkitError(
                        f"{self.what}: {where} has shape {tuple(shape)}; its {label} "
                        f"of size {shape[d]} is split over the mesh axes {axes} of total size "
                        f"{n}, which does not divide it (spec {raw!r}, mesh "
                        f"{dict(sizes)}).\nConsider padding that dimension to a multiple of {n}."
                    )

    def _remember(self, tree: Any, leaves: list[Any], shardings: list[Any], jitted: Any) -> None:
        """Keep what `__call__` compares a call with (arrays of one type as the arguments: flat)."""
        kind = type(leaves[0]) if leaves and not self.static_argnums else object
        same = issubclass(kind, jax.Array) and all(type(x) is kind for x in leaves)
        flat = same and tree == jax.tree_util.tree_structure((0,) * len(leaves))
        self._last = (tree, shardings, jitted, kind if flat else None)

    def _call(self, mesh: Mesh, args: tuple[Any, ...], lower: bool = False) -> Any:
        """Classify the arguments (`placement`), place what needs it, call jit once."""
        static = self.static_argnums
        dyn = dynamic(args, static)
        leaves, treedef = jax.tree_util.tree_flatten(dyn)
        layout = self._layouts.get((mesh, treedef))
        if layout is not None and layout.steady is not None and layout.steady.placed(leaves):
            if mesh is self.mesh and not lower:  # placed as a past call put them
                self._remember(treedef, leaves, layout.steady.shardings, layout.jitted)
            return (layout.jitted.lower if lower else layout.jitted)(*args)
        traced = any(isinstance(leaf, Tracer) for leaf in leaves)
        local = []
        if mesh.is_multi_process and not traced:
            local = [i for i, leaf in enumerate(leaves) if _placement.is_local(leaf)]
        try:
            layout = self._layout(mesh, dyn, treedef)
        except Exception as e:
            if local:  # published, so that it reaches the processes waiting in the assembly too
                tagged = _assembly.check_tag(_channel.scoped(_TAG, "meshkit.spmd"))
                _assembly.publish_failure(tagged, e)
            raise
        assert layout.plan is not None  # a concrete mesh is made of devices
        if traced:
            # Traced inside another jit: host values are program constants, the same in every
            # process. Across processes they are put here (jit refuses host data with a sharding).
            flat = leaves
            if mesh.is_multi_process:
                flat = [
                    _placement.from_host(x, t) if _placement.is_host(x) else x
                    for x, t in zip(leaves, layout.plan.targets, strict=True)
                ]
        else:
            if local:  # this process's parts, assembled into global arrays
                raws = [layout.leaves[i][1] for i in local]
                leaves = _placement.assemble(
                    layout.plan,
                    leaves,
                    local,
                    what=self.what,
                    tag=_TAG,
                    specs=raws,
                    treedef=treedef,
                )
            self._check_args(leaves, layout)
            flat = layout.place(leaves, treedef)
            if mesh is self.mesh and not lower:
                self._remember(treedef, flat, layout.plan.shardings, layout.jitted)
        it = iter(jax.tree_util.tree_unflatten(treedef, flat))
        args = tuple(args[i] if i in static else next(it) for i in range(len(args)))
        return (layout.jitted.lower if lower else layout.jitted)(*args)


def _check_leaf(s: Any, where: str) -> PartitionSpec:
    if s is None:
        raise MeshkitError(
            f"meshkit.{where} is None. Consider P() or '' for a value every device gets whole "
            "(None is only allowed at static_argnums positions)."
        )
    return as_partition_spec(s, f"meshkit.{where}")


@overload
def spmd(
    f: Callable[..., Any],
    *,
    mesh: Mesh | None = ...,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = ...,
    donate_argnums: int | Sequence[int] = ...,
    static_argnums: int | Sequence[int] = ...,
) -> SpmdFunction: ...


@overload
def spmd(
    f: None = None,
    *,
    mesh: Mesh | None = ...,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = ...,
    donate_argnums: int | Sequence[int] = ...,
    static_argnums: int | Sequence[int] = ...,
) -> Callable[[Callable[..., Any]], SpmdFunction]: ...


@public
def spmd(
    f: Callable[..., Any] | None = None,
    *,
    mesh: Mesh | None = None,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
) -> SpmdFunction | Callable[[Callable[..., Any]], SpmdFunction]:
    """Run ``f`` once per device of ``mesh`` on its block of each argument, compiled by jit.

    The same as ``jax.jit(jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...))``, within a
    microsecond or two per call on arguments laid out per ``in_specs``, but it also places host
    data and single-device arrays per ``in_specs`` (in a multi-process run, this process's part,
    as for `meshkit.global_array_from_local`), reshards arrays laid out differently (a
    `ReshardWarning` the first time), and works on Auto and Explicit meshes, inside
    ``jax.set_mesh`` and inside another `jax.jit`.

    Args:
        f: the per-device function; `meshkit.collectives` work inside it over the mesh axes.
            Omit it to use ``spmd`` as a decorator.
        mesh: the mesh to run on; None takes the mesh of the enclosing ``jax.set_mesh``.
        in_specs: one spec per positional argument (a `PartitionSpec`, a spec string such as
            ``"batch seq -> data _"``, or a pytree of them matching the argument), or one spec
            for all arguments. Static arguments take none (or None in their position).
        out_specs: the spec (or pytree of specs) of the outputs; an axis that a spec leaves out
            means the output is the same on every device along it.
        check_vma: let JAX check that outputs claimed replicated are (see `jax.shard_map`).
        donate_argnums: positional arguments whose buffers may be reused for outputs.
        static_argnums: positional arguments passed as hashable Python values, as in `jax.jit`.

    Returns:
        An `SpmdFunction`: call it with positional arguments; ``.lower(*args)`` lowers it.

    Raises:
        MeshkitError: a spec names an axis the mesh lacks, an argument's shape does not split
            per its spec, or ``in_specs`` does not match the arguments; in a multi-process run,
            also when processes pass host arguments that do not fit together, or one fails or
            does not arrive within ``MESHKIT_CHECK_TIMEOUT`` seconds.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit import collectives as C
        >>> mesh = meshkit.make_mesh({"data": 4, "model": 2})
        >>> @meshkit.spmd(mesh=mesh, in_specs="batch feat -> data model", out_specs="data _")
        ... def row_sums(block):
        ...     return C.psum(block.sum(axis=1, keepdims=True), "model")
        >>> row_sums(np.ones((8, 6), np.float32)).ravel().tolist()
        [6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0]
    """
    wrap = functools.partial(SpmdFunction, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=check_vma, donate_argnums=donate_argnums,
                             static_argnums=static_argnums)  # fmt: skip
    return wrap if f is None else wrap(f)


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"
