"""`spmd`: per-device code over a mesh, as ``jax.jit(jax.shard_map(f, ...))`` with input placement.

Arguments are classified before the one jit call, never retried (`bound`, on `placement`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from ..core import canonical as _canonical
from ..core import compat as _compat
from ..core.errors import MeshkitError
from ..core.frames import user_stacklevel
from ..core.tracebacks import public
from ..runtime import dispatch as _dispatch
from ..sharding.spec_trees import describe_node, plain_specs
from ..sharding.specs import as_partition_spec, map_specs
from .bound import MeshPlan
from .placement import argnums


class ReshardWarning(UserWarning):
    """An argument of an spmd function arrived laid out differently from its ``in_specs``.

    meshkit moves it with one reshard per call and warns once per function and argument.
    """


_RESHARD_FIX = """\
Consider producing it with that sharding (for example as the out_specs of the step that makes
it), or moving it once outside the loop: jax.device_put(x, {target})."""


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
        what = f"meshkit.spmd({self.name})"
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
        for tree, what in ((self.in_specs, "in_specs"), (out_specs, "out_specs")):
            map_specs(_check_leaf, tree, f"spmd({self.name}): {what}")
        self.check_vma = bool(check_vma)
        self.mesh = mesh
        info = {"mesh": mesh, "params": _dispatch.param_names(fn), "origin": _dispatch.origin(fn)}
        info["static_argnums"] = self.static_argnums
        self._site = _dispatch.CallSite("spmd", self.name, info=info)
        self._warned: set[str] = set()
        self._plans: dict[Mesh | AbstractMesh, MeshPlan] = {}
        self._plan = MeshPlan(self, mesh) if mesh is not None else None

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

    def _plan_for_call(self) -> MeshPlan | None:
        """The plan for this call's mesh; None while tracing without one."""
        if self._plan is not None:
            return self._plan
        if not _compat.trace_state_clean():
            return None  # traced (inside jax.jit): only the abstract mesh is known
        return self._context_plan(jax.sharding.get_mesh(), "called")

    def _context_plan(self, mesh: Mesh | AbstractMesh, when: str) -> MeshPlan:
        """The plan for the mesh of the enclosing ``jax.set_mesh`` (made on first use)."""
        if mesh.empty:
            raise MeshkitError(
                f"meshkit.spmd({self.name}) has no mesh: it was made with mesh=None and {when} "
                "outside `with jax.set_mesh(mesh):`.\nConsider passing mesh= to meshkit.spmd."
            )
        if mesh not in self._plans:
            self._plans[mesh] = MeshPlan(self, mesh)
        return self._plans[mesh]

    @public
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = self._plan
        if plan is not None and not kwargs and _dispatch.quiet():
            jitted = plan.steady(args)
            if jitted is not None:  # every leaf already placed: straight to jit
                self._site.calls += 1
                return jitted(*args)
        return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise MeshkitError(
                f"meshkit.spmd({self.name}) takes positional arguments only (in_specs are "
                f"positional); got keywords {sorted(kwargs)}."
            )
        _dispatch.enter(self._site, args)
        plan = self._plan_for_call()
        if plan is None:  # traced inside jax.jit: shard_map over the abstract mesh
            return self._context_plan(jax.sharding.get_abstract_mesh(), "traced").body(*args)
        return plan.call(args)

    @public
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

    The same as ``jax.jit(jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...))``, and as
    fast on arguments already laid out per ``in_specs``, but it also places host data and
    single-device arrays per ``in_specs`` (in a multi-process run, this process's part, as for
    `meshkit.global_array_from_local`), reshards arrays laid out differently (a
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
