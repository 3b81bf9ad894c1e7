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

Where names are bound is `meshkit._src.migrate.bindings`' to say, what the analysis reads and
learns is in `meshkit._src.migrate.facts`, and which uses of stacked values read them on the
host in `meshkit._src.migrate.reads`; this module says which values are stacked, and what the
run's functions return and are passed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping

from .bindings import FUNCTIONS, Bindings, dotted_name, has_param, position
from .facts import (
    LIST,
    STACKED,
    TUPLE,
    Facts,
    ScannedFile,
    element,
    is_tuple,
    join,
    tuple_of,
)
from .reads import HOST_METHODS, TREE_MAPS, HostReads, Read, int_index

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
_METADATA = frozenset({"shape", "dtype", "ndim", "size", "sharding", "nbytes", "itemsize"})
_PARTIAL = "functools.partial"
_UNKNOWN = object()  # an out_axes the analysis cannot read (computed, or through **)


class Flow:
    """Stacked values in one file, given what the run knows of other files (`Facts`).

    Args:
        scanner: the file, its names resolved.
        facts: what the run's files say of their functions (filled by `export`).
    """

    def __init__(self, scanner: ScannedFile, facts: Facts) -> None:
        self.sc = scanner
        self.facts = facts
        self.path = scanner.path
        self.memo: dict[ast.AST, str | None] = {}
        self._resolving: set[str] = set()
        self.bindings = Bindings(scanner, self)
        self.host = HostReads(scanner.qual, self.kind, self.bindings.local)

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
        if isinstance(expr, ast.Name):
            return self._name(expr)
        if isinstance(expr, ast.Attribute):
            key = dotted_name(expr)
            if key is not None and key in self.bindings.attrs:
                return join(*[b.kind() for b in self.bindings.attrs[key]])
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
            if is_tuple(base):  # out_axes=(None, 0): out[0] is one value, out[1] stacked
                return element(base, int_index(expr.slice))
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
            return join(self.kind(expr.body), self.kind(expr.orelse))
        if isinstance(expr, ast.Starred | ast.NamedExpr | ast.Await):
            return self.kind(expr.value)
        if isinstance(expr, ast.ListComp | ast.GeneratorExp):
            return LIST if self.kind(expr.elt) else None
        return None

    def _name(self, name: ast.Name) -> str | None:
        b = self.bindings
        scope = b.scope(name)
        pos = position(name)
        while True:
            seen = b.seen(scope, name, pos)
            if seen:
                return join(*[s.kind() for s in seen])
            if isinstance(scope, (*FUNCTIONS, ast.Lambda)) and has_param(scope, name.id):
                return self._param(scope, name.id)
            if scope is self.sc.tree:
                return None
            scope = b.scope(scope)
            pos = (1 << 30, 0)  # an enclosing scope: whatever it binds, whenever

    def _param(self, fn: ast.AST, name: str) -> str | None:
        if isinstance(fn, ast.Lambda):
            return None
        return self.facts.params.get((self.path, self.bindings.qualnames[fn]), {}).get(name)

    def _call(self, call: ast.Call) -> str | None:
        sc = self.sc
        func = call.func
        ref = sc.pmapped_value(func)
        if ref is not None:
            return self._outputs(func, ref)
        qual = sc.qual(func)
        if qual in SOURCES:
            return STACKED
        if qual in TREE_MAPS:
            if call.args and self._keeps_on_device(call.args[0]):
                return join(*[self.kind(a) for a in call.args[1:]])
            return None
        if isinstance(func, ast.Name) and func.id == "abs" and not self.bindings.local(func):
            return STACKED if call.args and self.kind(call.args[0]) == STACKED else None
        if qual is not None and qual.startswith("jax.numpy."):
            return STACKED if any(self.kind(a) == STACKED for a in call.args) else None
        if isinstance(func, ast.Attribute):
            base = self.kind(func.value)
            if base == STACKED and func.attr not in HOST_METHODS:
                return STACKED  # state.replace(...), x.mean(), x.block_until_ready()
            if base == LIST and func.attr in ("pop", "copy"):
                return STACKED if func.attr == "pop" else LIST
        target = self.callee(call)
        if target is not None:
            return self.facts.returns.get(target[0])
        return None

    def _outputs(self, func: ast.expr, ref: ast.expr) -> str | None:
        """The kind of what a pmapped function returns, by its ``out_axes``.

        ``None`` outputs are one value (the same on every device), not stacked: with
        ``out_axes=None`` nothing is, with ``out_axes=(None, 0)`` the second output is.
        """
        axes = self._out_axes(ref)
        if isinstance(axes, tuple | list):
            return tuple_of([_all_mapped(a) for a in axes])
        if axes is None or (isinstance(axes, dict) and not _all_mapped(axes)):
            return None
        return TUPLE if self._returns_tuples(func) else STACKED

    def _out_axes(self, ref: ast.expr) -> object:
        """The literal ``out_axes`` a pmap reference is given (0 by default), or `_UNKNOWN`."""
        parent = self.sc.parents.get(ref)
        keywords: list[ast.keyword] = []
        if isinstance(parent, ast.Call) and parent.func is ref:
            keywords = list(parent.keywords)
        elif (
            isinstance(parent, ast.Call)
            and parent.args
            and parent.args[0] is ref
            and self.sc.qual(parent.func) == _PARTIAL
        ):
            keywords = list(parent.keywords)
            outer = self.sc.parents.get(parent)
            if isinstance(outer, ast.Call) and outer.func is parent:
                keywords += outer.keywords
        for kw in keywords:
            if kw.arg is None:
                return _UNKNOWN
            if kw.arg == "out_axes":
                try:
                    return ast.literal_eval(kw.value)
                except ValueError:
                    return _UNKNOWN
        return 0

    def _returns_tuples(self, func: ast.expr) -> bool:
        """Whether the function a pmapped callable maps returns a tuple of outputs."""
        fun = self.sc.mapped_function(func)
        while isinstance(fun, ast.Call) and fun.args:  # functools.partial(f, ...)
            fun = fun.args[0]
        if isinstance(fun, ast.Lambda):
            return isinstance(fun.body, ast.Tuple)
        if isinstance(fun, FUNCTIONS):
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
            return self.host.function(fn) is None
        qual = self.sc.qual(fn)
        return qual is not None and qual.startswith(("jax.numpy.", "jax.lax."))

    # ---- what bindings bind (`meshkit._src.migrate.bindings.BoundKinds`) ----------------------

    def augmented(self, target: ast.Name, value: ast.expr) -> str | None:
        """The kind ``target op= value`` binds, ``target`` being the name read."""
        return STACKED if STACKED in (self.kind(target), self.kind(value)) else None

    def appended(self, arg: ast.expr, each: bool) -> str | None:
        """The kind ``lst.append(arg)`` (``each``) or ``lst.extend(arg)`` binds to ``lst``."""
        kind = self.kind(arg)
        if kind is None:
            return None
        return LIST if each else kind

    def iterated(self, it: ast.expr) -> str | None:
        """The kind a ``for`` target over ``it`` binds."""
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.args:
            name, builtin = it.func.id, not self.bindings.local(it.func)
            if name in ("enumerate", "reversed", "list", "sorted") and builtin:
                inner = element(self.kind(it.args[0]))
                return TUPLE if inner and name == "enumerate" else inner
            if name == "zip" and builtin:
                return TUPLE if any(element(self.kind(a)) for a in it.args) else None
        return element(self.kind(it))

    # ---- calls between functions --------------------------------------------------------------

    def function_key(self, func: ast.expr) -> tuple[str, str] | None:
        """(path, qualified name) of the function a callee expression names, if in the run."""
        if isinstance(func, ast.Name):
            defs = self.sc.defs.get(func.id)
            if defs:
                return (self.path, self.bindings.qualnames[defs[0]])
            imported = self.bindings.imports.get(func.id)
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
                cls = self.bindings.enclosing_class(func)
                if cls is not None:
                    return (self.path, f"{self.bindings.qualnames[cls]}.{func.attr}")
                return None
            imported = self.bindings.imports.get(owner)
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
        made = self.bindings.made.get(key)
        if made is None or key in self._resolving:  # x = x.copy(): not a class's instance
            return None
        self._resolving.add(key)
        try:
            cls = self.function_key(made)
        finally:
            self._resolving.discard(key)
        return cls if cls is not None and cls in self.facts.classes else None

    def export(self) -> bool:
        """Add what this file says of functions (returns, parameters, tuples); True if new."""
        facts, changed = self.facts, False
        for node, qual in self.bindings.qualnames.items():
            if not isinstance(node, FUNCTIONS):
                continue
            key = (self.path, qual)
            if key not in facts.tuples and _all_tuples(node):
                facts.tuples.add(key)
                changed = True
            if key not in facts.returns:
                kind = join(*[self.kind(r.value) for r in _returns(node) if r.value])
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

    def reads(self) -> Iterator[Read]:
        """Every host read of a stacked value in the file (`meshkit._src.migrate.reads`)."""
        return self.host.reads(self.sc.nodes)


def analyze(scanners: Mapping[str, ScannedFile], facts: Facts, rounds: int = 8) -> Facts:
    """Fill ``facts`` from the run's files until nothing new is learnt (or ``rounds``)."""
    flows = {path: Flow(sc, facts) for path, sc in scanners.items()}
    for path, flow in flows.items():
        for node, qual in flow.bindings.qualnames.items():
            if isinstance(node, FUNCTIONS):
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


def _returns(fn: ast.AST) -> Iterator[ast.Return]:
    """The return statements of a function's own body (not of nested functions)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            yield node
        if not isinstance(node, (*FUNCTIONS, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _all_tuples(fn: ast.AST) -> bool:
    values = [r.value for r in _returns(fn)]
    return bool(values) and all(isinstance(v, ast.Tuple) for v in values)


def _all_mapped(axes: object) -> bool:
    """Whether an out_axes entry maps every leaf (no None in it)."""
    if axes is None:
        return False
    if isinstance(axes, tuple | list):
        return bool(axes) and all(_all_mapped(a) for a in axes)
    if isinstance(axes, dict):
        return bool(axes) and all(_all_mapped(a) for a in axes.values())
    return True
