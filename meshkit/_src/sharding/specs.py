"""Partition specs, their readable string form ``"batch seq -> data _"``, and spec trees.

The grammar (einops' notation) is in docs/per-device.md. Strings are parsed once (cached) by
meshkit's own tokenizer; errors underline the bad token.

A mapping in a spec tree matches any node of the value that JAX keys by dict entries (dict,
``nnx.State``, ``FrozenDict``...) with the same keys; other nodes must have the same type. flax's
boxes (nnx Variables of specs, linen ``Partitioned``) stand for their specs, recognised by class
name, so flax is never imported. See docs/flax-optax.md.
"""

from __future__ import annotations

import keyword
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jax.tree_util import DictKey

from ..core import caches as _caches
from ..core.errors import MeshkitError
from ..core.frames import public
from ..core.trees import describe_node, is_leaf_def, one_level

SpecLike = PartitionSpec | str

_TOKEN = re.compile(r"->|\(|\)|\.\.\.|…|[^\s()]+")

_GRAMMAR = """\
A spec string has one entry per array dimension: a mesh axis name, '_' for a dimension that is
not split, or '(a b)' for a dimension split over several mesh axes; optionally preceded by the
dimensions' names and '->', e.g. "batch seq embed -> data _ model"."""


@dataclass(frozen=True)
class SpecString:
    """A parsed spec string: its `PartitionSpec`, the dimension names, each axis's token span."""

    dims: tuple[str, ...] | None
    partition: PartitionSpec
    spans: dict[str, tuple[int, int]]


def _pointed(text: str, start: int, end: int) -> str:
    return f"    {text}\n    {' ' * start}{'^' * max(1, end - start)}"


def _error(text: str, start: int, end: int, problem: str, fix: str = _GRAMMAR) -> MeshkitError:
    return MeshkitError(
        f"meshkit: bad spec string {text!r}: {problem}\n{_pointed(text, start, end)}\n{fix}"
    )


def _tokens(text: str, offset: int) -> list[tuple[str, int, int]]:
    return [(m.group(), m.start() + offset, m.end() + offset) for m in _TOKEN.finditer(text)]


def _side(text: str, side: str, offset: int, *, names_dims: bool) -> list[Any]:
    """One side of a spec string: a name per entry, a tuple for a group; errors point at tokens."""
    depth = opened = 0
    empty: tuple[int, int] | None = None  # the first "()", reported after the other errors
    seen: dict[str, int] = {}
    out: list[Any] = []
    for tok, start, end in _tokens(side, offset):
        if tok == "(":
            if names_dims:
                raise _error(text, start, end, "dimension names cannot be grouped")
            if depth:
                raise _error(text, start, end, "parentheses cannot be nested")
            depth, opened = 1, start
            out.append([])
        elif tok == ")":
            if not depth:
                raise _error(text, start, end, "')' without a matching '('")
            depth = 0
            if not out[-1] and empty is None:
                empty = (opened, end)
        elif tok in ("...", "…"):
            raise _error(text, start, end, "'...' is not supported; write one entry per dimension")
        elif tok == "->":
            raise _error(text, start, end, "'->' may appear only once")
        elif tok.isdecimal():
            raise _error(text, start, end, f"{tok!r} is a number; an entry is an axis name or '_'")
        else:
            if not tok.isidentifier() or keyword.iskeyword(tok):
                raise _error(text, start, end, f"{tok!r} is not a name (a Python identifier)")
            if tok != "_" and (tok.startswith("_") or tok.endswith("_")):
                raise _error(
                    text, start, end, f"{tok!r}: names cannot start or end with '_' (a lone "
                    "'_' marks a dimension that is not split)"
                )  # fmt: skip
            if tok == "_" and depth and not names_dims:
                raise _error(text, start, end, "'_' cannot appear inside parentheses")
            if tok != "_" and tok in seen:
                what = "dimension" if names_dims else "mesh axis"
                raise _error(text, start, end, f"the {what} {tok!r} appears twice")
            seen[tok] = start
            (out[-1] if depth else out).append(tok)
    if depth:
        raise _error(text, opened, opened + 1, "'(' is never closed")
    if empty is not None:
        raise _error(text, *empty, "empty parentheses; write '_' instead")
    return out


