"""Where pmap outputs flow, for ``meshkit migrate``'s MK010 (host reads of pmap outputs).

A *device-stacked* value has one entry per device along a leading axis: what a pmapped function
returns, and what ``replicate`` / ``shard`` / ``jax.device_put_replicated`` make. Reading one on
the host (``x[0]``, ``np.asarray(x)``, ``jax.device_get(x)``, ``float(x)``, a ``tree_map`` of
``lambda a: a[0]``) gives this process's entries with `meshkit.pmap_compat`'s defaults, as
``jax.pmap`` did, and needs entries of other hosts with ``global_outputs=True`` in a
multi-process run. This module follows such values through a file, and through the other files
of the same run:

* names, by position: a read sees the nearest assignment before it in its function, and in a
  loop also the assignments after it in the same loop (the next iteration's); a name a function
  does not assign is its enclosing function's or the module's (any assignment there);
* tuple unpacking (``state, metrics = p_step(...)``), ``for`` targets and comprehensions over a
  list of such values, ``lst.append(v)``, attributes (``self.state = ...``, file-wide), fields
  (``state.params``, ``metrics["loss"]``), arithmetic and ``jnp`` functions of them, and
  methods that keep them on device (``state.replace(...)``, ``x.mean()``);
* functions: a function returning such a value makes its calls such values; a parameter that
  some call (in any file of the run) passes such a value is one inside the function, so the
  read in a helper (``def get_first(xs): return tree_map(lambda x: x[0], xs)`` in ``utils.py``)
  is found where it is written.

A pmapped function whose returns are all tuple displays returns a tuple of outputs: ``out[0]``
picks an output there, not a device's entry. The analysis is flow-insensitive across branches
and assumes no aliasing through containers it does not follow; what it cannot follow it does
not report (no finding is better than a wrong one).
"""

from __future__ import annotations

import ast
import bisect
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["STACKED", "Facts", "Flow", "Read", "ScannedFile", "analyze", "dotted_name"]


class ScannedFile(Protocol):
    """What the flow analysis reads of a file the scanner has parsed and resolved."""

    path: str
    tree: ast.Module
    nodes: list[ast.AST]  # every node, in `ast.walk` order
    parents: dict[ast.AST, ast.AST]
    defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]  # functions by dotted name

    def qual(self, node: ast.AST) -> str | None:
        """The dotted name that ``node`` refers to, through the file's imports."""
        ...

    def pmapped_value(self, expr: ast.AST) -> ast.expr | None:
        """The pmap that makes ``expr`` a pmapped function, if it is one."""
        ...

    def mapped_function(self, expr: ast.AST) -> ast.AST | None:
        """The function a pmapped ``expr`` maps, where the file defines it."""
        ...


STACKED = "stacked"  # device axis first: an entry per device
TUPLE = "tuple"  # a tuple of stacked outputs (a pmapped function returning a tuple)
LIST = "list"  # a list or dict of stacked values (metrics appended each step)
_ORDER = {TUPLE: 3, STACKED: 2, LIST: 1}

# Calls that make stacked values.
SOURCES = frozenset(
    {
        "flax.jax_utils.replicate",
        "flax.training.common_utils.shard",
        "flax.training.common_utils.shard_prng_key",
        "jax.device_put_replicated",
        "jax.device_put_sharded",
        "meshkit.replicate",
        "meshkit.shard",
        "meshkit.shard_prng_key",
        "meshkit.device_put_replicated",
        "meshkit.device_put_sharded",
    }
)
TREE_MAPS = frozenset({"jax.tree_util.tree_map", "jax.tree.map", "jax.tree_map"})
_METADATA = frozenset({"shape", "dtype", "ndim", "size", "sharding", "nbytes", "itemsize"})
_HOST_METHODS = frozenset({"item", "tolist", "__array__", "tobytes"})
_TO_PYTHON = frozenset({"float", "int", "bool", "complex"})
_Pos = tuple[int, int]
_Scope = ast.AST
_Where = tuple[ast.AST, tuple[ast.AST, ...], tuple[ast.AST, ...]]  # function, comps, loops
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _join(*kinds: str | None) -> str | None:
    # Callers pass lists, not generators: a kind resolves through the kinds of what flowed into
    # it (a value passed through 3,000 names recurses 3,000 deep), and since Python 3.12 a
    # generator consumed from C (`*gen`) adds a C frame per level under a fixed C limit that
    # no recursion limit raises; comprehensions are inlined there and cost Python frames only.
    best = None
    for k in kinds:
        if k is not None and (best is None or _ORDER[k] > _ORDER[best]):
            best = k
    return best


