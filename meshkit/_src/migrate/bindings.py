"""Where a file binds its names, for the flow analysis of ``meshkit migrate``.

Names are bound by position: a read sees the nearest assignment before it in its scope, and in
a loop also the assignments after it in the same loop (the next iteration's); a name a scope
does not bind is its enclosing scope's (any binding there, whenever). A binding is an
assignment (also annotated, augmented and ``:=``), a ``for`` target or a comprehension's, or
``lst.append(v)`` / ``extend`` / ``insert``; tuple targets bind each element, attributes
(``self.state = ...``) bind file-wide.

What a binding binds is found lazily, by the kinds of values (`meshkit._src.migrate.flow.Flow`,
through `BoundKinds`): the kind of a value depends on the bindings it reads, and those on
values, in any order the file allows.
"""

from __future__ import annotations

import ast
import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .facts import LIST, ScannedFile, element

Pos = tuple[int, int]
_Where = tuple[ast.AST, tuple[ast.AST, ...], tuple[ast.AST, ...]]  # function, comps, loops
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class BoundKinds(Protocol):
    """How the kind of what a binding binds is found (`meshkit._src.migrate.flow.Flow`)."""

    def kind(self, expr: ast.AST) -> str | None:
        """The kind of an expression's value, or None."""
        ...

    def augmented(self, target: ast.Name, value: ast.expr) -> str | None:
        """The kind ``target op= value`` binds, ``target`` being the name read."""
        ...

    def appended(self, arg: ast.expr, each: bool) -> str | None:
        """The kind ``lst.append(arg)`` (``each``) or ``lst.extend(arg)`` binds to ``lst``."""
        ...

    def iterated(self, it: ast.expr) -> str | None:
        """The kind a ``for`` target over ``it`` binds."""
        ...


@dataclass
class Binding:
    """One binding of a name or attribute.

    Attributes:
        pos: where it takes effect: the end of its statement (a loop's target: its start).
        kind: the kind of what it binds, found when asked.
        loops: the loops of its scope it sits in, innermost first.
    """

    pos: Pos
    kind: Callable[[], str | None]
    loops: tuple[ast.AST, ...]