@_caches.cached(maxsize=1024)
def parse_spec(text: str) -> SpecString:
    """Parse a spec string (cached); a `MeshkitError` underlines the bad token."""
    dims: tuple[str, ...] | None = None
    right, right_at = text, 0
    if "->" in text:
        arrow = text.index("->")
        dims = tuple(_side(text, text[:arrow], 0, names_dims=True))
        right, right_at = text[arrow + 2 :], arrow + 2
    entries = [
        None if g == "_" else g if isinstance(g, str) else g[0] if len(g) == 1 else tuple(g)
        for g in _side(text, right, right_at, names_dims=False)
    ]
    if dims is not None and len(dims) != len(entries):
        start = right_at + len(right) - len(right.lstrip())
        raise _error(
            text,
            start,
            len(text.rstrip()),
            f"{len(dims)} dimensions are named on the left of '->' but the right gives "
            f"{len(entries)} entries",
            "Consider one entry per named dimension, '_' for those that are not split.",
        )
    spans = {tok: (s, e) for tok, s, e in _tokens(right, right_at) if tok not in "()_"}
    return SpecString(dims, PartitionSpec(*entries), spans)


@public
def spec(text: str) -> PartitionSpec:
    """The `jax.sharding.PartitionSpec` a readable spec string means.

    Args:
        text: ``"data _ model"`` (one entry per dimension: a mesh axis, ``_`` for not split,
            ``(a b)`` for split over several axes), optionally with named dimensions:
            ``"batch seq embed -> data _ model"``.

    Returns:
        The equivalent ``PartitionSpec``. meshkit functions take the string itself too.

    Raises:
        MeshkitError: if the string is malformed; the message underlines the bad token.

    Examples:
        >>> import meshkit
        >>> from jax.sharding import PartitionSpec as P
        >>> meshkit.spec("batch seq embed -> data _ model") == P("data", None, "model")
        True
        >>> meshkit.spec("(data fsdp) _") == P(("data", "fsdp"), None)
        True
    """
    if not isinstance(text, str):
        raise MeshkitError(f"meshkit.spec: expected a string; got {text!r}.")
    return parse_spec(text).partition


def as_partition_spec(value: Any, what: str) -> PartitionSpec:
    """``value`` (a PartitionSpec or a spec string) as a PartitionSpec; ``what`` names it."""
    if isinstance(value, PartitionSpec):
        return value
    if isinstance(value, str):
        return parse_spec(value).partition
    raise MeshkitError(
        f"{what} must be a PartitionSpec or a spec string such as 'data _ model'; got "
        f"{value!r} of type {type(value).__name__}."
    )