def _element(kind: str | None) -> str | None:
    """What iterating over, or indexing, a value of this kind gives (not a device's entry)."""
    return STACKED if kind in (TUPLE, LIST) else None


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


@dataclass
class Facts:
    """What the files of one run know of each other's functions.

    Functions are keyed by (path, qualified name in the file: ``f``, ``Trainer.step``).

    Attributes:
        modules: path -> its dotted name parts (``examples/imagenet/train.py`` -> ``("examples",
            "imagenet", "train")``), to resolve imports between the run's files.
        returns: functions whose return value is stacked, and its kind.
        params: functions' parameters that some call passes a stacked value, and its kind.
        tuples: functions every return of which is a tuple display (their pmap returns a tuple).
        classes: the classes the run's files define.
        defs: every function definition of the run's files.
    """

    modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    returns: dict[tuple[str, str], str] = field(default_factory=dict)
    params: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    tuples: set[tuple[str, str]] = field(default_factory=set)
    classes: set[tuple[str, str]] = field(default_factory=set)
    defs: dict[tuple[str, str], ast.FunctionDef | ast.AsyncFunctionDef] = field(
        default_factory=dict
    )

    @classmethod
    def for_paths(cls, paths: Mapping[str, object]) -> Facts:
        """Empty facts for a run over these paths."""
        facts = cls()
        for path in paths:
            parts = os.path.normpath(path).replace(os.sep, "/").split("/")
            name = parts[-1].rsplit(".", 1)[0]
            parts = [p for p in parts[:-1] if p not in ("", ".", "..")]
            facts.modules[path] = (*parts, name) if name != "__init__" else tuple(parts)
        return facts

    def receives(self, path: str) -> bool:
        """Whether some function of ``path`` is passed a stacked value by the run's files."""
        return any(p == path and names for (p, _), names in self.params.items())

    def resolve(self, importer: str, module: str, level: int) -> str | None:
        """The run's file a module name imported from ``importer`` is, or None.

        Relative imports count from the importer's package; absolute ones match the end of a
        file's dotted path (``import input_pipeline`` beside the script, ``from
        examples.imagenet import train``), the file nearest the importer first.
        """
        here = self.modules.get(importer)
        if here is None:
            return None
        wanted = tuple(module.split(".")) if module else ()
        if level:
            base = here[: len(here) - level] if len(here) >= level else ()
            target = (*base, *wanted)
            for path, parts in self.modules.items():
                if parts == target:
                    return path
            return None
        best, best_shared = None, -1
        for path, parts in self.modules.items():
            if wanted and parts[-len(wanted) :] == wanted and path != importer:
                shared = _shared(parts[:-1], here[:-1])
                if shared > best_shared:
                    best, best_shared = path, shared
        return best


@dataclass
class _Binding:
    pos: _Pos
    kind: Callable[[], str | None]
    loops: tuple[ast.AST, ...]  # the loops of its scope it sits in


