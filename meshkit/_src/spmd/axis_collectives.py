"""`meshkit.collectives`: named-axis collectives over one mesh axis or a group of them."""

from __future__ import annotations

import contextvars
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax import lax

from ..core import compat as _compat
from ..core.errors import MeshkitError
from ..core.frames import public

AxisName = str | tuple[str, ...]

_UNBOUND_FIX = """\
Consider calling it inside per-device code (meshkit.spmd or jax.shard_map) over a mesh that has
that axis; with partial shard_map (axis_names=...), only the listed axes are bound."""


class Interceptor(Protocol):
    """What `meshkit.testing`'s reference runner installs to stand in for the collectives."""

    def axis_sizes(self) -> Mapping[str, int]:
        """The axes bound in the simulated per-device code, with their sizes."""
        ...

    def run(self, op: str, x: Any, names: tuple[str, ...], **params: Any) -> Any:
        """Run collective ``op`` of this device's ``x`` over the group of ``names``."""
        ...


interceptor: contextvars.ContextVar[Interceptor | None] = contextvars.ContextVar(
    "meshkit_collectives_interceptor", default=None
)


def _describe_bound(bound: Mapping[Any, int]) -> str:
    if not bound:
        return "No axis is bound here."
    return "Bound axes: " + ", ".join(f"{n!r} (size {s})" for n, s in bound.items()) + "."


def _names(fn: str, axis_name: Any) -> tuple[tuple[str, ...], int, Interceptor | None]:
    """``axis_name`` checked as bound: the names as a tuple, the group size, the interceptor."""
    names = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    if not names:
        raise MeshkitError(
            f"meshkit.collectives.{fn}: axis_name is an empty tuple; name at least one mesh axis."
        )
    ctx = interceptor.get()
    bound = dict(ctx.axis_sizes()) if ctx is not None else _compat.bound_axis_sizes()
    for name in names:
        if not isinstance(name, str):
            raise MeshkitError(
                f"meshkit.collectives.{fn}: axis names must be strings; got {name!r} of type "
                f"{type(name).__name__}. {_describe_bound(bound)}"
            )
        if name not in bound:
            where = "" if bound else " (it was called outside per-device code)"
            raise MeshkitError(
                f"meshkit.collectives.{fn}: the axis name {name!r} is not bound here{where}. "
                f"{_describe_bound(bound)}\n{_UNBOUND_FIX}"
            )
    if len(set(names)) != len(names):
        raise MeshkitError(f"meshkit.collectives.{fn}: axis_name {names!r} names an axis twice.")
    return names, math.prod(bound[n] for n in names), ctx


def _axis_arg(names: tuple[str, ...]) -> AxisName:
    return names[0] if len(names) == 1 else names


def _varying(x: Any, names: tuple[str, ...]) -> Any:
    """``x`` typed varying over all ``names`` (check_vma refuses a partly invariant operand)."""

    def cast(leaf: Any) -> Any:
        vma = _compat.varying_axes(leaf)
        if not vma:  # untyped (check_vma=False), or invariant everywhere: JAX handles it
            return leaf
        missing = tuple(n for n in names if n not in vma)
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree_util.tree_map(cast, x)


def _dim(fn: str, arg: str, value: int, ndim: int, operand_ndim: int | None = None) -> int:
    """``value`` as a dimension in ``[0, ndim)``; the message shows the operand's own rank."""
    if not -ndim <= value < ndim:
        rank = ndim if operand_ndim is None else operand_ndim
        raise MeshkitError(
            f"meshkit.collectives.{fn}: {arg}={value} is out of range for an operand of rank "
            f"{rank} (valid: {-ndim} to {ndim - 1})."
        )
    return value % ndim


