"""The scanner of ``meshkit migrate``: legacy pmap patterns in Python source, through `ast`.

Names are resolved through the file's imports (``import jax``, ``from jax import pmap as pm``,
``import flax.jax_utils as ju``, ``from flax.training import common_utils``), so ``ju.replicate``
is found and a local function that happens to be called ``replicate`` is not. The analysis is
per file and flow-insensitive, which bounds what it sees:

* every import in the file counts, wherever it stands, and a name rebound later at module level
  (``pmap = ...``) still resolves to its import; star imports and relative imports resolve
  nothing; a name that a function, lambda, comprehension or class binds for itself (a parameter
  ``replicate``, a loop variable ``shard``) is not the import inside that scope;
* a pmapped function is a name bound to ``jax.pmap(f)`` / ``meshkit.pmap_compat(f)`` (also
  through ``functools.partial`` or a name bound to either), or a ``def`` decorated with one;
* nested pmap is a pmapped function applied to a pmapped one, stacked pmap decorators, or a call
  of a pmapped function in the body of one (one level of calls, not through helpers);
* a host read of a pmap output (``x[0]``, ``np.asarray(x)``, ``jax.device_get(x)``, a
  ``tree_map`` of ``lambda a: a[0]``...) is found wherever the value flowed, through the run's
  files (`meshkit._src.migrate.flow` says how far that goes); a pmapped function whose returns
  are tuple displays returns outputs, so ``out[0]`` there picks one and is not a read.

A ``# meshkit: ignore`` comment (or ``# meshkit: ignore[MK001,MK010]``) on a finding's first
line silences it, and ``--fix`` then leaves that line alone.
"""

from __future__ import annotations

import ast
import io
import itertools
import re
import tokenize
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .flow import Facts, Flow, Read, analyze
from .flow import dotted_name as _dotted
from .rules import (
    COMMON_UTILS,
    DEVICE_PUT,
    FLAX_JAX_UTILS,
    PMAP_KEYWORDS,
    REMOVED,
    REMOVED_MODULES,
    RULES,
    Rule,
)

__all__ = ["Edit", "Finding", "project_facts", "scan_source"]

PMAP = "jax.pmap"
PMAP_COMPAT = "meshkit.pmap_compat"
PARTIAL = "functools.partial"
MERGE_FLAG = "pmap_shmap_merge"
HELPERS: dict[str, tuple[str, str, frozenset[str]]] = {
    **{q: ("MK005", name, kw) for q, (name, kw) in FLAX_JAX_UTILS.items()},
    **{q: ("MK006", name, kw) for q, (name, kw) in COMMON_UTILS.items()},
    **{q: ("MK007", name, kw) for q, (name, kw) in DEVICE_PUT.items()},
}
# Every rule needs one of these in the text (an import, an attribute or the flag's name), so a
# file without any is parsed (to report syntax errors) but not analysed.
# (MK012's names resolve through an import that names jax.)
_MAYBE = re.compile(r"(?i:pmap)|jax_utils|common_utils|device_put_|\bjax\b")
_OLD_API = re.compile(r"^jax\.api\.")  # jax.api.X, removed, was jax.X
_DEFINES = re.compile(r"^\s*(?:async\s+)?def\s", re.MULTILINE)  # helpers pmap outputs reach
_IGNORE = re.compile(r"#\s*meshkit:\s*ignore(?:\[(?P<codes>[A-Za-z0-9,\s]*)\])?")
_Located = ast.expr | ast.stmt | ast.alias
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_BINDING_SCOPES = (*_FUNCTIONS, *_COMPREHENSIONS, ast.ClassDef)