class Flow:
    """Stacked values in one file, given what the run knows of other files (`Facts`)."""

    def __init__(self, scanner: ScannedFile, facts: Facts) -> None:
        self.sc = scanner
        self.facts = facts
        self.path = scanner.path
        self.names: dict[tuple[_Scope, str], list[_Binding]] = {}
        self.attrs: dict[str, list[_Binding]] = {}
        self.memo: dict[ast.AST, str | None] = {}
        self.where = self._place()
        self.qualnames: dict[ast.AST, str] = {}
        self.imports: dict[str, tuple[str, int, str | None]] = {}  # name -> (module, level, attr)
        self.made: dict[str, ast.expr] = {}  # dotted name -> what was called to make it
        self._resolving: set[str] = set()
        self._build()

    # ---- bindings -----------------------------------------------------------------------------

    def _build(self) -> None:
        sc = self.sc
        for node in sc.nodes:
            if isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
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
                end = _end(node)
                for t in node.targets:
                    self._bind(t, end, self._thunk(node.value))
                made = dotted_name(node.targets[0])
                if made is not None and isinstance(node.value, ast.Call):
                    self.made.setdefault(made, node.value.func)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                self._bind(node.target, _end(node), self._thunk(node.value))
            elif isinstance(node, ast.AugAssign):
                target, value = node.target, node.value
                if isinstance(target, ast.Name):
                    load = ast.Name(target.id, ast.Load())
                    ast.copy_location(load, target)
                    sc.parents[load] = node
                    self.where[load] = self.where[target]
                    self._bind(target, _end(node), lambda t=load, v=value: self._augmented(t, v))
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                it = node.iter
                # A comprehension's element is written before its `for`: bound from its start.
                at = node.target if isinstance(node, ast.For | ast.AsyncFor) else sc.parents[node]
                self._bind(node.target, _pos(at), lambda it=it: self._iterated(it))
            elif isinstance(node, ast.NamedExpr):
                self._bind(node.target, _end(node), self._thunk(node.value))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "extend", "insert")
                and node.args
                and isinstance(node.func.value, ast.Name)
            ):
                arg = node.args[-1]
                each = node.func.attr != "extend"
                self._bind(node.func.value, _end(node), lambda a=arg, e=each: self._appended(a, e))
        for bindings in (*self.names.values(), *self.attrs.values()):
            bindings.sort(key=lambda b: b.pos)
        self.starts = {key: [b.pos for b in bs] for key, bs in self.names.items()}
        self.bound = {name for _, name in self.names} | set(self.sc.defs)

    def _thunk(self, value: ast.expr) -> Callable[[], str | None]:
        return lambda: self.kind(value)

    def _augmented(self, target: ast.Name, value: ast.expr) -> str | None:
        return STACKED if STACKED in (self.kind(target), self.kind(value)) else None

    def _appended(self, arg: ast.expr, each: bool) -> str | None:
        kind = self.kind(arg)
        if kind is None:
            return None
        return LIST if each else kind

    def _iterated(self, it: ast.expr) -> str | None:
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.args:
            if it.func.id in ("enumerate", "reversed", "list", "sorted") and not self._local(
                it.func
            ):
                inner = _element(self.kind(it.args[0]))
                return TUPLE if inner and it.func.id == "enumerate" else inner
            if it.func.id == "zip" and not self._local(it.func):
                return TUPLE if any(_element(self.kind(a)) for a in it.args) else None
        return _element(self.kind(it))

    def _bind(self, target: ast.expr, pos: _Pos, kind: Callable[[], str | None]) -> None:
        if isinstance(target, ast.Name):
            scope = self._scope(target)
            loops = self._loops(target, scope)
            self.names.setdefault((scope, target.id), []).append(_Binding(pos, kind, loops))
        elif isinstance(target, ast.Tuple | ast.List):
            for elt in target.elts:
                if isinstance(elt, ast.Starred):
                    self._bind(elt.value, pos, lambda k=kind: LIST if k() else None)
                else:
                    self._bind(elt, pos, lambda k=kind: _element(k()))
        elif isinstance(target, ast.Attribute):
            key = dotted_name(target)
            if key is not None:
                self.attrs.setdefault(key, []).append(_Binding(pos, kind, ()))

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
                if isinstance(node, (*_FUNCTIONS, ast.Lambda)):
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

    def _scope(self, node: ast.AST) -> _Scope:
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

    def _loops(self, node: ast.AST, scope: _Scope) -> tuple[ast.AST, ...]:
        """The loops of ``scope`` whose body holds ``node``, innermost first."""
        fn, _, loops = self.where[node]
        return loops if scope is fn else ()

    def _local(self, name: ast.Name) -> bool:
        """Whether a bare name is bound in the file (so it is not the builtin)."""
        return name.id in self.bound

    def _qualname(self, node: ast.AST) -> str:
        parts = [getattr(node, "name", "")]
        parent = self.sc.parents.get(node)
        while parent is not None:
            if isinstance(parent, (*_FUNCTIONS, ast.ClassDef)):
                parts.append(parent.name)
            parent = self.sc.parents.get(parent)
        return ".".join(reversed(parts))

    # ---- kinds --------------------------------------------------------------------------------

    def kind(self, expr: ast.AST) -> str | None:
        """Whether ``expr`` evaluates to a stacked value (and which kind), or None."""
        if expr in self.memo:
            return self.memo[expr]
        self.memo[expr] = None  # a cycle (x = x + 1 in a loop) is not a source
        kind = self._kind(expr)
        self.memo[expr] = kind
        return kind

    def _kind(self, expr: ast.AST) -> str | None:
        sc = self.sc
        if isinstance(expr, ast.Name):
            return self._name(expr)
        if isinstance(expr, ast.Attribute):
            key = dotted_name(expr)
            if key is not None and key in self.attrs:
                return _join(*[b.kind() for b in self.attrs[key]])
            if expr.attr in _METADATA:
                return None
            base = self.kind(expr.value)
            return STACKED if base in (STACKED, TUPLE) else None
        if isinstance(expr, ast.Subscript):
            base = self.kind(expr.value)
            if base is None:
                return None
            if base in (TUPLE, LIST):
                return STACKED
            index = expr.slice
            if isinstance(index, ast.Constant) and isinstance(index.value, str):
                return STACKED  # metrics["loss"]
            return None  # a device's entry, or entries: read on the host (see reads)
        if isinstance(expr, ast.Call):
            return self._call(expr)
        if isinstance(expr, ast.Tuple):
            return TUPLE if any(self.kind(e) for e in expr.elts) else None
        if isinstance(expr, ast.List | ast.Set):
            return LIST if any(self.kind(e) for e in expr.elts) else None
        if isinstance(expr, ast.Dict):
            return LIST if any(self.kind(v) for v in expr.values) else None
        if isinstance(expr, ast.BinOp):
            return STACKED if STACKED in (self.kind(expr.left), self.kind(expr.right)) else None
        if isinstance(expr, ast.UnaryOp):
            return STACKED if self.kind(expr.operand) == STACKED else None
        if isinstance(expr, ast.IfExp):
            return _join(self.kind(expr.body), self.kind(expr.orelse))
        if isinstance(expr, ast.Starred | ast.NamedExpr | ast.Await):
            return self.kind(expr.value)
        if isinstance(expr, ast.ListComp | ast.GeneratorExp):
            return LIST if self.kind(expr.elt) else None
        del sc
        return None

    def _name(self, name: ast.Name) -> str | None:
        scope = self._scope(name)
        pos = _pos(name)
        while True:
            bindings = self.names.get((scope, name.id))
            if bindings:
                starts = self.starts[(scope, name.id)]
                found = self._at(bindings, starts, pos, self._loops(name, scope))
                if found is not None:
                    return found[0]
            if isinstance(scope, (*_FUNCTIONS, ast.Lambda)) and _has_param(scope, name.id):
                return self._param(scope, name.id)
            if scope is self.sc.tree:
                return None
            scope = self._scope(scope)
            pos = (1 << 30, 0)  # an enclosing scope: whatever it binds, whenever

    def _at(
        self, bindings: list[_Binding], starts: list[_Pos], pos: _Pos, loops: tuple[ast.AST, ...]
    ) -> tuple[str | None] | None:
        """The kind a read at ``pos`` sees: the binding before it, and its loops' later ones."""
        i = bisect.bisect_left(starts, pos)
        seen = bindings[i - 1 : i]
        if loops:
            outer = loops[-1]
            end = _end(outer)
            seen += [b for b in bindings[i:] if b.pos <= end and outer in b.loops]
        if not seen:
            return None
        return (_join(*[b.kind() for b in seen]),)

    def _param(self, fn: ast.AST, name: str) -> str | None:
        if isinstance(fn, ast.Lambda):
            return None
        return self.facts.params.get((self.path, self.qualnames[fn]), {}).get(name)

    def _call(self, call: ast.Call) -> str | None:
        sc = self.sc
        func = call.func
        if sc.pmapped_value(func) is not None:
            return TUPLE if self._returns_tuples(func) else STACKED
        qual = sc.qual(func)
        if qual in SOURCES:
            return STACKED
        if qual in TREE_MAPS:
            if call.args and self._keeps_on_device(call.args[0]):
                return _join(*[self.kind(a) for a in call.args[1:]])
            return None
        if isinstance(func, ast.Name) and func.id == "abs" and not self._local(func):
            return STACKED if call.args and self.kind(call.args[0]) == STACKED else None
        if qual is not None and qual.startswith("jax.numpy."):
            return STACKED if any(self.kind(a) == STACKED for a in call.args) else None
        if isinstance(func, ast.Attribute):
            base = self.kind(func.value)
            if base == STACKED and func.attr not in _HOST_METHODS:
                return STACKED  # state.replace(...), x.mean(), x.block_until_ready()
            if base == LIST and func.attr in ("pop", "copy"):
                return STACKED if func.attr == "pop" else LIST
        target = self.callee(call)
        if target is not None:
            return self.facts.returns.get(target[0])
        return None

    def _returns_tuples(self, func: ast.expr) -> bool:
        """Whether the function a pmapped callable maps returns a tuple of outputs."""
        fun = self.sc.mapped_function(func)
        while isinstance(fun, ast.Call) and fun.args:  # functools.partial(f, ...)
            fun = fun.args[0]
        if isinstance(fun, ast.Lambda):
            return isinstance(fun.body, ast.Tuple)
        if isinstance(fun, _FUNCTIONS):
            return _all_tuples(fun)
        if isinstance(fun, ast.Name | ast.Attribute):
            target = self.function_key(fun)
            return target is not None and target in self.facts.tuples
        return False

    def _keeps_on_device(self, fn: ast.expr) -> bool:
        """Whether a function tree_map applies keeps each leaf a stacked array.

        A lambda that reads nothing on the host (``lambda p, g: p - lr * g``), or a jax.numpy /
        jax.lax function. Anything else (``unreplicate``, a helper) may not: not followed.
        """
        if isinstance(fn, ast.Lambda):
            return self.read_function(fn) is None
        qual = self.sc.qual(fn)
        return qual is not None and qual.startswith(("jax.numpy.", "jax.lax."))

    # ---- calls between functions -------------------------------------------------------------

    def function_key(self, func: ast.expr) -> tuple[str, str] | None:
        """(path, qualified name) of the function a callee expression names, if in the run."""
        if isinstance(func, ast.Name):
            defs = self.sc.defs.get(func.id)
            if defs:
                return (self.path, self.qualnames[defs[0]])
            imported = self.imports.get(func.id)
            if imported is None:
                return None
            module, level, attr = imported
            if attr is None:  # `import x`: a module, not a function
                return None
            path = self.facts.resolve(self.path, module, level)
            return None if path is None else (path, attr)
        if isinstance(func, ast.Attribute) and (owned := self._instance(func.value)):
            return (owned[0], f"{owned[1]}.{func.attr}")
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in ("self", "cls"):
                cls = self._enclosing_class(func)
                if cls is not None:
                    return (self.path, f"{self.qualnames[cls]}.{func.attr}")
                return None
            imported = self.imports.get(owner)
            if imported is None:
                return None
            module, level, attr = imported
            name = module if attr is None else (f"{module}.{attr}" if module else attr)
            path = self.facts.resolve(self.path, name, level)
            return None if path is None else (path, func.attr)
        return None

    def callee(self, call: ast.Call) -> tuple[tuple[str, str], int] | None:
        """(function key, how many leading parameters the call does not pass: self)."""
        key = self.function_key(call.func)
        if key is None:
            return None
        func = call.func
        bound = isinstance(func, ast.Attribute) and (
            (isinstance(func.value, ast.Name) and func.value.id in ("self", "cls"))
            or self._instance(func.value) is not None
        )
        if key in self.facts.classes:  # a class called: its __init__, self not passed
            return (key[0], f"{key[1]}.__init__"), 1
        return key, int(bound)

    def _instance(self, value: ast.expr) -> tuple[str, str] | None:
        """The run's class (path, qualified name) that ``value`` is an instance of, if known.

        Known for a name or attribute assigned a call of the class (``self._checkpointer =
        checkpointing.Checkpointer(...)``), anywhere in the file.
        """
        key = dotted_name(value)
        if key is None:
            return None
        made = self.made.get(key)
        if made is None or key in self._resolving:  # x = x.copy(): not a class's instance
            return None
        self._resolving.add(key)
        try:
            cls = self.function_key(made)
        finally:
            self._resolving.discard(key)
        return cls if cls is not None and cls in self.facts.classes else None

    def _enclosing_class(self, node: ast.AST) -> ast.ClassDef | None:
        parent = self.sc.parents.get(node)
        while parent is not None and not isinstance(parent, ast.ClassDef):
            parent = self.sc.parents.get(parent)
        return parent

    def export(self) -> bool:
        """Add what this file says of functions (returns, parameters, tuples); True if new."""
        facts, changed = self.facts, False
        for node, qual in self.qualnames.items():
            if not isinstance(node, _FUNCTIONS):
                continue
            key = (self.path, qual)
            if key not in facts.tuples and _all_tuples(node):
                facts.tuples.add(key)
                changed = True
            if key not in facts.returns:
                kind = _join(*[self.kind(r.value) for r in _returns(node) if r.value])
                if kind is not None:
                    facts.returns[key] = kind
                    changed = True
        for node in self.sc.nodes:
            if not isinstance(node, ast.Call) or not (node.args or node.keywords):
                continue
            target = self.callee(node)
            if target is None:
                continue
            (path, qual), skip = target
            params = self._signature(path, qual)
            if params is None:
                continue
            known = facts.params.setdefault((path, qual), {})
            passed = [(params[i + skip], a) for i, a in enumerate(node.args[: len(params) - skip])]
            passed += [(k.arg, k.value) for k in node.keywords if k.arg in params]
            for name, arg in passed:
                if isinstance(arg, ast.Starred) or name in known:
                    continue
                kind = self.kind(arg)
                if kind is not None:
                    known[name] = kind
                    changed = True
        return changed

    def _signature(self, path: str, qual: str) -> list[str] | None:
        fn = self.facts.defs.get((path, qual))
        if fn is None:
            return None
        a = fn.args
        return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]

    # ---- reads --------------------------------------------------------------------------------

    def read_function(self, fn: ast.expr) -> str | None:
        """What a function given to tree_map reads of each leaf on the host, or None."""
        if isinstance(fn, ast.Lambda) and fn.args.args:
            param = fn.args.args[0].arg
            for node in ast.walk(fn.body):
                what = self._leaf_read(node, param)
                if what is not None:
                    return what
            return None
        qual = self.sc.qual(fn)
        if qual is not None and (qual.startswith("numpy.") or qual == "jax.device_get"):
            return "whole"
        if isinstance(fn, ast.Name) and fn.id in _TO_PYTHON and not self._local(fn):
            return "whole"
        return None

    def _leaf_read(self, node: ast.AST, param: str) -> str | None:
        def is_param(e: ast.AST) -> bool:
            return isinstance(e, ast.Name) and e.id == param

        if (
            isinstance(node, ast.Subscript)
            and is_param(node.value)
            and _int_index(node.slice) is not None
        ):
            return "entry"
        if isinstance(node, ast.Call):
            if node.args and is_param(node.args[0]) and self.read_function(node.func):
                return "whole"
            func = node.func
            on_param = isinstance(func, ast.Attribute) and is_param(func.value)
            if on_param and func.attr in _HOST_METHODS:  # type: ignore[union-attr]
                return "whole"
        return None

    def reads(self) -> Iterator[Read]:
        """Every host read of a stacked value in the file."""
        for node in self.sc.nodes:
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                index = _int_index(node.slice)
                if index is not None and self.kind(node.value) == STACKED:
                    plain = isinstance(node.slice, ast.Constant) and index == 0
                    fix = "meshkit.unreplicate" if plain else ""
                    yield Read(node, "entry", fix, index=index)
            elif isinstance(node, ast.Call):
                read = self._call_read(node)
                if read is not None:
                    yield read

    def _call_read(self, call: ast.Call) -> Read | None:
        sc, func, args = self.sc, call.func, call.args
        qual = sc.qual(func)
        if qual in TREE_MAPS and len(args) >= 2:
            what = self.read_function(args[0])
            if what is None or not any(self.kind(a) for a in args[1:]):
                return None
            first = what == "entry" and _takes_first(args[0])
            fix = "meshkit.unreplicate" if first and len(args) == 2 and not call.keywords else ""
            return Read(call, what, fix, keep=1, index=0 if first else None)
        if not args or isinstance(args[0], ast.Starred):
            on_value = isinstance(func, ast.Attribute) and func.attr in _HOST_METHODS
            if on_value and self.kind(func.value) == STACKED:  # type: ignore[union-attr]
                return Read(call, "whole")
            return None
        kind = self.kind(args[0])
        if kind is None:
            return None
        single = len(args) == 1 and not call.keywords and kind in (STACKED, TUPLE)
        if qual == "jax.device_get":
            return Read(call, "whole", "meshkit.local_from_global" if single else "")
        if qual is not None and qual.startswith("numpy."):
            simple = qual in ("numpy.array", "numpy.asarray") and single and kind == STACKED
            return Read(call, "whole", "meshkit.local_from_global" if simple else "")
        if isinstance(func, ast.Name) and func.id in _TO_PYTHON and not self._local(func):
            return Read(call, "whole") if kind == STACKED else None
        return None