def _check_split(fn: str, arg: str, x: Any, dim: int, group: Any, tiled: bool) -> None:
    """Every leaf's dimension ``dim`` splits over the group (``tiled``) or equals its size."""
    names, size = group
    for leaf in jax.tree_util.tree_leaves(x):
        shape = tuple(jax.numpy.shape(leaf))
        d = _dim(fn, arg, dim, len(shape))
        if (shape[d] % size != 0) if tiled else (shape[d] != size):
            rule = "divisible by" if tiled else "equal to (tiled=False)"
            raise MeshkitError(
                f"meshkit.collectives.{fn}: {arg} {d} of an operand of shape {shape} has size "
                f"{shape[d]}, which is not {rule} the size {size} of the axis group {names!r}.\n"
                f"Consider padding that dimension to a multiple of {size}"
                + ("." if tiled else ", or tiled=True.")
            )


def _apply(op: str, x: Any, names: tuple[str, ...], ctx: Interceptor | None, **params: Any) -> Any:
    """``jax.lax``'s ``op`` over the group of ``names``, or the interceptor's stand-in."""
    if ctx is not None:
        return ctx.run(op, x, names, **params)
    return getattr(lax, op)(_varying(x, names), _axis_arg(names), **params)


def _reduce(op: str, x: Any, axis_name: AxisName) -> Any:
    names, _, ctx = _names(op, axis_name)
    return _apply(op, x, names, ctx)


@public
def psum(x: Any, axis_name: AxisName) -> Any:
    """Sum of ``x`` over the devices of ``axis_name`` (every device gets the sum).

    Examples:
        >>> import jax, numpy as np, meshkit
        >>> from meshkit import collectives as C
        >>> mesh = meshkit.make_mesh({"x": 8})
        >>> f = meshkit.spmd(lambda a: C.psum(a, "x"), mesh=mesh, in_specs="x", out_specs="_")
        >>> f(np.arange(8.0))
        Array([28.], dtype=float32)
    """
    return _reduce("psum", x, axis_name)


@public
def pmean(x: Any, axis_name: AxisName) -> Any:
    """Mean of ``x`` over the devices of ``axis_name``; integers give floats, as in `jax.lax`."""
    return _reduce("pmean", x, axis_name)


@public
def pmax(x: Any, axis_name: AxisName) -> Any:
    """Elementwise maximum of ``x`` over the devices of ``axis_name``."""
    return _reduce("pmax", x, axis_name)


@public
def pmin(x: Any, axis_name: AxisName) -> Any:
    """Elementwise minimum of ``x`` over the devices of ``axis_name``."""
    return _reduce("pmin", x, axis_name)


