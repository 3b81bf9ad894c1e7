"""`pmap_compat`'s axes: ``in_axes`` / ``out_axes`` checked, matched to arguments, named.

Pure functions of the arguments' structure, cached by the caller per call structure. Messages
keep `jax.pmap`'s exception classes and key phrases (``pmap in_axes[0][0]``, "each argument
passed by keyword is mapped", "Non-hashable static arguments are not supported") followed by
meshkit's explanation and fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ..core.errors import MeshkitError, MeshkitIndexError, MeshkitTypeError
from ..core.trees import broadcast_prefix, prefix_mismatch
from . import device_axis as _device_axis

__all__ = [
    "Axis",
    "Layout",
    "axes_per_output",
    "call_key",
    "check_axes_tree",
    "in_axes_for",
    "layout",
    "out_spec",
    "prefix_map",
    "resolve",
]

Axis = int | None

_IN_AXES_TYPE = (
    "pmap in_axes must be an int, None, or (nested) container with those types as leaves, but "
    "got {value!r}."
)
_KEYWORDS_MAPPED = (
    "Arguments passed by keyword are not compared with in_axes: each argument passed by "
    "keyword is mapped over its leading axis, as with jax.pmap."
)


def check_axes_tree(value: Any, what: str, name: str) -> None:
    """``in_axes`` / ``out_axes`` hold only ints and None (`jax.pmap`'s `TypeError` otherwise)."""
    for leaf in jax.tree_util.tree_leaves(value, is_leaf=lambda x: x is None):
        if leaf is not None and (isinstance(leaf, bool) or not isinstance(leaf, int)):
            raise MeshkitTypeError(
                f"meshkit.pmap_compat({name}): "
                + _IN_AXES_TYPE.replace("in_axes", what).format(value=value)
                + "\nConsider ints (the mapped dimension) or None (an argument every device gets "
                "whole), in a tuple with one entry per positional argument."
            )


def _axis_leaf(x: Any) -> bool:
    """An in_axes / out_axes entry that applies to a whole subtree: None or an int."""
    return x is None or isinstance(x, int)


def resolve(axis: Axis, ndim: int, where: str, what: str, name: str) -> Axis:
    """A mapped axis counted like `jax.vmap` (negative from the end), checked against ``ndim``."""
    if axis is None:
        return None
    if not -ndim <= axis < ndim:
        raise MeshkitIndexError(
            f"meshkit.pmap_compat({name}): {what}={axis} for {where}, which has rank {ndim} "
            f"(valid: {-ndim} to {ndim - 1}, or None for an argument every device gets whole)."
        )
    return axis % ndim


@dataclass
class Layout:
    """What the structure of a call fixes: each leaf's in_axes entry, name and donation."""

    axes: tuple[Axis, ...]
    paths: tuple[str, ...]
    donated: tuple[int, ...]  # leaf indices whose buffers may be donated


def call_key(
    args: tuple[Any, ...], kwargs: dict[str, Any], static: tuple[int, ...], what: str, name: str
) -> tuple[Any, ...]:
    """(positional count, static values, keyword names): checked, hashable."""
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
    if static_vals:
        for i, v in zip(static, static_vals, strict=True):
            if not hashable(v):
                raise MeshkitError(
                    f"{what}: Non-hashable static arguments are not supported, as this "
                    f"can lead to unexpected cache-misses. Static argument (index {i}) of "
                    f"type {type(v)} for function {name} is non-hashable.\nThe "
                    "static_broadcasted_argnums values key the compilation cache; consider a "
                    "tuple instead of a list, a frozen dataclass, or passing it as an array "
                    "argument."
                )
    return (n, static_vals, tuple(sorted(kwargs)) if kwargs else ())


def layout(
    in_axes_spec: Any,
    static: tuple[int, ...],
    donate: tuple[int, ...],
    n_args: int,
    dyn: Any,
    kwargs: Any,
    what: str,
) -> Layout:
    """The per-leaf in_axes, names and donations of a call structure."""
    positions = [i for i in range(n_args) if i not in static]
    in_axes = in_axes_for(in_axes_spec, n_args, kwargs, what)
    dyn_axes = [in_axes[i] for i in positions]
    axes: list[Axis] = []
    donated: list[int] = []
    for pos, prefix, arg in zip(positions, dyn_axes, dyn, strict=True):
        first = len(axes)
        axes += _axes_per_leaf(prefix, arg, dyn_axes, dyn, kwargs, what)
        if pos in donate:
            donated += range(first, len(axes))
    axes += [0] * len(jax.tree_util.tree_leaves(kwargs))
    paths = tuple(leaf_paths((dyn, kwargs), positions))
    return Layout(tuple(axes), paths, tuple(donated))


def _axes_per_leaf(
    prefix: Any, arg: Any, dyn_axes: list[Any], dyn: Any, kwargs: Any, what: str
) -> list[Axis]:
    n = len(jax.tree_util.tree_leaves(arg))
    if prefix is None or isinstance(prefix, int):
        return [prefix] * n
    mismatch = prefix_mismatch(
        tuple(dyn_axes), tuple(dyn), is_leaf=_axis_leaf, path=(jax.tree_util.SequenceKey(0),)
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
    return broadcast_prefix(prefix, arg, is_leaf=_axis_leaf)


def in_axes_for(in_axes: Any, n_args: int, kwargs: Any, what: str) -> list[Any]:
    """One in_axes entry per positional argument (statics included)."""
    axes = in_axes
    if axes is None or isinstance(axes, int):
        return [axes] * n_args
    if not isinstance(axes, tuple):
        raise MeshkitError(
            f"{what}: in_axes must be an int, None, or a tuple with one entry per "
            f"positional argument; got {type(axes).__name__} {axes!r}."
        )
    if len(axes) != n_args:
        raise MeshkitError(
            f"{what}: in_axes is not a pytree prefix of the positional arguments: at "
            f"pmap in_axes[0], in_axes has a tuple of length {len(axes)} where the arguments "
            f"have a tuple of length {n_args}."
            + (f"\n{_KEYWORDS_MAPPED}" if kwargs else "")
            + "\nConsider one in_axes entry per positional argument (None for an argument "
            "every device gets whole)."
        )
    return list(axes)


def hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def axes_per_output(axes: Any, out: Any, name: str) -> list[Axis]:
    """One out axis (or None) per output leaf, from the pytree prefix ``out_axes``."""
    if axes is None or isinstance(axes, int):
        return [axes] * len(jax.tree_util.tree_leaves(out))
    mismatch = prefix_mismatch(axes, out, is_leaf=_axis_leaf)
    if mismatch is not None:
        where, have, want = mismatch
        raise MeshkitError(
            f"meshkit.pmap_compat({name}): out_axes = {axes!r} is not a pytree prefix of the "
            f"outputs ({jax.tree_util.tree_structure(out)}): at out_axes{where}, out_axes has "
            f"{have} where the outputs have {want}.\n"
            "Consider one entry per output (an int, None, or a pytree matching it)."
        )
    return broadcast_prefix(axes, out, is_leaf=_axis_leaf)


def leaf_paths(tree: Any, dyn_positions: list[int]) -> list[str]:
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        first, rest = path[0], path[1:]
        if getattr(first, "idx", None) == 0:  # positional
            j = path[1].idx  # type: ignore[attr-defined]
            out.append(f"args[{dyn_positions[j]}]{jax.tree_util.keystr(path[2:])}")
        else:
            out.append(f"kwargs{jax.tree_util.keystr(rest)}")
    return out


def prefix_map(axes: Any, fn: Callable[[Axis], Any]) -> Any:
    if axes is None or isinstance(axes, int):
        return fn(axes)
    return jax.tree_util.tree_map(fn, axes, is_leaf=lambda x: x is None)


def out_spec(axis: Axis, name: str) -> PartitionSpec:
    if axis is None:
        return PartitionSpec()
    return _device_axis.mapped_spec(axis if axis >= 0 else 0, name)