@dataclass(frozen=True)
class Edit:
    """One mechanical rewrite, for the fixer.

    Attributes:
        line: 1-based line of the reference.
        col: 0-based column of the reference, in characters.
        old: the reference as written (``"jax.pmap"``, ``"ju.replicate"``); empty when the edit
            only drops an import that nothing uses.
        new: what replaces it (``"meshkit.pmap_compat"``).
        binding: the imported name the reference went through and what the import binds it to
            (``("ju", "flax.jax_utils")``): that import is dropped once nothing uses it.
        form: what is replaced: ``"name"`` (the reference ``old``), ``"subscript"`` (``x[0]``
            becomes ``new(x)``) or ``"call"`` (``f(a, x)`` becomes ``new(x)``, ``x`` being
            argument ``keep``); a subscript or call is found by its start and end.
        end_line: for a subscript or call, the 1-based line of its end.
        end_col: for a subscript or call, the 0-based column (characters) of its end.
        keep: for a call, the argument that the new call takes.
    """

    line: int
    col: int
    old: str
    new: str
    binding: tuple[str, str] | None
    form: str = "name"
    end_line: int = 0
    end_col: int = 0
    keep: int = 0


@dataclass(frozen=True)
class Finding:
    """One legacy pattern found.

    Attributes:
        path: the file, as given or found.
        line: 1-based line.
        col: 1-based column, in characters.
        code: the rule's code (``MK001`` ...).
        message: what was found, as written in the file.
        fixable: whether ``--fix`` removes this finding.
        note: for a rule ``--fix`` handles, why this finding is left alone.
        edit: the rewrite ``--fix`` makes, if any (nested pmap is fixed by its MK001 edits).
    """

    path: str
    line: int
    col: int
    code: str
    message: str
    fixable: bool = False
    note: str = ""
    edit: Edit | None = None

    @property
    def rule(self) -> Rule:
        """The rule this finding breaks."""
        return RULES[self.code]


def scan_source(
    source: str,
    path: str = "<string>",
    *,
    select: Collection[str] | None = None,
    ignore: Collection[str] = (),
    facts: Facts | None = None,
) -> list[Finding]:
    r"""The legacy pmap patterns in one file's source, sorted by position.

    Args:
        source: the file's text.
        path: the name findings carry.
        select: report only these rule codes (default: all).
        ignore: never report these rule codes.
        facts: what the other files of the run say of their functions (`project_facts`), for
            pmap outputs that flow between files; default: this file alone.

    Returns:
        The findings, by line and column.

    Raises:
        SyntaxError: the source does not parse (also for null bytes).

    Example:
        >>> src = "import jax\nstep = jax.pmap(lambda x: x, out_axes=-1)\n"
        >>> [(f.line, f.code, f.fixable) for f in scan_source(src)]
        [(2, 'MK001', False), (2, 'MK003', False)]
    """
    try:
        tree = ast.parse(source, filename=path)
    except ValueError as e:  # null bytes, before 3.12
        raise SyntaxError(str(e)) from None
    if not _MAYBE.search(source) and not (facts is not None and facts.receives(path)):
        return []
    scanner = _Scanner(tree, source, path)
    if facts is None or path not in facts.modules:
        scanner.collect()
        facts = analyze({path: scanner}, Facts.for_paths({path: source}))
    found = scanner.scan(facts)
    silenced = _ignore_comments(source)
    out: dict[tuple[int, int, str], Finding] = {}
    for f in found:
        codes = silenced.get(f.line, frozenset())
        if "*" in codes or f.code in codes:
            continue
        if (select is not None and f.code not in select) or f.code in ignore:
            continue
        out.setdefault((f.line, f.col, f.code), f)
    return [out[k] for k in sorted(out)]


def project_facts(sources: Mapping[str, str]) -> Facts:
    """What a run's files say of their functions, for pmap outputs that flow between them.

    Args:
        sources: path -> text of every file of the run (a file that does not parse is left
            out; its error is `scan_source`'s to report).

    Returns:
        The facts `scan_source` takes: functions returning pmap outputs, parameters passed
        them, and functions returning tuples, resolved through the files' imports.
    """
    facts = Facts.for_paths(sources)
    scanners = {}
    for path, source in sources.items():
        try:
            tree = ast.parse(source, filename=path)
        except (SyntaxError, ValueError, RecursionError):
            continue  # scan_source reports why
        if _MAYBE.search(source) or _DEFINES.search(source):
            scanner = _Scanner(tree, source, path)
            scanner.collect()
            scanners[path] = scanner
    return analyze(scanners, facts)


