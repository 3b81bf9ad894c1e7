"""`spmd`: per-device code over a mesh, as ``jax.jit(jax.shard_map(f, ...))`` with input placement.

A call is one `jax.jit` dispatch whose ``in_shardings`` are the ``in_specs``. The arguments are
classified before it (`meshkit._src.spmd.placement`), never retried: when every leaf is already laid
out as its spec says (the steady state), jit is called at once; otherwise meshkit checks the
shapes against the specs (its own messages), puts host data (numpy, Python scalars) in one
batched call, moves arrays laid out differently (warning once per argument), and then calls.
Each signature is traced once. Every call first passes `meshkit._src.runtime.dispatch.enter`.

In a multi-process run, host data and process-local (fully addressable) arrays are *this
process's part* of the argument, exactly as `meshkit.global_array_from_local` defines it: along
a dimension split across processes, the rows this process's devices hold; other dimensions
whole. All such leaves of a call are assembled together, through `_global`'s protocol, before
jit is called, so the processes compare structure, shapes and dtypes once per call (one small
message through the coordination service) and a mismatch is an error naming the processes, not
a hang. Single-process, host data is the whole value, which is the same thing.

Meshes with Explicit axes (``jax.make_mesh``'s default) type their arrays by sharding, and
`jax.shard_map` demands that the type match ``in_specs``; inside the jitted function meshkit
reshards values whose type differs. That costs nothing when the data is already where the spec
puts it (host data placed through ``in_shardings``) and is one explicit reshard otherwise.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from ..core import compat as _compat
from ..core.errors import MeshkitError
from ..core.frames import user_stacklevel
from ..runtime import dispatch as _dispatch
from ..sharding.spec_trees import (
    align_specs,
    describe_node,
    has_mapping,
    plain_specs,
    to_spec_types,
)
from ..sharding.specs import (
    as_partition_spec,
    check_spec_for_mesh,
    dim_axes,
    is_spec_leaf,
    map_specs,
    parse_spec,
    spec_axes,
)
from . import placement as _placement

__all__ = ["ReshardWarning", "SpmdFunction", "spmd"]


class ReshardWarning(UserWarning):
    """An argument of an spmd function arrived laid out differently from its ``in_specs``.

    meshkit moves it with one reshard per call and warns once per function and argument.
    """


_RESHARD_FIX = """\
Consider producing it with that sharding (for example as the out_specs of the step that makes
it), or moving it once outside the loop: jax.device_put(x, {target})."""


def fn_name(f: Callable[..., Any]) -> str:
    """The name messages give a user's function (``pmap_compat`` uses it too)."""
    name = getattr(f, "__name__", None) or repr(f)
    return str(name)


def from_host(value: Any, target: NamedSharding) -> jax.Array:
    """Host data, the same in every process, as a global array laid out by ``target``."""
    arr = np.asarray(value)
    return jax.make_array_from_callback(arr.shape, target, lambda idx: arr[idx])


class _Local:
    """A process-local leaf of an spmd call, with its spec and its name in messages."""

    def __init__(self, value: Any, spec: Any, where: str) -> None:
        self.value = value
        self.spec = spec
        self.where = where


_TAG = "spmd"  # the coordination-service exchanges of spmd's host arguments


class _Layout:
    """One structure of the dynamic arguments: their specs aligned to it, its jit, its targets.

    ``specs`` and ``raws`` hold one spec tree per argument, rebuilt in the argument's node
    types (`meshkit._src.sharding.spec_trees.align_specs`), so JAX takes them as prefixes:
    ``specs`` in `PartitionSpec` form, ``raws`` as the user wrote the leaves (strings name
    dimensions).
    """

    def __init__(self, specs: tuple[Any, ...], raws: tuple[Any, ...], jitted: Any) -> None:
        self.specs = specs
        self.raws = raws
        self.jitted = jitted
        # Each leaf's sharding once placed (for the steady-state test); None until then.
        self.targets: list[NamedSharding] | None = None


