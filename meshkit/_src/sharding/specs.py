"""Partition specs, and their readable string form ``"batch seq -> data _"``.

The grammar (einops' notation) is in docs/per-device.md. Strings are parsed once (cached) by
meshkit's own tokenizer; errors underline the bad token.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from ..core import caches as _caches
from ..core.errors import MeshkitError
from ..core.tracebacks import public

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
    """The mesh axis names a PartitionSpec uses, in order."""
    return [a for axes in dim_axes(partition, len(partition)) for a in axes]


def check_spec_for_mesh(value: SpecLike, mesh: Mesh | AbstractMesh, what: str) -> PartitionSpec:
    """Resolve ``value`` and check every axis it names is an axis of ``mesh``, used once."""
    partition = as_partition_spec(value, what)
    names = spec_axes(partition)
    available = ", ".join(f"{n!r} (size {s})" for n, s in mesh.shape.items())
    for i, name in enumerate(names):
        if name not in mesh.shape:
            fix = f"The mesh has the axes {available}."
            if isinstance(value, str):
                start, end = parse_spec(value).spans[name]
                raise MeshkitError(
                    f"{what}: the mesh has no axis {name!r} (in the spec string {value!r})\n"
                    f"{_pointed(value, start, end)}\n{fix}"
                )
            raise MeshkitError(
                f"{what}: {partition} names the axis {name!r}, which the mesh does not have. {fix}"
            )
        if name in names[:i]:
            raise MeshkitError(
                f"{what}: {partition} uses the mesh axis {name!r} twice; a mesh axis can split "
                "at most one dimension."
            )
    return partition


def is_spec_leaf(x: Any) -> bool:
    """Leaves of a pytree of specs: PartitionSpecs, strings and None."""
    return x is None or isinstance(x, PartitionSpec | str)


def map_specs(fn: Callable[[Any, str], Any], specs: Any, what: str) -> Any:
    """Apply ``fn(leaf, where)`` to every spec leaf of a pytree of specs."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)
    out = [fn(leaf, f"{what}{jax.tree_util.keystr(path)}") for path, leaf in flat]
    return jax.tree_util.tree_unflatten(treedef, out)