@public
def all_gather(x: Any, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> Any:
    """Every device's ``x`` from the group of ``axis_name``, on every device.

    Stacked along a new dimension ``axis``, or concatenated along dimension ``axis`` with
    ``tiled=True``. The result is typed invariant over the group, so ``out_specs`` may leave
    those axes out.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit import collectives as C
        >>> mesh = meshkit.make_mesh({"x": 4, "y": 2})
        >>> f = meshkit.spmd(lambda a: C.all_gather(a, "x", tiled=True),
        ...                  mesh=mesh, in_specs="x", out_specs="_")
        >>> f(np.arange(4)).tolist()
        [0, 1, 2, 3]
    """
    names, _, ctx = _names("all_gather", axis_name)
    for leaf in jax.tree_util.tree_leaves(x):
        nd = jax.numpy.ndim(leaf)
        _dim("all_gather", "axis", axis, nd + (0 if tiled else 1), nd)
        if tiled and nd == 0:
            raise MeshkitError(
                "meshkit.collectives.all_gather: tiled=True needs operands of rank "
                ">= 1; got a scalar. Consider tiled=False, which stacks."
            )
    return _apply("all_gather", x, names, ctx, axis=axis, tiled=tiled, to="invarying")


@public
def psum_scatter(
    x: Any, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False
) -> Any:
    """Sum over the group of ``axis_name``, each device keeping its own block of the sum.

    The sum is split along ``scatter_dimension``: with ``tiled=True`` into group-size equal
    blocks (the dimension must divide evenly); with ``tiled=False`` the dimension must equal the
    group size and is removed. Device ``i`` of the group keeps block ``i``.
    """
    names, size, ctx = _names("psum_scatter", axis_name)
    _check_split("psum_scatter", "scatter_dimension", x, scatter_dimension, (names, size), tiled)
    return _apply("psum_scatter", x, names, ctx, scatter_dimension=scatter_dimension, tiled=tiled)


@public
def all_to_all(
    x: Any, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False
) -> Any:
    """Split ``x`` along ``split_axis`` into group-size blocks, send block ``j`` to device ``j``.

    The received blocks are concatenated along ``concat_axis`` in group order (``tiled=True``),
    or, with ``tiled=False``, ``split_axis`` must equal the group size and the blocks are stacked
    along ``concat_axis`` after that dimension is removed, as in `jax.lax.all_to_all`.
    """
    names, size, ctx = _names("all_to_all", axis_name)
    _check_split("all_to_all", "split_axis", x, split_axis, (names, size), tiled)
    for leaf in jax.tree_util.tree_leaves(x):
        _dim("all_to_all", "concat_axis", concat_axis, jax.numpy.ndim(leaf))
    params = {"split_axis": split_axis, "concat_axis": concat_axis, "tiled": tiled}
    return _apply("all_to_all", x, names, ctx, **params)


@public
def ppermute(x: Any, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """Send ``x`` from device ``src`` to device ``dst`` of the group for each pair in ``perm``.

    Devices that receive nothing get zeros. Sources and destinations must each be distinct.
    """
    names, size, ctx = _names("ppermute", axis_name)
    pairs = [tuple(int(i) for i in p) for p in perm]
    for p in pairs:
        if len(p) != 2 or not all(0 <= i < size for i in p):
            raise MeshkitError(
                f"meshkit.collectives.ppermute: perm entry {p!r} is not a pair of device indices "
                f"in [0, {size}) for the axis group {names!r} of size {size}."
            )
    for k, label in ((0, "source"), (1, "destination")):
        seen = [p[k] for p in pairs]
        if len(set(seen)) != len(seen):
            raise MeshkitError(
                f"meshkit.collectives.ppermute: perm {pairs!r} repeats a {label}; each device "
                f"may send once and receive once."
            )
    # JAX wants the names of a tuple in mesh order (an interceptor, as given); renumber to match.
    bound = _compat.bound_axis_sizes()
    order = sorted(names, key=list(bound).index) if ctx is None else list(names)
    if order != list(names):
        sizes = [bound[n] for n in names]

        def renumber(i: int) -> int:
            coord = dict(zip(names, np.unravel_index(i, sizes), strict=True))
            return int(np.ravel_multi_index([coord[n] for n in order], [bound[n] for n in order]))

        pairs = [(renumber(a), renumber(b)) for a, b in pairs]
        names = tuple(order)
    return _apply("ppermute", x, names, ctx, perm=tuple(pairs))


@public
def shift(x: Any, axis_name: AxisName, offset: int = 1) -> Any:
    """Ring shift: device ``i`` of the group sends ``x`` to device ``(i + offset) % size``.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit import collectives as C
        >>> mesh = meshkit.make_mesh({"x": 8})
        >>> f = meshkit.spmd(lambda a: C.shift(a, "x"), mesh=mesh, in_specs="x", out_specs="x")
        >>> f(np.arange(8)).tolist()
        [7, 0, 1, 2, 3, 4, 5, 6]
    """
    names, size, _ = _names("shift", axis_name)
    if not isinstance(offset, int):
        raise MeshkitError(f"meshkit.collectives.shift: offset must be an int; got {offset!r}.")
    return ppermute(x, names, [(i, (i + offset) % size) for i in range(size)])


@public
def axis_index(axis_name: AxisName) -> Any:
    """This device's index along ``axis_name`` (row-major over a tuple of names)."""
    names, _, ctx = _names("axis_index", axis_name)
    if ctx is not None:
        return ctx.run("axis_index", None, names)
    return lax.axis_index(_axis_arg(names))


@public
def axis_size(axis_name: AxisName) -> int:
    """The number of devices along ``axis_name`` (the product over a tuple), a Python int."""
    return _names("axis_size", axis_name)[1]
