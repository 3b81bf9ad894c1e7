"""Pytree prefixes: where one stops being a prefix of another, and its entry per leaf.

`jax.tree_util.tree_map` over a prefix tree (``in_specs`` over arguments, ``in_axes`` over
arguments, ``out_specs`` over outputs) raises a ValueError when the structures differ. meshkit
asks first, so that it can name the place in its own words and never has to tell a structure
error apart from an error of its own or the user's by catching it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

__all__ = ["broadcast_prefix", "one_level", "prefix_mismatch"]


def one_level(x: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``x``'s immediate children with their keys, and its one-level treedef."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    return [(path[0] if path else None, child) for path, child in with_path], treedef


def _describe(x: Any) -> str:
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of length {len(x)}"
    if isinstance(x, Mapping):
        return f"a {type(x).__name__} with keys {sorted(map(str, x))}"
    return f"a {type(x).__name__}"


def prefix_mismatch(
    prefix: Any, full: Any, *, is_leaf: Callable[[Any], bool], path: tuple[Any, ...] = ()
) -> tuple[str, str, str] | None:
    """The first place where ``prefix`` is not a pytree prefix of ``full``; None if it is.

    ``is_leaf`` says which nodes of ``prefix`` apply to a whole subtree of ``full``. Returns
    ``(key path, what prefix has there, what full has there)``, the path in
    `jax.tree_util.keystr` form starting from ``path``.
    """
    if is_leaf(prefix):
        return None
    children, treedef = one_level(prefix)
    full_children, full_def = one_level(full)
    if treedef != full_def:
        return jax.tree_util.keystr(path), _describe(prefix), _describe(full)
    for (key, child), (_, full_child) in zip(children, full_children, strict=True):
        found = prefix_mismatch(child, full_child, is_leaf=is_leaf, path=(*path, key))
        if found is not None:
            return found
    return None


def broadcast_prefix(prefix: Any, full: Any, *, is_leaf: Callable[[Any], bool]) -> list[Any]:
    """The entry of ``prefix`` that covers each leaf of ``full``, in ``full``'s leaf order.

    ``prefix`` must be a pytree prefix of ``full`` (ask `prefix_mismatch` first); ``is_leaf``
    says which nodes of ``prefix`` are entries (as for `prefix_mismatch`).
    """
    broadcast = jax.tree.broadcast(prefix, full, is_leaf=is_leaf)
    return jax.tree_util.tree_structure(full).flatten_up_to(broadcast)