def _ignore_comments(source: str) -> dict[int, frozenset[str]]:
    """Line -> codes silenced there (``"*"``: every code)."""
    found: dict[int, frozenset[str]] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            m = _IGNORE.search(tok.string)
            if m is None:
                continue
            codes = m.group("codes")
            names = {c.strip().upper() for c in codes.split(",")} - {""} if codes else {"*"}
            found[tok.start[0]] = found.get(tok.start[0], frozenset()) | names
    except (tokenize.TokenError, SyntaxError):
        pass  # ast accepted it; tokenize's stricter corners only cost the comments
    return found


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _axes_values(value: object) -> Iterator[object]:
    """Every leaf of a literal out_axes (ints, None) through tuples, lists and dicts."""
    if isinstance(value, tuple | list):
        for v in value:
            yield from _axes_values(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _axes_values(v)
    else:
        yield value


class _Scanner:
    """One file's analysis: imports, pmapped names, then every rule."""

    def __init__(self, tree: ast.Module, source: str, path: str) -> None:
        self.tree = tree
        self.path = path
        self.lines = re.split(r"\r\n|\r|\n", source)
        self.nodes = list(ast.walk(tree))
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in self.nodes:
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.bindings: dict[str, str] = {}
        self.from_imports: list[tuple[ast.alias, str, str]] = []
        self.pmap_aliases: dict[str, ast.expr] = {}  # name -> the pmap it stands for
        self.pmapped: dict[str, ast.expr] = {}  # dotted name of a pmapped function -> its pmap
        self.mapped: dict[str, ast.AST | None] = {}  # ... -> the function it maps
        self.defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.findings: list[Finding] = []
        self._fixable_refs: dict[ast.AST, bool] = {}
        self._lowered: set[str] | None = None  # see _lowered_pmaps
        self._used: set[str] = set()  # every name the file reads or writes
        self._scope_names: dict[ast.AST, frozenset[str]] = {}  # see _locals
        self._collected = False
        self._module_bindings: dict[str, list[ast.stmt]] | None = None  # see _rebound_pmapped

    # ---- resolution ---------------------------------------------------------------------------

    def collect(self) -> None:
        """Imports, definitions and pmapped names (once, before `scan`)."""
        if self._collected:
            return
        self._collected = True
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
                    ref = self._pmap_ref(node.value)
                    if ref is not None and isinstance(target, ast.Name):
                        self.pmap_aliases[name] = ref
                    elif (ref := self._pmapped_call(node.value)) is not None:
                        self.pmapped[name] = ref
                        self.mapped[name] = _mapped_arg(node.value)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    refs = self._decorator_refs(node)
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

    def _pmap_ref(self, expr: ast.AST) -> ast.expr | None:
        """The pmap reference behind an expression that maps functions (pmap, its partial)."""
        if isinstance(expr, ast.Name | ast.Attribute):
            if self.qual(expr) in (PMAP, PMAP_COMPAT):
                return expr
            if isinstance(expr, ast.Name):
                return self.pmap_aliases.get(expr.id)
            return None
        if isinstance(expr, ast.Call):
            if self.qual(expr.func) == PARTIAL and expr.args:
                return self._pmap_ref(expr.args[0])
            ref = self._pmap_ref(expr.func)
            # pmap_compat(axis_name="i") without the function is a decorator.
            if ref is not None and not expr.args and not _keyword(expr, "fun"):
                return ref
        return None

    def _pmapped_call(self, expr: ast.AST) -> ast.expr | None:
        """The pmap reference of an expression that makes a pmapped function (``pmap(f)``)."""
        if isinstance(expr, ast.Call) and (expr.args or _keyword(expr, "fun")):
            return self._pmap_ref(expr.func)
        return None

    def pmapped_value(self, expr: ast.AST) -> ast.expr | None:
        """The pmap reference of a pmapped function: ``pmap(f)`` or a name bound to one."""
        name = _dotted(expr)
        if name is not None and name in self.pmapped:
            if isinstance(expr, ast.Name) and not self._rebound_pmapped(expr):
                return None
            return self.pmapped[name]
        return self._pmapped_call(expr)

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
            return bool(self._decorator_refs(last))
        if isinstance(last, ast.Assign):
            return self._pmapped_call(last.value) is not None
        return False

    def mapped_function(self, expr: ast.AST) -> ast.AST | None:
        """The function a pmapped callable maps (an expression or a ``def``), if known."""
        name = _dotted(expr)
        if name is not None and name in self.pmapped:
            return self.mapped.get(name)
        return _mapped_arg(expr) if isinstance(expr, ast.Call) else None

    def _decorator_refs(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef
    ) -> list[tuple[ast.expr, ast.expr]]:
        found = []
        for d in node.decorator_list:
            ref = self._pmap_ref(d)
            if ref is not None:
                found.append((d, ref))
        return found

    def _is_jax(self, ref: ast.AST) -> bool:
        return self.qual(ref) == PMAP

    # ---- positions ----------------------------------------------------------------------------

    def _col(self, node: _Located) -> int:
        """0-based column of a node's start in characters (ast counts UTF-8 bytes)."""
        raw = self.lines[node.lineno - 1].encode("utf-8")[: node.col_offset]
        return len(raw.decode("utf-8", "replace"))

    def _add(
        self,
        node: _Located,
        code: str,
        message: str,
        *,
        fixable: bool = False,
        note: str = "",
        edit: Edit | None = None,
    ) -> None:
        col = self._col(node) + 1
        finding = Finding(self.path, node.lineno, col, code, message, fixable, note, edit)
        self.findings.append(finding)

    def _context(self, ref: ast.AST) -> tuple[str, list[ast.keyword] | None, int]:
        """How a reference is used: (word, keywords it receives or None, positional count)."""
        parent = self.parents.get(ref)
        if isinstance(parent, ast.Call) and parent.func is ref:
            return "call", list(parent.keywords), len(parent.args)
        if (
            isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and ref in parent.decorator_list
        ):
            return "decorator", [], 1
        if (
            isinstance(parent, ast.Call)
            and parent.args
            and parent.args[0] is ref
            and self.qual(parent.func) == PARTIAL
        ):
            keywords = list(parent.keywords)
            positional = len(parent.args) - 1
            outer = self.parents.get(parent)
            if isinstance(outer, ast.Call) and outer.func is parent:
                keywords += outer.keywords
                positional += len(outer.args)
            return "in functools.partial", keywords, positional
        return "reference", None, 0

    # ---- rules --------------------------------------------------------------------------------

    def scan(self, facts: Facts) -> list[Finding]:
        """Every finding, given the run's `Facts` (which `collect` must have fed)."""
        self.collect()
        used = self._used = {n.id for n in self.nodes if isinstance(n, ast.Name)}
        for node in self.nodes:
            if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
                self._reference(node)
            if isinstance(node, ast.Call):
                self._out_axes(node)
                self._compile(node)
            if isinstance(node, ast.Constant | ast.Attribute):
                self._merge_flag(node)
        for alias, name, target in self.from_imports:
            if name not in used:
                self._unused_import(alias, name, target)
        self._removed_imports()
        self._nested()
        self._host_reads(Flow(self, facts))
        return self.findings

    def _written(self, node: ast.AST, qual: str) -> str:
        text = _dotted(node)
        return "" if text == qual else f" (written `{text}`)"

    def _reference(self, node: ast.Name | ast.Attribute) -> None:
        qual = self.qual(node)
        if qual is None:
            return
        if qual == PMAP:
            word, keywords, positional = self._context(node)
            note = self._pmap_note(keywords, positional)
            self._fixable_refs[node] = not note
            message = f"jax.pmap {word}{self._written(node, qual)}"
            edit = None if note else self._edit(node, "meshkit.pmap_compat")
            self._add(node, "MK001", message, fixable=not note, note=note, edit=edit)
        elif (helper := _OLD_API.sub("jax.", qual)) in HELPERS:
            code, name, allowed = HELPERS[helper]
            word, keywords, _ = self._context(node)
            note = ""
            if keywords is not None:
                note = _keyword_note(keywords, allowed, helper)
            message = f"{helper} {word}{self._written(node, helper)}"
            edit = None if note else self._edit(node, f"meshkit.{name}")
            self._add(node, code, message, fixable=not note, note=note, edit=edit)
            if helper != qual:  # jax.api.device_put_sharded: the same rewrite fixes both
                message = f"{qual}, removed from JAX: use meshkit.{name} (see {code})"
                self._add(node, "MK012", message, fixable=not note, note=note)
        elif qual.startswith("jax.") and qual.endswith(".PmapSharding"):
            self._add(node, "MK008", f"{qual}{self._written(node, qual)}")
        elif (removed := _removed(qual)) is not None:
            inner = isinstance(node, ast.Attribute) and _removed(self.qual(node.value)) is not None
            if not inner:  # one finding per chain, at the removed name itself
                self._removed_reference(node, qual, removed)

    def _removed_reference(self, node: ast.Name | ast.Attribute, qual: str, key: str) -> None:
        """MK012: a name JAX removed; rewritten where it has a one-to-one replacement."""
        new, instead = REMOVED[key]
        message = f"{qual}{self._written(node, qual)}, removed from JAX: use {instead}"
        if new is None or qual != key:
            self._add(node, "MK012", message)
            return
        root = _root(node)
        if root is not None and self.bindings.get(root) == "jax":
            new = root + new[len("jax") :]  # keep the file's own name for jax
        self._add(node, "MK012", message, fixable=True, edit=self._edit(node, new))

    def _edit(self, node: ast.Name | ast.Attribute, new: str) -> Edit:
        root = _root(node)
        binding = None if root is None else (root, self.bindings[root])
        return Edit(node.lineno, self._col(node), _dotted(node) or "", new, binding)

    def _pmap_note(self, keywords: list[ast.keyword] | None, positional: int) -> str:
        """Why a jax.pmap reference is not rewritten ("" when it is)."""
        if keywords is None:
            return "not fixed: a reference outside a call; check how it is called, then edit"
        if positional > 2:
            return f"not fixed: {positional} positional arguments (jax.pmap takes 2)"
        note = _keyword_note(keywords, PMAP_KEYWORDS, PMAP)
        if note:
            return note
        for kw in keywords:
            if kw.arg != "out_axes":
                continue
            try:
                value = ast.literal_eval(kw.value)
            except ValueError:
                return "not fixed: out_axes is computed; check it is neither negative nor None"
            leaves = list(_axes_values(value))
            if any(isinstance(v, int) and not isinstance(v, bool) and v < 0 for v in leaves):
                return "not fixed: negative out_axes, see MK003"
            if any(v is None for v in leaves):
                return "not fixed: out_axes=None, see MK004"
        return ""

    def _removed_imports(self) -> None:
        """MK012 at an import of a removed module or name: it fails when the file is imported.

        A from-import of a removed name that the file uses is fixed through its references
        (the import goes once nothing uses it); an import of a removed module is not fixed.
        """
        for node in self.nodes:
            if isinstance(node, ast.Import):
                targets = [(a, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [(a, f"{node.module}.{a.name}") for a in node.names if a.name != "*"]
            else:
                continue
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for alias, target in targets:
                gone = module if module in REMOVED_MODULES else target
                if gone in REMOVED_MODULES:  # a module no longer, though still an attribute
                    instead = REMOVED_MODULES[gone]
                    self._add(alias, "MK012", f"import of module {gone}, removed: use {instead}")
                    continue
                key = _removed(target)
                if key is None:
                    continue
                new, instead = REMOVED[key]
                used = isinstance(node, ast.ImportFrom) and new is not None and target == key
                if used and (alias.asname or alias.name) in self._used:
                    continue  # its references are findings, and fixing them drops the import
                self._add(alias, "MK012", f"import of {target}, removed from JAX: use {instead}")

    def _unused_import(self, alias: ast.alias, name: str, target: str) -> None:
        """A from-import of a legacy name that nothing uses still fails or ties the code."""
        edit = Edit(alias.lineno, self._col(alias), "", "", (name, target))
        if target == PMAP:
            self._add(alias, "MK001", "unused import of jax.pmap", fixable=True, edit=edit)
        elif target in HELPERS:
            code = HELPERS[target][0]
            self._add(alias, code, f"unused import of {target}", fixable=True, edit=edit)
        elif target.startswith("jax.") and target.endswith(".PmapSharding"):
            self._add(alias, "MK008", f"import of {target}")

    def _out_axes(self, call: ast.Call) -> None:
        """MK003 / MK004 on the out_axes of a jax.pmap call or partial."""
        if self.qual(call.func) == PARTIAL and call.args:
            ref = self._pmap_ref(call.args[0])
        else:
            ref = self._pmap_ref(call.func)
        if ref is None or not self._is_jax(ref):
            return
        for kw in call.keywords:
            if kw.arg != "out_axes":
                continue
            try:
                leaves = list(_axes_values(ast.literal_eval(kw.value)))
            except ValueError:
                continue
            text = ast.unparse(kw.value)
            if any(isinstance(v, int) and not isinstance(v, bool) and v < 0 for v in leaves):
                self._add(kw.value, "MK003", f"jax.pmap with out_axes={text}")
            if any(v is None for v in leaves):
                self._add(kw.value, "MK004", f"jax.pmap with out_axes={text}")

    def _compile(self, call: ast.Call) -> None:
        """MK011: ``f.lower(...).compile()`` of a pmapped function, in one go or two."""
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr == "compile"):
            return
        lowered = func.value
        if (
            isinstance(lowered, ast.Call)
            and isinstance(lowered.func, ast.Attribute)
            and lowered.func.attr == "lower"
            and self.pmapped_value(lowered.func.value) is not None
        ):
            text = _dotted(lowered.func.value) or ast.unparse(lowered.func.value)
            self._add(call, "MK011", f"`{text}.lower(...).compile()` of a pmapped function")
            return
        name = _dotted(lowered)
        if name is not None and name in self._lowered_pmaps():
            self._add(call, "MK011", f"`{name}.compile()` of a lowered pmapped function")

    def _lowered_pmaps(self) -> set[str]:
        """Names assigned ``f.lower(...)`` of a pmapped ``f`` anywhere in the file.

        Made once: a file of thousands of ``re.compile`` calls must not rescan itself per call.
        """
        if self._lowered is None:
            self._lowered = {
                name
                for node in self.nodes
                if isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and (name := _dotted(node.targets[0])) is not None
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "lower"
                and self.pmapped_value(node.value.func.value) is not None
            }
        return self._lowered

    def _merge_flag(self, node: ast.Constant | ast.Attribute) -> None:
        if isinstance(node, ast.Attribute):
            if MERGE_FLAG in node.attr.lower():
                self._add(node, "MK009", f"config flag `{node.attr}`")
            return
        if not (isinstance(node.value, str) and MERGE_FLAG in node.value.lower()):
            return
        if isinstance(self.parents.get(node), ast.Expr):
            return  # a docstring or a bare string, which sets nothing
        self._add(node, "MK009", f"config flag {node.value!r}")

    # ---- nested pmap --------------------------------------------------------------------------

    def _nested(self) -> None:
        bodies: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, ast.expr]] = []
        for node in self.nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                refs = self._decorator_refs(node)
                if refs:
                    bodies.append((node, refs[-1][1]))
                for (_, outer), (dec, inner) in itertools.pairwise(refs):
                    self._report_nested(dec, outer, inner, "stacked pmap decorators")
            ref = self._pmapped_call(node)
            if ref is None:
                continue
            assert isinstance(node, ast.Call)
            fun = node.args[0] if node.args else _keyword(node, "fun")
            if fun is None:
                continue
            inner = self.pmapped_value(fun)
            # pmap(partial(train_step, lr=...)): the body is train_step's.
            while isinstance(fun, ast.Call) and self.qual(fun.func) == PARTIAL and fun.args:
                fun = fun.args[0]
                inner = inner or self.pmapped_value(fun)
            if inner is not None:
                self._report_nested(fun, ref, inner, "pmap of a pmapped function")
            elif isinstance(fun, ast.Lambda):
                bodies.append((fun, ref))
            else:
                name = fun.attr if isinstance(fun, ast.Attribute) else _dotted(fun)
                bodies.extend((d, ref) for d in self.defs.get(name or "", []))
        for body, outer in bodies:
            stmts: Sequence[ast.AST] = [body.body] if isinstance(body, ast.Lambda) else body.body
            for stmt in stmts:
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Call):
                        inner = self.pmapped_value(node.func)
                        if inner is not None:
                            what = _dotted(node.func) or "a pmapped function"
                            self._report_nested(
                                node, outer, inner, f"`{what}` called in a pmapped function"
                            )

    def _report_nested(self, node: ast.expr, outer: ast.expr, inner: ast.expr, what: str) -> None:
        if not (self._is_jax(outer) or self._is_jax(inner)):
            return
        fixable = all(self._ref_fixable(r) for r in (outer, inner))
        note = "" if fixable else "not fixed: a jax.pmap here is not rewritten (see MK001)"
        self._add(node, "MK002", f"nested pmap: {what}", fixable=fixable, note=note)

    def _ref_fixable(self, ref: ast.expr) -> bool:
        if not self._is_jax(ref):
            return True
        _, keywords, positional = self._context(ref)
        return not self._pmap_note(keywords, positional)

    # ---- host reads of pmap outputs -----------------------------------------------------------

    def _host_reads(self, flow: Flow) -> None:
        """MK010 at each host read of a stacked value (`meshkit._src.migrate.flow`)."""
        for read in flow.reads():
            edit = self._read_edit(read)
            note = "" if edit else "not fixed: no one-to-one rewrite (see the rule's fix)"
            message = self._read_message(read)
            self._add(read.node, "MK010", message, fixable=bool(edit), note=note, edit=edit)

    def _read_message(self, read: Read) -> str:
        code = self._snippet(read.node)
        if read.what == "whole":
            gives = (
                "this process's entries; with global_outputs=True: every process's, which no "
                "process can read alone"
            )
        elif read.index is None:
            gives = (
                "an entry of each leaf on this process; with global_outputs=True: that entry of "
                "the global array, held by one process"
            )
        else:
            k = read.index
            gives = (
                f"this process's device {k}; with global_outputs=True: global device {k}'s, "
                "held by one process"
            )
        return f"host read of a pmap output `{code}` (pmap_compat's defaults: {gives})"

    def _read_edit(self, read: Read) -> Edit | None:
        """The rewrite of a read into meshkit's equivalent, where there is one."""
        if not read.fix:
            return None
        node = read.node
        end_line = node.end_lineno or node.lineno
        end = self.lines[end_line - 1].encode("utf-8")[: node.end_col_offset or 0]
        end_col = len(end.decode("utf-8", "replace"))
        if isinstance(node, ast.Subscript):
            edit = Edit(
                node.lineno, self._col(node), "", read.fix, None, "subscript", end_line, end_col
            )
        else:
            root = _root(node.func)
            binding = None
            if root is not None and root in self.bindings:
                binding = (root, self.bindings[root])
            edit = Edit(
                node.lineno,
                self._col(node),
                "",
                read.fix,
                binding,
                "call",
                end_line,
                end_col,
                read.keep,
            )
        return edit

    def _snippet(self, node: ast.AST, width: int = 60) -> str:
        """The expression as written, on one line and at most ``width`` characters."""
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1  # type: ignore[attr-defined]
        rows = [ln.encode("utf-8") for ln in self.lines[first : last + 1]]
        rows[-1] = rows[-1][: node.end_col_offset]  # type: ignore[attr-defined]
        rows[0] = rows[0][node.col_offset :]  # type: ignore[attr-defined]
        text = " ".join(b" ".join(rows).decode("utf-8", "replace").split())
        return text if len(text) <= width else text[: width - 3] + "..."


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


def _removed(qual: str | None) -> str | None:
    """The `REMOVED` entry ``qual`` is, or is under (a removed module's names), or None."""
    if qual is None:
        return None
    if qual in REMOVED:
        return qual
    parts = qual.split(".")
    for i in range(len(parts) - 1, 1, -1):
        prefix = ".".join(parts[:i])
        if prefix in REMOVED and REMOVED[prefix][0] is None:
            return prefix
    return None


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
    return call.args[0] if call.args else _keyword(call, "fun")


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _keyword_note(keywords: list[ast.keyword], allowed: frozenset[str], qual: str) -> str:
    for kw in keywords:
        if kw.arg is None:
            return "not fixed: keywords passed with **; check them, then edit"
        if kw.arg not in allowed:
            return f"not fixed: keyword {kw.arg}= is not in {qual}'s legacy signature"
    return ""
