"""Pytree prefixes: where one stops being a prefix of another, its entry per leaf, nodes in words.

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


def is_leaf_def(treedef: Any) -> bool:
    """Whether a one-level treedef (see `one_level`) is a leaf's (None and {} are nodes)."""
    return treedef.num_nodes == 1 and treedef.num_leaves == 1


def _type_name(x: Any) -> str:
    module = type(x).__module__
    name = type(x).__qualname__
    if module.startswith("flax.nnx"):
        return f"nnx.{name}"
    if isinstance(x, jax.Array):
        return "jax.Array"
    if module == "numpy" and name == "ndarray":
        return "numpy array"
    return name


def describe_node(x: Any, keys: list[Any] | None = None) -> str:
    """``x`` in a few words: its type, and its keys or length where it has them."""
    if x is None:
        return "None"
    name = _type_name(x)
    article = "an" if name[0].lower() in "aeiou" or name.startswith("nnx.") else "a"
    head = f"{article} {name}"
    if keys is None and isinstance(x, Mapping):
        keys = list(x)
    if keys is not None:
        return f"{head} with keys {{{', '.join(sorted(map(repr, keys)))}}}"
    if isinstance(x, tuple | list):
        return f"{head} of length {len(x)}"
    children, treedef = one_level(x)
    if is_leaf_def(treedef):
        shape = getattr(x, "shape", None)
        return f"{head} of shape {tuple(shape)}" if shape is not None else f"{head} (a leaf)"
    return f"{head} with {len(children)} children"


def prefix_mismatch(
    prefix: Any, full: Any, *, is_leaf: Callable[[Any], bool], path: tuple[Any, ...] = ()
) -> tuple[str, str, str] | None:
    """The first place where ``prefix`` is not a pytree prefix of ``full``; None if it is."""
    if is_leaf(prefix):
        return None
    children, treedef = one_level(prefix)
    full_children, full_def = one_level(full)
    if treedef != full_def:
        return jax.tree_util.keystr(path), describe_node(prefix), describe_node(full)
    for (key, child), (_, full_child) in zip(children, full_children, strict=True):
        found = prefix_mismatch(child, full_child, is_leaf=is_leaf, path=(*path, key))
        if found is not None:
            return found
    return None


def broadcast_prefix(prefix: Any, full: Any, *, is_leaf: Callable[[Any], bool]) -> list[Any]:
    """The entry of ``prefix`` that covers each leaf of ``full``, in ``full``'s leaf order."""
    broadcast = jax.tree.broadcast(prefix, full, is_leaf=is_leaf)
    return jax.tree_util.tree_structure(full).flatten_up_to(broadcast)
