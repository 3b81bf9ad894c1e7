"""The host reads of device-stacked values, for ``meshkit migrate``'s MK010.

Reading a stacked value on the host (``x[0]``, ``np.asarray(x)``, ``jax.device_get(x)``,
``float(x)``, ``x.item()``, a ``tree_map`` of ``lambda a: a[0]``) gives this process's entries
with `meshkit.pmap_compat`'s defaults, as ``jax.pmap`` did, and needs entries of other hosts with
``global_outputs=True`` in a multi-process run. Which values are stacked is the flow analysis'
to say (`meshkit._src.migrate.flow`); this module says which uses of them read them, and which
of those reads have a meshkit equivalent.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .facts import STACKED, is_tuple

_LOCAL = "meshkit.local_from_global"

TREE_MAPS = frozenset({"jax.tree_util.tree_map", "jax.tree.map", "jax.tree_map"})
HOST_METHODS = frozenset({"item", "tolist", "__array__", "tobytes"})
TO_PYTHON = frozenset({"float", "int", "bool", "complex"})


@dataclass(frozen=True)
class Read:
    """A host read of a stacked value.

    Attributes:
        node: the reading expression (a Subscript or a Call).
        what: ``"entry"`` (one device's entry: ``x[k]``, ``tree_map(lambda a: a[0], x)``) or
            ``"whole"`` (every entry: ``np.asarray(x)``, ``jax.device_get(x)``, ``float(x)``).
        fix: the meshkit function that replaces it where that is mechanical, else "".
        keep: for a Call fix, the index of the argument that becomes the new call's argument.
        index: the device entry read, for ``"entry"`` reads with a literal index.
    """

    node: ast.Subscript | ast.Call
    what: str
    fix: str = ""
    keep: int = 0
    index: int | None = None


class HostReads:
    """The host reads in one file, given what kind of value each expression is.

    Args:
        qual: the dotted name a node refers to through the file's imports, or None.
        kind: the kind of an expression's value (`meshkit._src.migrate.facts.STACKED`...).
        local: whether a bare name is bound in the file (so it is not the builtin).
    """

    def __init__(
        self,
        qual: Callable[[ast.AST], str | None],
        kind: Callable[[ast.AST], str | None],
        local: Callable[[ast.Name], bool],
    ) -> None:
        self.qual = qual
        self.kind = kind
        self.local = local

    def function(self, fn: ast.expr) -> str | None:
        """What a function given to tree_map reads of each leaf on the host, or None."""
        if isinstance(fn, ast.Lambda) and fn.args.args:
            param = fn.args.args[0].arg
            for node in ast.walk(fn.body):
                what = self._leaf_read(node, param)
                if what is not None:
                    return what
            return None
        qual = self.qual(fn)
        if qual is not None and (qual.startswith("numpy.") or qual == "jax.device_get"):
            return "whole"
        if isinstance(fn, ast.Name) and fn.id in TO_PYTHON and not self.local(fn):
            return "whole"
        return None

    def _leaf_read(self, node: ast.AST, param: str) -> str | None:
        def is_param(e: ast.AST) -> bool:
            return isinstance(e, ast.Name) and e.id == param

        if (
            isinstance(node, ast.Subscript)
            and is_param(node.value)
            and int_index(node.slice) is not None
        ):
            return "entry"
        if isinstance(node, ast.Call):
            if node.args and is_param(node.args[0]) and self.function(node.func):
                return "whole"
            func = node.func
            on_param = isinstance(func, ast.Attribute) and is_param(func.value)
            if on_param and func.attr in HOST_METHODS:  # type: ignore[union-attr]
                return "whole"
        return None

    def reads(self, nodes: Sequence[ast.AST]) -> Iterator[Read]:
        """Every host read of a stacked value among ``nodes``."""
        for node in nodes:
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                index = int_index(node.slice)
                if index is not None and self.kind(node.value) == STACKED:
                    plain = isinstance(node.slice, ast.Constant) and index == 0
                    fix = "meshkit.unreplicate" if plain else ""
                    yield Read(node, "entry", fix, index=index)
            elif isinstance(node, ast.Call):
                read = self._call_read(node)
                if read is not None:
                    yield read

    def _call_read(self, call: ast.Call) -> Read | None:
        func, args = call.func, call.args
        qual = self.qual(func)
        if qual in TREE_MAPS and len(args) >= 2:
            what = self.function(args[0])
            if what is None or not any(self.kind(a) for a in args[1:]):
                return None
            first = what == "entry" and _takes_first(args[0])
            fix = "meshkit.unreplicate" if first and len(args) == 2 and not call.keywords else ""
            return Read(call, what, fix, keep=1, index=0 if first else None)
        if not args or isinstance(args[0], ast.Starred):
            on_value = isinstance(func, ast.Attribute) and func.attr in HOST_METHODS
            if on_value and self.kind(func.value) == STACKED:  # type: ignore[union-attr]
                return Read(call, "whole")
            return None
        kind = self.kind(args[0])
        if kind is None:
            return None
        single = len(args) == 1 and not call.keywords and (kind == STACKED or is_tuple(kind))
        if qual == "jax.device_get":
            return Read(call, "whole", _LOCAL if single else "")
        if qual is not None and qual.startswith("numpy."):
            simple = qual in ("numpy.array", "numpy.asarray") and single and kind == STACKED
            return Read(call, "whole", _LOCAL if simple else "")
        if isinstance(func, ast.Name) and func.id in TO_PYTHON and not self.local(func):
            return Read(call, "whole") if kind == STACKED else None
        return None


def int_index(index: ast.AST) -> int | None:
    """The literal integer of ``x[k]`` / ``x[-k]`` / ``x[k, ...]``, else None."""
    if isinstance(index, ast.Tuple) and index.elts:
        index = index.elts[0]
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
        inner = int_index(index.operand)
        return None if inner is None else -inner
    if (
        isinstance(index, ast.Constant)
        and isinstance(index.value, int)
        and not isinstance(index.value, bool)
    ):
        return index.value
    return None


def _takes_first(fn: ast.AST) -> bool:
    """``lambda a: a[0]``."""
    if not (isinstance(fn, ast.Lambda) and len(fn.args.args) == 1):
        return False
    body, arg = fn.body, fn.args.args[0].arg
    return (
        isinstance(body, ast.Subscript)
        and isinstance(body.value, ast.Name)
        and body.value.id == arg
        and isinstance(body.slice, ast.Constant)
        and body.slice.value == 0
        and not isinstance(body.slice.value, bool)
    )
