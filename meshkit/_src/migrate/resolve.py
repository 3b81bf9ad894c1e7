"""How ``meshkit migrate`` resolves a file's names: imports, shadowing, pmapped functions.

Names are resolved through the file's imports (``import jax``, ``from jax import pmap as pm``,
``import flax.jax_utils as ju``, ``from flax.training import common_utils``), so ``ju.replicate``
is found and a local function that happens to be called ``replicate`` is not. The resolution is
per file and flow-insensitive, which bounds what it sees:

* every import in the file counts, wherever it stands, and a name rebound later at module level
  (``pmap = ...``) still resolves to its import; star imports and relative imports resolve
  nothing; a name that a function, lambda, comprehension or class binds for itself (a parameter
  ``replicate``, a loop variable ``shard``) is not the import inside that scope;
* a pmapped function is a name bound to ``jax.pmap(f)`` / ``meshkit.pmap_compat(f)`` (also
  through ``functools.partial`` or a name bound to either), or a ``def`` decorated with one.

A `ResolvedFile` is what the rule checks (`meshkit._src.migrate.checks`) and the flow analysis
(`meshkit._src.migrate.flow`, through its `ScannedFile` protocol) read.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from .bindings import dotted_name as _dotted

PMAP = "jax.pmap"
PMAP_COMPAT = "meshkit.pmap_compat"
PARTIAL = "functools.partial"
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_BINDING_SCOPES = (*_FUNCTIONS, *_COMPREHENSIONS, ast.ClassDef)


class ResolvedFile:
    """One parsed file with its names resolved: imports, definitions and pmapped names.

    Args:
        tree: the file's module, as `ast.parse` made it.
        source: the file's text (for columns in characters and snippets).
        path: the name findings carry.
    """

    def __init__(self, tree: ast.Module, source: str, path: str) -> None:
        self.tree = tree
        self.path = path
        self.lines = re.split(r"\r\n|\r|\n", source)
        self.nodes = list(ast.walk(tree))
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in self.nodes:
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.bindings: dict[str, str] = {}  # a name the imports bind -> what it stands for
        self.from_imports: list[tuple[ast.alias, str, str]] = []
        self.pmap_aliases: dict[str, ast.expr] = {}  # name -> the pmap it stands for
        self.pmapped: dict[str, ast.expr] = {}  # dotted name of a pmapped function -> its pmap
        self.mapped: dict[str, ast.AST | None] = {}  # ... -> the function it maps
        self.defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self._scope_names: dict[ast.AST, frozenset[str]] = {}  # see _locals
        self._module_bindings: dict[str, list[ast.stmt]] | None = None  # see _rebound_pmapped
        self._collect()

    def _collect(self) -> None:
        """Imports, definitions and pmapped names."""
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    name = a.asname or a.name.split(".")[0]
                    self.bindings[name] = a.name if a.asname else name
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    if a.name == "*":
                        continue
                    name = a.asname or a.name
                    self.bindings[name] = f"{node.module}.{a.name}"
                    self.from_imports.append((a, name, self.bindings[name]))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.defs.setdefault(node.name, []).append(node)
        # Aliases can build on aliases (p = partial(jax.pmap, ...); step = p(f)): a few rounds.
        for _ in range(3):
            for node in self.nodes:
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target = node.targets[0]
                    name = _dotted(target)
                    if name is None:
                        continue
                    ref = self.pmap_ref(node.value)
                    if ref is not None and isinstance(target, ast.Name):
                        self.pmap_aliases[name] = ref
                    elif (ref := self.pmapped_call(node.value)) is not None:
                        self.pmapped[name] = ref
                        self.mapped[name] = _mapped_arg(node.value)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    refs = self.decorator_refs(node)
                    if refs:
                        self.pmapped[node.name] = refs[0][1]
                        self.mapped[node.name] = node

    def qual(self, node: ast.AST) -> str | None:
        """The qualified name a name or attribute chain refers to through the imports."""
        if isinstance(node, ast.Name):
            if node.id not in self.bindings or self._shadowed(node):
                return None
            return self.bindings[node.id]
        if isinstance(node, ast.Attribute):
            base = self.qual(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def _shadowed(self, node: ast.Name) -> bool:
        """Whether a scope around ``node`` binds its name itself: then it is not the import.

        A function, lambda, comprehension or class body that binds the name (a parameter, an
        assignment, a loop or ``with`` target...) hides the import: in ``for shard in shards:
        shard.shape``, ``shard`` is not ``flax``'s.
        """
        parent = self.parents.get(node)
        nested = False  # inside a function or comprehension: a class body's names are not seen
        while parent is not None:
            if isinstance(parent, _BINDING_SCOPES):
                seen = not (nested and isinstance(parent, ast.ClassDef))
                if seen and node.id in self._locals(parent):
                    return True
                nested = nested or not isinstance(parent, ast.ClassDef)
            parent = self.parents.get(parent)
        return False

    def _locals(self, scope: ast.AST) -> frozenset[str]:
        """The names ``scope`` binds for itself (made once per scope)."""
        known = self._scope_names.get(scope)
        if known is None:
            known = self._scope_names[scope] = _bound_in(scope)
        return known

    def pmap_ref(self, expr: ast.AST) -> ast.expr | None:
        """The pmap reference behind an expression that maps functions (pmap, its partial)."""
        if isinstance(expr, ast.Name | ast.Attribute):
            if self.qual(expr) in (PMAP, PMAP_COMPAT):
                return expr
            if isinstance(expr, ast.Name):
                return self.pmap_aliases.get(expr.id)
            return None
        if isinstance(expr, ast.Call):
            if self.qual(expr.func) == PARTIAL and expr.args:
                return self.pmap_ref(expr.args[0])
            ref = self.pmap_ref(expr.func)
            # pmap_compat(axis_name="i") without the function is a decorator.
            if ref is not None and not expr.args and not keyword(expr, "fun"):
                return ref
        return None

    def pmapped_call(self, expr: ast.AST) -> ast.expr | None:
        """The pmap reference of an expression that makes a pmapped function (``pmap(f)``)."""
        if isinstance(expr, ast.Call) and (expr.args or keyword(expr, "fun")):
            return self.pmap_ref(expr.func)
        return None

    def pmapped_value(self, expr: ast.AST) -> ast.expr | None:
        """The pmap reference of a pmapped function: ``pmap(f)`` or a name bound to one."""
        name = _dotted(expr)
        if name is not None and name in self.pmapped:
            if isinstance(expr, ast.Name) and not self._rebound_pmapped(expr):
                return None
            return self.pmapped[name]
        return self.pmapped_call(expr)

    def _rebound_pmapped(self, name: ast.Name) -> bool:
        """For a module-level use: whether the last module-level binding before it is a pmap.

        A notebook (or script) that defines ``f`` plainly in one cell and a pmapped ``f`` in a
        later one: a use in between is the plain one. A use inside a function runs later, so
        any pmapped binding counts there.
        """
        parent = self.parents.get(name)
        while parent is not None:
            if isinstance(parent, _FUNCTIONS):
                return True
            parent = self.parents.get(parent)
        if self._module_bindings is None:
            self._module_bindings = {}
            for stmt in self.tree.body:
                for bound, node in _module_binds(stmt):
                    self._module_bindings.setdefault(bound, []).append(node)
        at = (name.lineno, name.col_offset)
        before = [
            n
            for n in self._module_bindings.get(name.id, ())
            if (n.end_lineno or n.lineno, n.end_col_offset or 0) <= at
        ]
        if not before:
            return True
        last = before[-1]
        if isinstance(last, ast.FunctionDef | ast.AsyncFunctionDef):
            return bool(self.decorator_refs(last))
        if isinstance(last, ast.Assign):
            return self.pmapped_call(last.value) is not None
        return False

    def mapped_function(self, expr: ast.AST) -> ast.AST | None:
        """The function a pmapped callable maps (an expression or a ``def``), if known."""
        name = _dotted(expr)
        if name is not None and name in self.pmapped:
            return self.mapped.get(name)
        return _mapped_arg(expr) if isinstance(expr, ast.Call) else None

    def decorator_refs(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef
    ) -> list[tuple[ast.expr, ast.expr]]:
        found = []
        for d in node.decorator_list:
            ref = self.pmap_ref(d)
            if ref is not None:
                found.append((d, ref))
        return found

    def is_jax(self, ref: ast.AST) -> bool:
        return self.qual(ref) == PMAP


def _bound_in(scope: ast.AST) -> frozenset[str]:
    """The names a function, lambda, comprehension or class body binds in its own scope.

    Parameters, assignment, loop, ``with``, ``except`` and walrus targets, imports, and nested
    ``def``/``class`` names; not the names it declares ``global`` or ``nonlocal``, and not what
    nested scopes bind (a walrus in a comprehension binds in the enclosing function, as Python).
    """
    names: set[str] = set()
    declared: set[str] = set()
    if isinstance(scope, _FUNCTIONS):
        a = scope.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
            if arg is not None:
                names.add(arg.arg)
        body: list[ast.AST] = [scope.body] if isinstance(scope, ast.Lambda) else list(scope.body)
    elif isinstance(scope, _COMPREHENSIONS):
        body = [g.target for g in scope.generators]
    elif isinstance(scope, ast.ClassDef):
        body = list(scope.body)
    else:
        return frozenset()
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            declared.update(node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
            stack.extend(node.decorator_list)  # evaluated here; the body is its own scope
            continue
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            names.add(node.name)
        if isinstance(node, _BINDING_SCOPES) and node is not scope:
            continue  # its own scope (its defaults and decorators aside: a rare shadowing)
        stack.extend(ast.iter_child_nodes(node))
    return frozenset(names - declared)


def _module_binds(stmt: ast.stmt) -> Iterator[tuple[str, ast.stmt]]:
    """The names a module-level statement binds, with the statement."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield stmt.name, stmt
    elif isinstance(stmt, ast.Assign):
        for t in stmt.targets:
            if isinstance(t, ast.Name):
                yield t.id, stmt
    elif isinstance(stmt, ast.Import | ast.ImportFrom):
        for a in stmt.names:
            yield (a.asname or a.name).split(".")[0], stmt


def _mapped_arg(call: ast.expr) -> ast.expr | None:
    """The function argument of ``pmap(f, ...)`` (or of ``partial(pmap, ...)(f)``)."""
    assert isinstance(call, ast.Call)
    return call.args[0] if call.args else keyword(call, "fun")


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None
