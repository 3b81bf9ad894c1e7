"""Pytree prefixes: where one stops being a prefix of another, and its entry per leaf.

Asked before `jax.tree_util` would raise, so that messages name the place in meshkit's words.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax


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
    """The first place where ``prefix`` is not a pytree prefix of ``full``; None if it is."""
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
    """The entry of ``prefix`` that covers each leaf of ``full``, in ``full``'s leaf order."""
    broadcast = jax.tree.broadcast(prefix, full, is_leaf=is_leaf)
    return jax.tree_util.tree_structure(full).flatten_up_to(broadcast)