def dim_axes(partition: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """The mesh axes splitting each of ``ndim`` dimensions, ``()`` where none does (comparable)."""
    out = []
    for i in range(ndim):
        entry = partition[i] if i < len(partition) else None
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            out.append(())
        else:
            out.append(tuple(entry) if isinstance(entry, tuple) else (entry,))
    return tuple(out)


def spec_axes(partition: PartitionSpec) -> list[str]:
    return [a for axes in dim_axes(partition, len(partition)) for a in axes]


def _misnamed(partition: PartitionSpec, axes: Mapping[str, int]) -> tuple[str, bool] | None:
    """The first axis ``partition`` names that ``axes`` lacks (False) or that it names twice."""
    names = spec_axes(partition)
    return next(
        ((a, a in axes) for i, a in enumerate(names) if a not in axes or a in names[:i]), None
    )


def check_spec_for_mesh(value: SpecLike, mesh: Mesh | AbstractMesh, what: str) -> PartitionSpec:
    """Resolve ``value`` and check every axis it names is an axis of ``mesh``, used once."""
    partition = as_partition_spec(value, what)
    found = _misnamed(partition, mesh.shape)
    if found is None:
        return partition
    name, twice = found
    if twice:
        raise MeshkitError(
            f"{what}: {partition} uses the mesh axis {name!r} twice; a mesh axis can split at "
            "most one dimension."
        )
    fix = "The mesh has the axes " + ", ".join(f"{n!r} (size {s})" for n, s in mesh.shape.items())
    if isinstance(value, str):
        start, end = parse_spec(value).spans[name]
        raise MeshkitError(
            f"{what}: the mesh has no axis {name!r} (in the spec string {value!r})\n"
            f"{_pointed(value, start, end)}\n{fix}."
        )
    raise MeshkitError(
        f"{what}: {partition} names the axis {name!r}, which the mesh does not have. {fix}."
    )


def layout_problem(
    shape: Sequence[int], partition: PartitionSpec, axes: Mapping[str, int]
) -> tuple[str, str] | None:
    """Why ``partition`` cannot lay out ``shape`` on ``axes``: (rule, "Consider ..."), or None."""
    shape = tuple(int(n) for n in shape)
    if len(partition) > len(shape):
        return (
            f"the spec has {len(partition)} entries but the array has {len(shape)} "
            f"dimension{'s' if len(shape) != 1 else ''}",
            "Consider a spec with at most one entry per dimension ('' or P() for a scalar).",
        )
    found = _misnamed(partition, axes)
    if found is not None and found[1]:
        return (
            f"the spec uses the mesh axis {found[0]!r} twice; a mesh axis splits at most one "
            "dimension",
            "Consider naming each mesh axis once.",
        )
    if found is not None:
        return (
            f"the spec names the mesh axis {found[0]!r}, which the mesh does not have (its axes: "
            f"{', '.join(map(repr, axes))})",
            f"Consider a spec over the mesh's axes, or a mesh with an axis {found[0]!r}.",
        )
    for dim, (size, split_by) in enumerate(
        zip(shape, dim_axes(partition, len(shape)), strict=True)
    ):
        ways = math.prod(axes[a] for a in split_by)
        if size % ways:
            ds = [str(d) for d in range(1, size + 1) if size % d == 0]
            fits = ", ".join(ds[:-1]) + (" or " if len(ds) > 1 else "") + ds[-1]
            over = (
                f"the mesh axis {split_by[0]!r} (size {ways})"
                if len(split_by) == 1
                else f"the mesh axes {split_by} ({' x '.join(str(axes[a]) for a in split_by)} "
                f"= {ways})"
            )
            return (
                f"dimension {dim} (size {size}) is split over {over}, and {size} is not a "
                f"multiple of {ways}: every device must hold an equal block",
                f"Consider a mesh whose axes splitting dimension {dim} have sizes multiplying to "
                f"{fits}, or a spec that leaves dimension {dim} whole ('_' in "
                "a spec string, None in a PartitionSpec).",
            )
    return None


def is_spec_leaf(x: Any) -> bool:
    """Leaves of a pytree of specs: PartitionSpecs, strings and None."""
    return x is None or isinstance(x, PartitionSpec | str)


def map_specs(fn: Callable[[Any, str], Any], specs: Any, what: str) -> Any:
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)
    out = [fn(leaf, f"{what}{jax.tree_util.keystr(path)}") for path, leaf in flat]
    return jax.tree_util.tree_unflatten(treedef, out)


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


def align_specs(
    specs: Any, tree: Any, *, where: str, noun: str = "the argument", back: bool = False
) -> Any:
    """``specs`` rebuilt in ``tree``'s node types, so JAX takes it as a prefix of ``tree``.

    With ``back``, ``tree`` rebuilt in ``specs``' node types down to its spec leaves instead
    (which undoes it). ``where`` names ``specs`` and ``noun`` the tree in a `SpecTreeError`.
    """
    if is_spec_leaf(specs):
        return tree if back else specs
    spec_children, spec_def = one_level(specs)
    keyed = isinstance(specs, Mapping)
    if is_leaf_def(spec_def) and (back or not keyed):
        return tree if back else specs  # not a spec: the checks of spec leaves name it
    children, treedef = one_level(tree)
    is_node = tree is not None and not is_leaf_def(treedef)
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
        by_key = {k.key: c for k, c in children}  # back: in the spec's order of keys
        pairs = (
            [(k, s, by_key[k.key]) for k, s in spec_children]
            if back
            else [(k, specs[k.key], c) for k, c in children]
        )
    else:
        pairs = [(k, s, c) for (k, s), (_, c) in zip(spec_children, children, strict=True)]
    aligned = [
        align_specs(s, c, where=f"{where}{jax.tree_util.keystr((k,))}", noun=noun, back=back)
        for k, s, c in pairs
    ]
    return jax.tree_util.tree_unflatten(spec_def if back else treedef, aligned)
