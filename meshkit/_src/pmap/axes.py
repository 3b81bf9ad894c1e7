"""`pmap_compat`'s ``in_axes`` / ``out_axes``: checked, matched to a call's leaves, named.

Messages keep `jax.pmap`'s exception classes and key phrases, then meshkit's fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ..core.errors import MeshkitError, MeshkitIndexError, MeshkitTypeError
from ..core.trees import broadcast_prefix, prefix_mismatch
from .device_axis import mapped_spec

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
    """What a call's structure fixes: each leaf's in_axes entry and name, the donated leaves."""

    axes: tuple[Axis, ...]
    paths: tuple[str, ...]
    donated: tuple[int, ...]


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
    for i, v in zip(static, static_vals, strict=True):
        try:
            hash(v)
        except TypeError:
            raise MeshkitError(
                f"{what}: Non-hashable static arguments are not supported, as this "
                f"can lead to unexpected cache-misses. Static argument (index {i}) of "
                f"type {type(v)} for function {name} is non-hashable.\nThe "
                "static_broadcasted_argnums values key the compilation cache; consider a "
                "tuple instead of a list, a frozen dataclass, or passing it as an array "
                "argument."
            ) from None
    return (n, static_vals, tuple(sorted(kwargs)) if kwargs else ())


def layout(
    in_axes: Any,
    static: tuple[int, ...],
    donate: tuple[int, ...],
    n_args: int,
    dyn: tuple[Any, ...],
    kwargs: Any,
    what: str,
) -> Layout:
    """The per-leaf in_axes, names and donations of a call structure."""
    positions = [i for i in range(n_args) if i not in static]
    per_arg = in_axes_for(in_axes, n_args, kwargs, what)
    dyn_axes = tuple(per_arg[i] for i in positions)
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
    donated: list[int] = []
    first = 0
    for pos, arg in zip(positions, dyn, strict=True):
        count = len(jax.tree_util.tree_leaves(arg))
        if pos in donate:
            donated += range(first, first + count)
        first += count
    axes += [0] * len(jax.tree_util.tree_leaves(kwargs))
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path((dyn, kwargs))[0]:
        if path[0].idx == 0:  # type: ignore[attr-defined]
            rest = jax.tree_util.keystr(path[2:])
            paths.append(f"args[{positions[path[1].idx]}]{rest}")  # type: ignore[attr-defined]
        else:
            paths.append(f"kwargs{jax.tree_util.keystr(path[1:])}")
    return Layout(tuple(axes), tuple(paths), tuple(donated))


def in_axes_for(in_axes: Any, n_args: int, kwargs: Any, what: str) -> list[Any]:
    """One in_axes entry per positional argument (statics included)."""
    if _axis_leaf(in_axes):
        return [in_axes] * n_args
    if not isinstance(in_axes, tuple):
        raise MeshkitError(
            f"{what}: in_axes must be an int, None, or a tuple with one entry per "
            f"positional argument; got {type(in_axes).__name__} {in_axes!r}."
        )
    if len(in_axes) != n_args:
        raise MeshkitError(
            f"{what}: in_axes is not a pytree prefix of the positional arguments: at "
            f"pmap in_axes[0], in_axes has a tuple of length {len(in_axes)} where the "
            f"arguments have a tuple of length {n_args}."
            + (f"\n{_KEYWORDS_MAPPED}" if kwargs else "")
            + "\nConsider one in_axes entry per positional argument (None for an argument "
            "every device gets whole)."
        )
    return list(in_axes)


def axes_per_output(axes: Any, out: Any, name: str) -> list[Axis]:
    """One out axis (or None) per output leaf, from the pytree prefix ``out_axes``."""
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


def out_spec(axis: Axis, name: str) -> PartitionSpec:
    """The spec of an output with out axis ``axis`` (negative ones are moved after shard_map)."""
    return PartitionSpec() if axis is None else mapped_spec(max(axis, 0), name)