def analyze(scanners: Mapping[str, ScannedFile], facts: Facts, rounds: int = 8) -> Facts:
    """Fill ``facts`` from the run's files until nothing new is learnt (or ``rounds``)."""
    flows = {path: Flow(sc, facts) for path, sc in scanners.items()}
    for path, flow in flows.items():
        for node, qual in flow.qualnames.items():
            if isinstance(node, _FUNCTIONS):
                facts.defs[(path, qual)] = node
            else:
                facts.classes.add((path, qual))
    for _ in range(rounds):
        changed = False
        for path, flow in list(flows.items()):
            flow.memo.clear()
            try:
                changed = flow.export() or changed
            except RecursionError:  # a chain deeper than the stack: what it said still holds
                del flows[path]  # (scan_source reports that file's own error)
        if not changed:
            break
    return facts


def _pos(node: ast.AST) -> _Pos:
    return (node.lineno, node.col_offset)  # type: ignore[attr-defined]


def _end(node: ast.AST) -> _Pos:
    return (node.end_lineno or node.lineno, node.end_col_offset or 0)  # type: ignore[attr-defined]


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _shared(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """How many leading parts two dotted paths share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _has_param(fn: ast.AST, name: str) -> bool:
    a = fn.args  # type: ignore[attr-defined]
    every = (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
    return any(p is not None and p.arg == name for p in every)


def _returns(fn: ast.AST) -> Iterator[ast.Return]:
    """The return statements of a function's own body (not of nested functions)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            yield node
        if not isinstance(node, (*_FUNCTIONS, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _all_tuples(fn: ast.AST) -> bool:
    values = [r.value for r in _returns(fn)]
    return bool(values) and all(isinstance(v, ast.Tuple) for v in values)


def _int_index(index: ast.AST) -> int | None:
    """The literal integer of ``x[k]`` / ``x[-k]`` / ``x[k, ...]``, else None."""
    if isinstance(index, ast.Tuple) and index.elts:
        index = index.elts[0]
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
        inner = _int_index(index.operand)
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