class Bindings:
    """Every binding of one file's names and attributes, and the scopes they are in.

    Args:
        sc: the file.
        kinds: what finds the kind of a bound value (called only when a binding's kind is
            asked, so it may read these bindings).

    Attributes:
        names: (scope, name) -> its bindings, by position.
        attrs: dotted attribute (``self.state``) -> its bindings in the file, by position.
        qualnames: each function and class -> its qualified name in the file.
        imports: an imported name -> (module, level, the name imported from it or None).
        made: a dotted name -> what was called to make it (``x = Trainer(...)``: ``Trainer``).
        bound: every name the file binds (so it is not a builtin).
    """

    def __init__(self, sc: ScannedFile, kinds: BoundKinds) -> None:
        self.sc = sc
        self.kinds = kinds
        self.names: dict[tuple[ast.AST, str], list[Binding]] = {}
        self.attrs: dict[str, list[Binding]] = {}
        self.where = self._place()
        self.qualnames: dict[ast.AST, str] = {}
        self.imports: dict[str, tuple[str, int, str | None]] = {}  # name -> (module, level, attr)
        self.made: dict[str, ast.expr] = {}
        self._build()

    def _build(self) -> None:
        sc, kinds = self.sc, self.kinds
        for node in sc.nodes:
            if isinstance(node, (*FUNCTIONS, ast.ClassDef)):
                self.qualnames[node] = self._qualname(node)
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name != "*":
                        self.imports[a.asname or a.name] = (node.module or "", node.level, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = (a.name, 0, None)
                    else:
                        top = a.name.split(".")[0]
                        self.imports[top] = (top, 0, None)
        for node in sc.nodes:
            if isinstance(node, ast.Assign):
                stop = end(node)
                for t in node.targets:
                    self._bind(t, stop, self._thunk(node.value))
                made = dotted_name(node.targets[0])
                if made is not None and isinstance(node.value, ast.Call):
                    self.made.setdefault(made, node.value.func)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                self._bind(node.target, end(node), self._thunk(node.value))
            elif isinstance(node, ast.AugAssign):
                target, value = node.target, node.value
                if isinstance(target, ast.Name):
                    load = ast.Name(target.id, ast.Load())
                    ast.copy_location(load, target)
                    sc.parents[load] = node
                    self.where[load] = self.where[target]
                    self._bind(target, end(node), lambda t=load, v=value: kinds.augmented(t, v))
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                it = node.iter
                # A comprehension's element is written before its `for`: bound from its start.
                at = node.target if isinstance(node, ast.For | ast.AsyncFor) else sc.parents[node]
                self._bind(node.target, position(at), lambda it=it: kinds.iterated(it))
            elif isinstance(node, ast.NamedExpr):
                self._bind(node.target, end(node), self._thunk(node.value))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "extend", "insert")
                and node.args
                and isinstance(node.func.value, ast.Name)
            ):
                arg = node.args[-1]
                each = node.func.attr != "extend"
                self._bind(node.func.value, end(node), lambda a=arg, e=each: kinds.appended(a, e))
        for bindings in (*self.names.values(), *self.attrs.values()):
            bindings.sort(key=lambda b: b.pos)
        self.starts = {key: [b.pos for b in bs] for key, bs in self.names.items()}
        self.bound = {name for _, name in self.names} | set(self.sc.defs)

    def _thunk(self, value: ast.expr) -> Callable[[], str | None]:
        kind = self.kinds.kind
        return lambda: kind(value)

    def _bind(
        self,
        target: ast.expr,
        pos: Pos,
        kind: Callable[[], str | None],
    ) -> None:
        if isinstance(target, ast.Name):
            scope = self.scope(target)
            loops = self.loops(target, scope)
            binding = Binding(pos, kind, loops)
            self.names.setdefault((scope, target.id), []).append(binding)
        elif isinstance(target, ast.Tuple | ast.List):
            starred = False
            for i, elt in enumerate(target.elts):
                if isinstance(elt, ast.Starred):
                    starred = True
                    self._bind(elt.value, pos, lambda k=kind: LIST if k() else None)
                    continue
                # After a starred target, places count from the end.
                at = i - len(target.elts) if starred else i
                self._bind(elt, pos, lambda k=kind, at=at: element(k(), at))
        elif isinstance(target, ast.Attribute):
            key = dotted_name(target)
            if key is not None:
                self.attrs.setdefault(key, []).append(Binding(pos, kind, ()))

    def _place(self) -> dict[ast.AST, _Where]:
        """Every node's function, comprehensions and loops, in one pass down the tree.

        (Walking up from each node instead costs the depth per node: quadratic on a sum of
        thousands of terms.)
        """
        top: _Where = (self.sc.tree, (), ())
        where: dict[ast.AST, _Where] = {self.sc.tree: top}
        stack: list[tuple[ast.AST, _Where]] = [(self.sc.tree, top)]
        while stack:
            node, (fn, comps, loops) = stack.pop()
            for child in ast.iter_child_nodes(node):
                here = (fn, comps, loops)
                if isinstance(node, (*FUNCTIONS, ast.Lambda)):
                    if child not in getattr(node, "decorator_list", ()):
                        here = (node, (), ())
                elif isinstance(node, _COMPREHENSIONS):
                    here = (fn, (node, *comps), loops)
                elif isinstance(node, ast.comprehension) and child is node.iter:
                    outer = self.sc.parents[node]
                    if outer.generators[0] is node:  # type: ignore[attr-defined]
                        here = where[outer]  # the first iterable is the enclosing scope's
                elif isinstance(node, _LOOPS) and child in node.body:
                    here = (fn, comps, (node, *loops))
                where[child] = here
                stack.append((child, here))
        return where

    def scope(self, node: ast.AST) -> ast.AST:
        """The function, lambda, comprehension or module whose name ``node`` is."""
        fn, comps, _ = self.where[node]
        for comp in comps:  # innermost first
            if self._comp_binds(comp, node):
                return comp
        return fn

    def _comp_binds(self, comp: ast.AST, node: ast.AST) -> bool:
        if not isinstance(node, ast.Name):
            return False
        assert isinstance(comp, _COMPREHENSIONS)
        for g in comp.generators:
            for n in ast.walk(g.target):
                if isinstance(n, ast.Name) and n.id == node.id:
                    return True
        return False

    def loops(self, node: ast.AST, scope: ast.AST) -> tuple[ast.AST, ...]:
        """The loops of ``scope`` whose body holds ``node``, innermost first."""
        fn, _, loops = self.where[node]
        return loops if scope is fn else ()

    def local(self, name: ast.Name) -> bool:
        """Whether a bare name is bound in the file (so it is not the builtin)."""
        return name.id in self.bound

    def seen(self, scope: ast.AST, name: ast.Name, pos: Pos) -> list[Binding]:
        """The bindings of ``name`` in ``scope`` (its own or an enclosing one) seen at ``pos``.

        The binding before it, and the later ones of the loops of ``scope`` that hold ``name``
        (the next iteration's).
        """
        bindings = self.names.get((scope, name.id))
        if not bindings:
            return []
        starts = self.starts[(scope, name.id)]
        i = bisect.bisect_left(starts, pos)
        seen = bindings[i - 1 : i]
        loops = self.loops(name, scope)
        if loops:
            outer = loops[-1]
            stop = end(outer)
            seen += [b for b in bindings[i:] if b.pos <= stop and outer in b.loops]
        return seen

    def enclosing_class(self, node: ast.AST) -> ast.ClassDef | None:
        """The class whose body holds ``node``, at any depth, or None."""
        parent = self.sc.parents.get(node)
        while parent is not None and not isinstance(parent, ast.ClassDef):
            parent = self.sc.parents.get(parent)
        return parent

    def _qualname(self, node: ast.AST) -> str:
        parts = [getattr(node, "name", "")]
        parent = self.sc.parents.get(node)
        while parent is not None:
            if isinstance(parent, (*FUNCTIONS, ast.ClassDef)):
                parts.append(parent.name)
            parent = self.sc.parents.get(parent)
        return ".".join(reversed(parts))


def position(node: ast.AST) -> Pos:
    """(line, column) of a node's start."""
    return (node.lineno, node.col_offset)  # type: ignore[attr-defined]


def end(node: ast.AST) -> Pos:
    """(line, column) of a node's end."""
    return (node.end_lineno or node.lineno, node.end_col_offset or 0)  # type: ignore[attr-defined]


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def has_param(fn: ast.AST, name: str) -> bool:
    """Whether a function or lambda has a parameter called ``name``."""
    a = fn.args  # type: ignore[attr-defined]
    every = (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
    return any(p is not None and p.arg == name for p in every)
