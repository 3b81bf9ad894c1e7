"""Spec trees matched to the trees they describe: mappings by keys, flax's specs as they come.

A mapping in a spec tree matches any node of the value that JAX keys by dict entries (dict,
``nnx.State``, ``FrozenDict``...) with the same keys; other nodes must have the same type. flax's
boxes (nnx Variables of specs, linen ``Partitioned``) stand for their specs, recognised by class
name, so flax is never imported. See docs/flax-optax.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.tree_util import DictKey

from ..core.errors import MeshkitError
from ..core.trees import one_level
from .specs import is_spec_leaf


class SpecTreeError(MeshkitError):
    """A spec tree does not fit the tree it describes (one line: where, what, which keys)."""


def _flax_class(x: Any, names: frozenset[str]) -> bool:
    """Whether ``x`` is an instance of a flax class named one of ``names`` (by its MRO)."""
    if not type(x).__module__.startswith("flax"):
        return False
    return any(c.__module__.startswith("flax") and c.__name__ in names for c in type(x).__mro__)


_BOXES = frozenset({"Partitioned"})  # linen (LogicallyPartitioned derives from it)
# And nnx's Variables (VariableState before flax 0.12):
_FLAX_SPECS = _BOXES | {"Variable", "VariableState"}


def _flax_spec(x: Any) -> Any:
    """The spec a flax box stands for; ``x`` itself when it holds something else."""
    if _flax_class(x, _BOXES):
        return x.get_partition_spec()
    # An nnx Variable is a pytree node over its value: a spec (a leaf to JAX) or None.
    inner = jax.tree_util.tree_leaves(x, is_leaf=is_spec_leaf)
    if not inner:
        return None
    if len(inner) == 1 and is_spec_leaf(inner[0]):
        return inner[0]
    return x  # a Variable of arrays is no spec: the leaf checks name what it holds


def plain_specs(specs: Any) -> Any:
    """``specs`` with flax's boxes (nnx Variables of specs, linen ``Partitioned``) unwrapped."""
    if is_spec_leaf(specs):
        return specs
    return jax.tree_util.tree_map(
        lambda x: _flax_spec(x) if _flax_class(x, _FLAX_SPECS) else x,
        specs,
        is_leaf=lambda x: is_spec_leaf(x) or _flax_class(x, _FLAX_SPECS),
    )


def has_mapping(specs: Any) -> bool:
    """Whether a spec tree holds a mapping node (so that it is matched by keys)."""
    nodes = jax.tree_util.tree_leaves(
        specs, is_leaf=lambda x: is_spec_leaf(x) or isinstance(x, Mapping)
    )
    return any(isinstance(x, Mapping) for x in nodes)


def _is_leaf(treedef: Any) -> bool:
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
    if _is_leaf(treedef):
        shape = getattr(x, "shape", None)
        return f"{head} of shape {tuple(shape)}" if shape is not None else f"{head} (a leaf)"
    return f"{head} with {len(children)} children"


def align_specs(specs: Any, tree: Any, *, where: str, noun: str = "the argument") -> Any:
    """``specs`` rebuilt in ``tree``'s node types, so JAX takes it as a prefix of ``tree``.

    ``where`` names ``specs`` and ``noun`` the tree in a `SpecTreeError`'s one line.
    """
    if is_spec_leaf(specs):
        return specs
    spec_children, spec_def = one_level(specs)
    keyed = isinstance(specs, Mapping)
    if not keyed and _is_leaf(spec_def):
        return specs  # not a spec: the checks of spec leaves name it
    children, treedef = one_level(tree)
    is_node = tree is not None and not _is_leaf(treedef)
    keys = [k.key for k, _ in children if isinstance(k, DictKey)]  # of a dict-like node
    if not is_node or (len(keys) != len(children) if keyed else spec_def != treedef):
        raise SpecTreeError(
            f"{where}: the spec is {describe_node(specs)} but {noun} is {describe_node(tree)}"
        )
    if keyed:
        missing, extra = set(keys) - set(specs), set(specs) - set(keys)
        if missing or extra:
            parts = [f"missing {', '.join(sorted(map(repr, missing)))}"] if missing else []
            parts += [f"extra {', '.join(sorted(map(repr, extra)))}"] if extra else []
            raise SpecTreeError(
                f"{where}: the spec is {describe_node(specs)} but {noun} is "
                f"{describe_node(tree, keys)}: {'; '.join(parts)}"
            )
        spec_children = [(key, specs[key.key]) for key, _ in children]
    aligned = [
        align_specs(s, child, where=f"{where}{jax.tree_util.keystr((key,))}", noun=noun)
        for (key, s), (_, child) in zip(spec_children, children, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, aligned)


def to_spec_types(specs: Any, tree: Any) -> Any:
    """``tree`` rebuilt in ``specs``' node types down to its spec leaves (undoes `align_specs`)."""
    if is_spec_leaf(specs):
        return tree
    spec_children, spec_def = one_level(specs)
    if _is_leaf(spec_def):
        return tree
    children, _ = one_level(tree)
    if isinstance(specs, Mapping):
        by_key = {k.key: child for k, child in children}
        rebuilt = [to_spec_types(s, by_key[k.key]) for k, s in spec_children]
    else:
        rebuilt = [
            to_spec_types(s, c) for (_, s), (_, c) in zip(spec_children, children, strict=True)
        ]
    return jax.tree_util.tree_unflatten(spec_def, rebuilt)


def map_under_specs(fn: Callable[[Any, Any], Any], specs: Any, tree: Any) -> Any:
    """Apply ``fn(spec, leaf)`` to each leaf of ``tree`` with the spec whose subtree holds it."""
    aligned = align_specs(plain_specs(specs), tree, where="specs")

    def under(s: Any, subtree: Any) -> Any:
        return jax.tree_util.tree_map(lambda leaf: fn(s, leaf), subtree)

    return jax.tree_util.tree_map(under, aligned, tree, is_leaf=is_spec_leaf)
