"""Where a device-stacked value may be a numpy array instead, for ``meshkit migrate``'s MK010.

``np.asarray(x)`` and ``jax.device_get(x)`` of a pmap output become
`meshkit.local_from_global` under ``--fix``, which takes jax.Arrays only. Pmap-era code often
reads numpy the same way: flax's wmt example has one ``tohost(x)`` for pmap outputs and for
``common_utils.shard`` of a numpy batch (which stays numpy). Such a read is still a finding, but
is left as written. A value may be numpy where what flows into it may be: a value the flow
analysis does not know as stacked (one branch of a conditional, an argument some call passes),
or what ``shard`` makes. Each answer says where that value comes from, for the finding's note.

`NumpyValues` is a part of `meshkit._src.migrate.flow.Flow`, asked once the run's kinds are
known (`meshkit._src.migrate.flow.analyze` fills the facts it reads in a second pass).
"""

from __future__ import annotations

import ast

from .bindings import FUNCTIONS, Binding, Bindings, dotted_name, has_param, position, returns_of
from .facts import KEEP_NUMPY, SOURCES, Facts, ScannedFile
from .reads import TREE_MAPS

__all__ = ["NumpyValues"]


class NumpyValues:
    """The numpy half of the flow analysis (`meshkit._src.migrate.flow.Flow` provides the rest)."""

    sc: ScannedFile
    facts: Facts
    path: str
    bindings: Bindings
    numpy_memo: dict[ast.AST, str | None]

    def kind(self, expr: ast.AST) -> str | None:
        """The kind of an expression's value (the flow analysis')."""
        raise NotImplementedError

    def callee(self, call: ast.Call) -> tuple[tuple[str, str], int] | None:
        """The run's function a call calls (the flow analysis')."""
        raise NotImplementedError

    def signature(self, path: str, qual: str) -> list[str] | None:
        """A run's function's parameter names (the flow analysis')."""
        raise NotImplementedError

    def numpy(self, expr: ast.AST) -> str | None:
        """Where a stacked value may instead be a numpy array: ``"`b` (train.py:9)"``, or None.

        A value is one where what flows into it may be: a value the analysis does not know as
        stacked (a parameter some call passes a numpy batch, one branch of a conditional), or
        what ``shard`` makes (numpy stays numpy). A read of such a value is not rewritten into
        `meshkit.local_from_global`, which takes jax.Arrays only. Asked once the kinds are
        known (the run's facts complete), since it reads them.
        """
        if expr in self.numpy_memo:
            return self.numpy_memo[expr]
        self.numpy_memo[expr] = None  # a cycle adds nothing
        origin = self._numpy(expr)
        self.numpy_memo[expr] = origin
        return origin

    def _where(self, expr: ast.AST) -> str:
        text = ast.unparse(expr)
        text = text if len(text) <= 40 else text[:37] + "..."
        return f"`{text}` ({self.path}:{getattr(expr, 'lineno', 0)})"

    def _numpy(self, expr: ast.AST) -> str | None:
        if self.kind(expr) is None:
            return self._where(expr)
        if isinstance(expr, ast.Name):
            return self._numpy_name(expr)
        if isinstance(expr, ast.Attribute):
            key = dotted_name(expr)
            if key is not None and key in self.bindings.attrs:
                return self._numpy_bound(self.bindings.attrs[key])
            return self.numpy(expr.value)
        if isinstance(expr, ast.Subscript | ast.Starred | ast.NamedExpr | ast.Await):
            return self.numpy(expr.value)
        if isinstance(expr, ast.Call):
            return self._numpy_call(expr)
        if isinstance(expr, ast.BinOp):
            return self._first([expr.left, expr.right], stacked_only=True)
        if isinstance(expr, ast.UnaryOp):
            return self.numpy(expr.operand)
        if isinstance(expr, ast.IfExp):
            return self._first([expr.body, expr.orelse])
        if isinstance(expr, ast.Tuple | ast.List | ast.Set):
            return self._first(expr.elts)
        if isinstance(expr, ast.Dict):
            return self._first(expr.values)
        if isinstance(expr, ast.ListComp | ast.GeneratorExp):
            return self.numpy(expr.elt)
        return None

    def _first(self, exprs: list[ast.expr], stacked_only: bool = False) -> str | None:
        for e in exprs:
            if stacked_only and self.kind(e) is None:
                continue  # x * 2, x + np.ones(...): the stacked operand decides
            origin = self.numpy(e)
            if origin is not None:
                return origin
        return None

    def _numpy_name(self, name: ast.Name) -> str | None:
        b = self.bindings
        scope = b.scope(name)
        pos = position(name)
        while True:
            seen = b.seen(scope, name, pos)
            if seen:
                return self._numpy_bound(seen)
            if isinstance(scope, (*FUNCTIONS, ast.Lambda)) and has_param(scope, name.id):
                if isinstance(scope, ast.Lambda):
                    return None
                key = (self.path, self.bindings.qualnames[scope])
                return self.facts.host_params.get(key, {}).get(name.id)
            if scope is self.sc.tree:
                return None
            scope = b.scope(scope)
            pos = (1 << 30, 0)

    def _numpy_bound(self, bindings: list[Binding]) -> str | None:
        for binding in bindings:
            if binding.kind() is None and binding.sources:
                return self._where(binding.sources[-1])
            origin = self._first(list(binding.sources), stacked_only=True)
            if origin is not None:
                return origin
        return None

    def _numpy_call(self, call: ast.Call) -> str | None:
        func = call.func
        if self.sc.pmapped_value(func) is not None:
            return None
        qual = self.sc.qual(func)
        if qual in KEEP_NUMPY:
            return self._where(call)
        if qual in SOURCES or (qual is not None and qual.startswith("jax.numpy.")):
            return None
        if qual in TREE_MAPS:
            return self._first(call.args[1:], stacked_only=True)
        if isinstance(func, ast.Attribute) and self.kind(func.value) is not None:
            return self.numpy(func.value)  # x.reshape(...) of numpy is numpy
        if isinstance(func, ast.Name) and func.id == "abs" and call.args:
            return self.numpy(call.args[0])
        target = self.callee(call)
        if target is not None:
            return self.facts.host_returns.get(target[0])
        return None

    def export_numpy(self) -> bool:
        """Add where the run's stacked parameters and returns may be numpy; True if new.

        Run once every kind is known (`analyze`): it reads them, and only grows.
        """
        facts, changed = self.facts, False
        for node, qual in self.bindings.qualnames.items():
            key = (self.path, qual)
            if not isinstance(node, FUNCTIONS) or key not in facts.returns:
                continue
            if key in facts.host_returns:
                continue
            for r in returns_of(node):
                origin = None if r.value is None else self.numpy(r.value)
                if origin is not None:
                    # Named by function, not by text or line: a re-scan after --fix reads these
                    # facts with the new text, whose lines and names moved.
                    facts.host_returns[key] = f"what `{qual}` returns ({self.path})"
                    changed = True
                    break
        for node in self.sc.nodes:
            if not isinstance(node, ast.Call) or not (node.args or node.keywords):
                continue
            target = self.callee(node)
            if target is None:
                continue
            (path, qual), skip = target
            stacked = facts.params.get((path, qual))
            params = self.signature(path, qual)
            if not stacked or params is None:
                continue
            known = facts.host_params.setdefault((path, qual), {})
            passed = [(params[i + skip], a) for i, a in enumerate(node.args[: len(params) - skip])]
            passed += [(k.arg, k.value) for k in node.keywords if k.arg in params]
            for name, arg in passed:
                if name not in stacked or name in known or isinstance(arg, ast.Starred):
                    continue
                origin = self.numpy(arg)
                if origin is not None:
                    fn = self.bindings.where[node][0]
                    caller = self.bindings.qualnames.get(fn, "the module's code")
                    known[name] = (
                        f"parameter `{name}`, which a call in {caller} ({self.path}) passes"
                    )
                    changed = True
        return changed