class _Plan:
    """Everything fixed once the mesh is known: specs, shardings, the jitted function."""

    def __init__(self, owner: SpmdFunction, mesh: Mesh | AbstractMesh) -> None:
        self.owner = owner
        self.mesh = mesh
        name = owner.name
        self.in_specs = map_specs(
            lambda s, w: check_spec_for_mesh(s, mesh, w), owner.in_specs,
            f"meshkit.spmd({name}): in_specs",
        )  # fmt: skip
        self.out_specs = map_specs(
            lambda s, w: check_spec_for_mesh(s, mesh, w), owner.out_specs,
            f"meshkit.spmd({name}): out_specs",
        )  # fmt: skip
        # out_specs with mappings are matched to the outputs by keys (see `body`).
        self.keyed_out = has_mapping(owner.out_specs)
        self.explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
        self.multiprocess = isinstance(mesh, Mesh) and mesh.is_multi_process
        # Per structure of the dynamic arguments (a treedef): specs aligned to it, its jit.
        self.layouts: dict[Any, _Layout] = {}

    def layout(self, dyn: tuple[Any, ...], treedef: Any = None) -> _Layout:
        """The `_Layout` of this structure of the dynamic arguments (made on first sight)."""
        if treedef is None:
            treedef = jax.tree_util.tree_structure(dyn)
        found = self.layouts.get(treedef)
        if found is not None:
            return found
        owner = self.owner
        raw = owner.in_specs
        if is_spec_leaf(raw):
            specs: tuple[Any, ...] = (self.in_specs,) * len(dyn)
            raws: tuple[Any, ...] = (raw,) * len(dyn)
        else:
            if len(raw) != len(dyn):
                raise MeshkitError(
                    f"meshkit.spmd({owner.name}): in_specs has {len(raw)} entries but the "
                    f"function was called with {len(dyn)} (non-static) positional arguments.\n"
                    "Consider one spec (or pytree of specs) per argument; static_argnums take "
                    "none."
                )
            raws = tuple(
                align_specs(r, a, where=f"meshkit.spmd({owner.name}): in_specs[{i}]")
                for i, (r, a) in enumerate(zip(raw, dyn, strict=True))
            )
            specs = tuple(
                jax.tree_util.tree_map(
                    lambda s: as_partition_spec(s, "in_specs"), r, is_leaf=is_spec_leaf
                )
                for r in raws
            )
        jitted = None
        if isinstance(self.mesh, Mesh):  # an AbstractMesh (met while tracing): body only
            mesh = self.mesh
            shardings = jax.tree_util.tree_map(
                lambda s: NamedSharding(mesh, s),
                self.in_specs if is_spec_leaf(raw) else specs,
                is_leaf=is_spec_leaf,
            )

            def body(*args: Any) -> Any:
                return self.body(*args)

            # Named after the user's function, so HLO dumps and profiles tell them apart.
            body.__name__ = body.__qualname__ = owner.name
            jitted = jax.jit(
                body,
                in_shardings=shardings,
                static_argnums=owner.static_argnums,
                donate_argnums=owner.donate_argnums,
            )
        made = self.layouts[treedef] = _Layout(specs, raws, jitted)
        return made

    # ---- trace time -------------------------------------------------------------------------

    def body(self, *args: Any) -> Any:
        owner = self.owner
        static = owner.static_argnums
        dyn = self.dynamic(args)
        layout = self.layout(dyn)
        self.check_args(dyn, layout)
        if self.explicit:
            dyn = self.reshard_typed(dyn, layout)
        # Outputs matched to out_specs by keys go through shard_map in out_specs' node types;
        # ``back`` holds what turns them back: the output's treedef and its leaves' order.
        back: list[Any] = []
        where = f"meshkit.spmd({owner.name}): out_specs"

        def per_device(*local: Any) -> Any:
            it = iter(local)
            full = [args[i] if i in static else next(it) for i in range(len(args))]
            out = owner.fn(*full)
            raws = align_specs(owner.out_specs, out, where=where, noun="the output")
            self.check_outputs(out, raws)  # a block has the rank of the global output
            if not self.keyed_out:
                return out
            treedef = jax.tree_util.tree_structure(out)
            order = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
            back[:] = [treedef, jax.tree_util.tree_leaves(to_spec_types(owner.out_specs, order))]
            return to_spec_types(owner.out_specs, out)

        result = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=layout.specs,
            out_specs=self.out_specs,
            check_vma=owner.check_vma,
        )(*dyn)
        if not self.keyed_out:
            return result
        treedef, order = back
        leaves: list[Any] = [None] * len(order)
        for i, leaf in zip(order, jax.tree_util.tree_leaves(result), strict=True):
            leaves[i] = leaf
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def dynamic(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The arguments that are not static (those in_specs describe)."""
        static = self.owner.static_argnums
        return tuple(a for i, a in enumerate(args) if i not in static)

    def each_leaf(self, args: tuple[Any, ...], layout: _Layout, fn: Callable[..., Any]) -> Any:
        """Map ``fn(leaf, spec, raw_spec, path)`` over the leaves of ``args`` under their specs."""
        keystr = jax.tree_util.keystr

        def per_arg(i: int) -> Any:
            def visit(at: Any, s: PartitionSpec, r: Any, sub: Any) -> Any:
                return jax.tree_util.tree_map_with_path(
                    lambda p, leaf: fn(leaf, s, r, f"args[{i}]{keystr(at)}{keystr(p)}"), sub
                )

            return jax.tree_util.tree_map_with_path(
                visit, layout.specs[i], layout.raws[i], args[i], is_leaf=is_spec_leaf
            )

        return tuple(per_arg(i) for i in range(len(args)))

    def check_args(self, dyn: tuple[Any, ...], layout: _Layout) -> None:
        """Rank and divisibility of every argument against its spec, with dims named."""
        name = self.owner.name
        sizes = self.mesh.shape

        def check(leaf: Any, s: PartitionSpec, raw: Any, where: str) -> None:
            shape = np.shape(leaf)
            dims = parse_spec(raw).dims if isinstance(raw, str) else None
            if dims is not None and len(dims) != len(shape):
                raise MeshkitError(
                    f"meshkit.spmd({name}): {where} has shape {tuple(shape)} (rank {len(shape)}) "
                    f"but its spec {raw!r} names {_count(len(dims), 'dimension')}."
                )
            if len(s) > len(shape):
                raise MeshkitError(
                    f"meshkit.spmd({name}): {where} has shape {tuple(shape)} (rank {len(shape)}) "
                    f"but its spec {s} has {_count(len(s), 'entry', 'entries')}.\nConsider a "
                    f"spec with at most {_count(len(shape), 'entry', 'entries')}, or P() for an "
                    "argument every device gets whole."
                )
            for d, axes in enumerate(dim_axes(s, len(shape))):
                n = int(np.prod([sizes[a] for a in axes], dtype=np.int64))
                if axes and shape[d] % n:
                    label = f"dimension {d} ({dims[d]!r})" if dims else f"dimension {d}"
                    raise MeshkitError(
                        f"meshkit.spmd({name}): {where} has shape {tuple(shape)}; its {label} "
                        f"of size {shape[d]} is split over the mesh axes {axes} of total size "
                        f"{n}, which does not divide it (spec {raw!r}, mesh "
                        f"{dict(sizes)}).\nConsider padding that dimension to a multiple of {n}."
                    )

        self.each_leaf(dyn, layout, check)

    def reshard_typed(self, dyn: tuple[Any, ...], layout: _Layout) -> tuple[Any, ...]:
        """On Explicit meshes, give every value the sharding type its spec asks for."""

        def fix(leaf: Any, s: PartitionSpec, raw: Any, where: str) -> Any:
            ndim = np.ndim(leaf)
            have = getattr(jax.typeof(leaf), "sharding", None)
            have_spec = have.spec if have is not None else PartitionSpec()
            if dim_axes(have_spec, ndim) == dim_axes(s, ndim):
                return leaf
            if spec_axes(have_spec):
                self.owner.warn_reshard(where, f"a value typed {have_spec}", s, self.mesh)
            return jax.reshard(leaf, NamedSharding(self.mesh, s))

        return self.each_leaf(dyn, layout, fix)

    def check_outputs(self, out: Any, raws: Any) -> None:
        """Each output's rank against the dimensions its spec string names.

        ``raws`` is out_specs as written, aligned to ``out`` (`align_specs`).
        """
        name = self.owner.name

        def check(leaf: Any, s: PartitionSpec, raw: Any, where: str) -> None:
            dims = parse_spec(raw).dims if isinstance(raw, str) else None
            if dims is not None and len(dims) != np.ndim(leaf):
                raise MeshkitError(
                    f"meshkit.spmd({name}): output {where} has rank {np.ndim(leaf)} but its spec "
                    f"{raw!r} names {_count(len(dims), 'dimension')}."
                )

        jax.tree_util.tree_map(
            lambda r, sub: jax.tree_util.tree_map_with_path(
                lambda p, leaf: check(leaf, as_partition_spec(r, "out_specs"), r,
                                      f"out{jax.tree_util.keystr(p)}"), sub
            ),
            raws, out, is_leaf=is_spec_leaf,
        )  # fmt: skip

    # ---- call time: classify, then call ------------------------------------------------------

    def call(self, args: tuple[Any, ...], lower: bool = False) -> Any:
        """Classify the arguments (`placement`), place what needs it, call jit once."""
        dyn = self.dynamic(args)
        leaves, treedef = jax.tree_util.tree_flatten(dyn)
        layout = self.layouts.get(treedef)
        if (
            layout is not None
            and layout.targets is not None
            and _compat.trace_state_clean()
            and _placement.placed(leaves, layout.targets)
        ):
            # The steady state: every leaf already where in_specs puts it.
            return (layout.jitted.lower if lower else layout.jitted)(*args)
        if any(isinstance(leaf, Tracer) for leaf in leaves):
            layout = self.layout(dyn, treedef)
            args = self.traced(args, layout)
        elif self.multiprocess and any(_placement.is_local(leaf) for leaf in leaves):
            # This process's parts, as global arrays (the layout is made inside, so that a
            # spec error there reaches the other processes too).
            args, layout = self.assemble_local(args, treedef)
            args = self.place(args, layout)
        else:
            layout = self.layout(dyn, treedef)
            args = self.place(args, layout)
        return (layout.jitted.lower if lower else layout.jitted)(*args)

    def traced(self, args: tuple[Any, ...], layout: _Layout) -> tuple[Any, ...]:
        """Arguments of a call traced inside another jit: host values are program constants.

        Constants are the same in every process (the global value), as jit itself treats them;
        jit places them in one process, and they are put here across processes (jit refuses
        host data with a sharding there).
        """
        if not self.multiprocess:
            return args
        dyn = self.dynamic(args)
        const = lambda leaf, s, raw, where: (  # noqa: E731
            from_host(leaf, NamedSharding(self.mesh, s)) if _placement.is_host(leaf) else leaf
        )
        return self.with_dynamic(args, self.each_leaf(dyn, layout, const))

    def place(self, args: tuple[Any, ...], layout: _Layout) -> tuple[Any, ...]:
        """Every argument where its spec puts it: meshkit's checks, then moves and puts.

        Arrays in another layout are moved (a `ReshardWarning` the first time, unless they sat
        on one device); host data is put in one batched call. The leaves' targets are kept per
        structure for the steady-state test of the next call.
        """
        dyn = self.dynamic(args)
        self.check_args(dyn, layout)
        targets: list[NamedSharding] = []

        def put(leaf: Any, s: PartitionSpec, raw: Any, where: str) -> Any:
            target = NamedSharding(self.mesh, s)
            targets.append(target)
            if _placement.is_host(leaf):
                return _Host(leaf, target)
            if leaf.sharding == target or leaf.sharding.is_equivalent_to(target, leaf.ndim):
                return leaf
            if len(leaf.sharding.device_set) > 1:
                self.owner.warn_reshard(where, f"sharding {leaf.sharding}", s, self.mesh)
            return jax.device_put(leaf, target)

        marked = self.each_leaf(dyn, layout, put)
        flat, tree = jax.tree_util.tree_flatten(marked, is_leaf=lambda x: isinstance(x, _Host))
        hosts = [i for i, m in enumerate(flat) if isinstance(m, _Host)]
        values = _placement.put_host(
            [flat[i].value for i in hosts], [flat[i].target for i in hosts]
        )
        for i, value in zip(hosts, values, strict=True):
            flat[i] = value
        layout.targets = targets
        return self.with_dynamic(args, jax.tree_util.tree_unflatten(tree, flat))

    def with_dynamic(self, args: tuple[Any, ...], dyn: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` with its dynamic (non-static) arguments replaced by ``dyn``."""
        static = self.owner.static_argnums
        it = iter(dyn)
        return tuple(args[i] if i in static else next(it) for i in range(len(args)))

    def assemble_local(
        self, args: tuple[Any, ...], treedef: Any
    ) -> tuple[tuple[Any, ...], _Layout]:
        """The call's process-local leaves assembled into global arrays, in one assembly.

        In a multi-process run, host data and addressable arrays are this process's part of
        the argument, as `meshkit.global_array_from_local` defines it; the processes compare
        structure, shapes and dtypes once per call (and, in debug mode, the data of blocks
        that several processes provide) through the coordination service.
        """
        dyn = self.dynamic(args)
        mesh = self.mesh
        assert isinstance(mesh, Mesh)  # multi-process plans have a concrete mesh
        try:
            layout = self.layout(dyn, treedef)
            marked = self.each_leaf(
                dyn,
                layout,
                lambda leaf, s, raw, where: (
                    _Local(leaf, raw, where) if _placement.is_local(leaf) else leaf
                ),
            )
        except Exception as e:  # the others are waiting for this process's record
            _placement.publish_failure(_TAG, e)
            raise
        flat, tree = jax.tree_util.tree_flatten(marked, is_leaf=lambda x: isinstance(x, _Local))
        local = [i for i, m in enumerate(flat) if isinstance(m, _Local)]
        assembled = _placement.assemble(
            [(flat[i].where, flat[i].value) for i in local],
            mesh,
            [flat[i].spec for i in local],
            what=f"meshkit.spmd({self.owner.name})",
            tag=_TAG,
            structure=jax.tree_util.tree_unflatten(
                tree, [m if isinstance(m, _Local) else None for m in flat]
            ),
        )
        for i, value in zip(local, assembled, strict=True):
            flat[i] = value
        return self.with_dynamic(args, jax.tree_util.tree_unflatten(tree, flat)), layout


class _Host:
    """A host leaf of an spmd call and where it goes (put with the others in one call)."""

    def __init__(self, value: Any, target: NamedSharding) -> None:
        self.value = value
        self.target = target


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
        self.name = fn_name(fn)
        if mesh is not None and not isinstance(mesh, Mesh):
            raise MeshkitError(
                f"meshkit.spmd({self.name}): mesh must be a jax.sharding.Mesh (e.g. from "
                f"meshkit.make_mesh) or None for the mesh of jax.set_mesh; got {mesh!r}."
            )
        self.static_argnums = _argnums(static_argnums, "static_argnums", self.name)
        self.donate_argnums = _argnums(donate_argnums, "donate_argnums", self.name)
        if isinstance(in_specs, Mapping):
            raise MeshkitError(
                f"meshkit.spmd({self.name}): in_specs must be one spec for every argument, or a "
                f"tuple with one entry per positional argument; got {describe_node(in_specs)}.\n"
                "Consider in_specs=(specs,) if it describes the first argument."
            )
        # flax's partition specs (nnx Variables of specs, linen boxes) stand for their specs.
        self.in_specs = self._drop_static(plain_specs(in_specs))
        self.out_specs = plain_specs(out_specs)
        for tree, what in ((self.in_specs, "in_specs"), (out_specs, "out_specs")):
            map_specs(lambda s, w: _check_leaf(s, w), tree, f"spmd({self.name}): {what}")
        self.check_vma = bool(check_vma)
        self.mesh = mesh
        self._site = _dispatch.CallSite(
            "spmd",
            self.name,
            info={
                "mesh": mesh,
                "params": _dispatch.param_names(fn),
                "origin": _dispatch.origin(fn),
                "static_argnums": self.static_argnums,
            },
        )
        self._warned: set[str] = set()
        self._plans: dict[Mesh | AbstractMesh, _Plan] = {}
        self._plan = _Plan(self, mesh) if mesh is not None else None

    def _drop_static(self, in_specs: Any) -> Any:
        """Accept in_specs with None at the static positions too (one entry per parameter)."""
        static = self.static_argnums
        if (
            static
            and isinstance(in_specs, tuple | list)
            and all(i < len(in_specs) and in_specs[i] is None for i in static)
        ):
            return tuple(s for i, s in enumerate(in_specs) if i not in static)
        return tuple(in_specs) if isinstance(in_specs, list) else in_specs

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

    def _plan_for_call(self) -> _Plan | None:
        """The plan for this call's mesh; None when called while tracing without a mesh."""
        if self._plan is not None:
            return self._plan
        if not _compat.trace_state_clean():
            return None  # traced (inside jax.jit): only the abstract mesh is known
        return self._context_plan(jax.sharding.get_mesh(), "called")

    def _context_plan(self, mesh: Mesh | AbstractMesh, when: str) -> _Plan:
        """The plan for the mesh of the enclosing ``jax.set_mesh`` (made on first use)."""
        if mesh.empty:
            raise MeshkitError(
                f"meshkit.spmd({self.name}) has no mesh: it was made with mesh=None and {when} "
                "outside `with jax.set_mesh(mesh):`.\nConsider passing mesh= to meshkit.spmd."
            )
        plan = self._plans.get(mesh)
        if plan is None:
            plan = self._plans[mesh] = _Plan(self, mesh)
        return plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise MeshkitError(
                f"meshkit.spmd({self.name}) takes positional arguments only (in_specs are "
                f"positional); got keywords {sorted(kwargs)}."
            )
        _dispatch.enter(self._site, args)
        plan = self._plan if self._plan is not None else self._plan_for_call()
        if plan is None:  # traced inside jax.jit: shard_map over the abstract mesh
            return self._context_plan(jax.sharding.get_abstract_mesh(), "traced").body(*args)
        return plan.call(args)

    def lower(self, *args: Any) -> Any:
        """Lower for these arguments, like `jax.jit(...).lower` (to inspect HLO or compile)."""
        plan = self._plan_for_call()
        if plan is None:
            raise MeshkitError(f"meshkit.spmd({self.name}).lower needs a concrete mesh.")
        return plan.call(args, lower=True)

    @property
    def calls(self) -> int:
        """How many times this function has been called in this process."""
        return self._site.calls

    def __repr__(self) -> str:
        mesh = dict(self.mesh.shape) if self.mesh is not None else "from jax.set_mesh"
        return f"<meshkit.spmd {self.name} mesh={mesh}>"


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _check_leaf(s: Any, where: str) -> PartitionSpec:
    if s is None:
        raise MeshkitError(
            f"meshkit.{where} is None. Consider P() or '' for a value every device gets whole "
            "(None is only allowed at static_argnums positions)."
        )
    return as_partition_spec(s, f"meshkit.{where}")


def _argnums(value: int | Sequence[int], what: str, name: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else tuple(value)
    for i in items:
        if not isinstance(i, int) or i < 0:
            raise MeshkitError(
                f"meshkit.spmd({name}): {what} must be non-negative ints; got {value!r}."
            )
    return tuple(sorted(set(items)))


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

    The same as ``jax.jit(jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...))``, and as
    fast on arguments already laid out per ``in_specs``, but it also takes:

    * host data (numpy arrays, Python scalars) and single-device arrays: placed per
      ``in_specs``. In a multi-process run, host data and process-local (fully addressable)
      arrays are **this process's part** of the global argument, as for
      `meshkit.global_array_from_local`: along a dimension split across processes, the rows
      its devices hold (`meshkit.process_slice` says which); dimensions not split across
      processes whole; parts that several processes hold (``P()``, say) must be equal. The
      processes compare structure, shapes and dtypes once per call through the coordination
      service (with `meshkit.debug` on, also the data of those shared parts);
    * arrays laid out differently: moved with one reshard per call, and a `ReshardWarning`
      the first time;
    * meshes with Explicit axis types (``jax.make_mesh``'s default) as well as Auto ones, and
      calls inside ``jax.set_mesh`` or inside another `jax.jit`.

    Args:
        f: the per-device function. Inside it, each argument is this device's block and
            `meshkit.collectives` work over the mesh axes. Omit it to use ``spmd`` as a
            decorator.
        mesh: the mesh to run on; None takes the mesh of the enclosing ``jax.set_mesh``.
        in_specs: one spec per positional argument (a `PartitionSpec`, a spec string such as
            ``"batch seq -> data _"``, or a pytree of them matching the argument), or a single
            spec for all arguments. Static arguments take no spec (or None in their position).
        out_specs: the spec (or pytree of specs) of the outputs; an axis that a spec leaves out
            means the output is the same on every device along it.
        check_vma: let JAX check that outputs claimed replicated really are (see
            `jax.shard_map`).
        donate_argnums: positional arguments whose buffers may be reused for outputs.
        static_argnums: positional arguments passed as Python values (hashable), as in
            `jax.jit`.

    Returns:
        An `SpmdFunction`: call it with positional arguments; ``.lower(*args)`` lowers it.

    Raises:
        MeshkitError: for specs that name axes the mesh lacks, arguments whose shape does not
            split per their spec (naming the argument, its shape, the dimension and the sizes),
            or a mismatch between ``in_specs`` and the arguments. In a multi-process run, also
            when processes pass host arguments that do not fit together (a different structure,
            dtype or shape; naming the processes, the argument and the field), or when one of
            them fails or does not arrive within ``MESHKIT_CHECK_TIMEOUT`` seconds.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit import collectives as C
        >>> mesh = meshkit.make_mesh({"data": 4, "model": 2})
        >>> @meshkit.spmd(mesh=mesh, in_specs="batch feat -> data model", out_specs="data _")
        ... def row_sums(block):
        ...     return C.psum(block.sum(axis=1, keepdims=True), "model")
        >>> row_sums(np.ones((8, 6), np.float32)).ravel().tolist()
        [6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0]

        In a multi-process run each process passes its own rows: with 2 processes of 4
        devices and ``in_specs="data"`` over the mesh ``{"data": 8}``, process ``p`` passes
        its batch of 4 rows, rows ``4p`` to ``4p + 3`` of the global batch of 8, and
        ``C.psum(block.sum(), "data")`` inside ``f`` sums all 8 rows.
    """

    def wrap(fn: Callable[..., Any]) -> SpmdFunction:
        return SpmdFunction(
            fn,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=check_vma,
            donate_argnums=donate_argnums,
            static_argnums=static_argnums,
        )

    return wrap if f is None else wrap(f)
