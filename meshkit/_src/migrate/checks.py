"""The rule checks of ``meshkit migrate``: every finding in one resolved file.

The checks read a `ResolvedFile` (`meshkit._src.migrate.resolve`), and for MK010 the flow of
pmap outputs through the run (`meshkit._src.migrate.flow`):

* nested pmap is a pmapped function applied to a pmapped one, stacked pmap decorators, or a call
  of a pmapped function in the body of one (one level of calls, not through helpers);
* a host read of a pmap output (``x[0]``, ``np.asarray(x)``, ``jax.device_get(x)``, a
  ``tree_map`` of ``lambda a: a[0]``...) is found wherever the value flowed, through the run's
  files (`meshkit._src.migrate.flow` says how far that goes); a pmapped function whose returns
  are tuple displays returns outputs, so ``out[0]`` there picks one and is not a read.

Where a finding has a mechanical rewrite, it carries the `Edit` that ``--fix`` applies.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator, Sequence

from .bindings import dotted_name as _dotted
from .facts import Facts
from .findings import Edit, Finding
from .flow import Flow
from .jax_api import JaxApiChecks
from .reads import Read
from .resolve import PARTIAL, PMAP, ResolvedFile, keyword
from .rules import (
    COMMON_UTILS,
    DEVICE_PUT,
    FLAX_JAX_UTILS,
    PMAP_KEYWORDS,
    REMOVED,
    REMOVED_MODULES,
)

MERGE_FLAG = "pmap_shmap_merge"
HELPERS: dict[str, tuple[str, str, frozenset[str]]] = {
    **{q: ("MK005", name, kw) for q, (name, kw) in FLAX_JAX_UTILS.items()},
    **{q: ("MK006", name, kw) for q, (name, kw) in COMMON_UTILS.items()},
    **{q: ("MK007", name, kw) for q, (name, kw) in DEVICE_PUT.items()},
}
_OLD_API = re.compile(r"^jax\.api\.")  # jax.api.X, removed, was jax.X
_Located = ast.expr | ast.stmt | ast.alias


class Checks:
    """Every rule's check on one resolved file.

    Args:
        file: the file, its names resolved.
    """

    def __init__(self, file: ResolvedFile) -> None:
        self.file = file
        self.findings: list[Finding] = []
        self._lowered: set[str] | None = None  # see _lowered_pmaps
        self._used: set[str] = set()  # every name the file reads or writes

    # ---- positions ----------------------------------------------------------------------------

    def _col(self, node: _Located) -> int:
        """0-based column of a node's start in characters (ast counts UTF-8 bytes)."""
        raw = self.file.lines[node.lineno - 1].encode("utf-8")[: node.col_offset]
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
        finding = Finding(self.file.path, node.lineno, col, code, message, fixable, note, edit)
        self.findings.append(finding)

    def _context(self, ref: ast.AST) -> tuple[str, list[ast.keyword] | None, int]:
        """How a reference is used: (word, keywords it receives or None, positional count)."""
        parent = self.file.parents.get(ref)
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
            and self.file.qual(parent.func) == PARTIAL
        ):
            keywords = list(parent.keywords)
            positional = len(parent.args) - 1
            outer = self.file.parents.get(parent)
            if isinstance(outer, ast.Call) and outer.func is parent:
                keywords += outer.keywords
                positional += len(outer.args)
            return "in functools.partial", keywords, positional
        return "reference", None, 0

    # ---- rules --------------------------------------------------------------------------------

    def scan(self, facts: Facts) -> list[Finding]:
        """Every finding, given the run's `Facts` (which the file must have fed)."""
        used = self._used = {n.id for n in self.file.nodes if isinstance(n, ast.Name)}
        for node in self.file.nodes:
            if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
                self._reference(node)
            if isinstance(node, ast.Call):
                self._out_axes(node)
                self._compile(node)
            if isinstance(node, ast.Constant | ast.Attribute):
                self._merge_flag(node)
        for alias, name, target in self.file.from_imports:
            if name not in used:
                self._unused_import(alias, name, target)
        self._removed_imports()
        JaxApiChecks(self.file, self._add, self._col).scan()
        self._nested()
        self._host_reads(Flow(self.file, facts))
        return self.findings

    def _written(self, node: ast.AST, qual: str) -> str:
        text = _dotted(node)
        return "" if text == qual else f" (written `{text}`)"

    def _reference(self, node: ast.Name | ast.Attribute) -> None:
        qual = self.file.qual(node)
        if qual is None:
            return
        if qual == PMAP:
            word, keywords, positional = self._context(node)
            note = self._pmap_note(keywords, positional)
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
            inner = (
                isinstance(node, ast.Attribute) and _removed(self.file.qual(node.value)) is not None
            )
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
        if root is not None and self.file.bindings.get(root) == "jax":
            new = root + new[len("jax") :]  # keep the file's own name for jax
        self._add(node, "MK012", message, fixable=True, edit=self._edit(node, new))

    def _edit(self, node: ast.Name | ast.Attribute, new: str) -> Edit:
        root = _root(node)
        binding = None if root is None else (root, self.file.bindings[root])
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
            # None entries (out_axes=None, (None, 0), a dict with None) are pmap_compat's too:
            # rewritten, and pmap_compat checks that such an output is the same everywhere.
        return ""

    def _removed_imports(self) -> None:
        """MK012 at an import of a removed module or name: it fails when the file is imported.

        A from-import of a removed name that the file uses is fixed through its references
        (the import goes once nothing uses it); an import of a removed module is not fixed.
        """
        for node in self.file.nodes:
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
        if self.file.qual(call.func) == PARTIAL and call.args:
            ref = self.file.pmap_ref(call.args[0])
        else:
            ref = self.file.pmap_ref(call.func)
        if ref is None or not self.file.is_jax(ref):
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
                fixable = self._ref_fixable(ref)
                note = "" if fixable else "not fixed: this jax.pmap is not rewritten (see MK001)"
                message = f"jax.pmap with out_axes={text}"
                self._add(kw.value, "MK004", message, fixable=fixable, note=note)

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
            and self.file.pmapped_value(lowered.func.value) is not None
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
                for node in self.file.nodes
                if isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and (name := _dotted(node.targets[0])) is not None
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "lower"
                and self.file.pmapped_value(node.value.func.value) is not None
            }
        return self._lowered

    def _merge_flag(self, node: ast.Constant | ast.Attribute) -> None:
        if isinstance(node, ast.Attribute):
            if MERGE_FLAG in node.attr.lower():
                self._add(node, "MK009", f"config flag `{node.attr}`")
            return
        if not (isinstance(node.value, str) and MERGE_FLAG in node.value.lower()):
            return
        if isinstance(self.file.parents.get(node), ast.Expr):
            return  # a docstring or a bare string, which sets nothing
        self._add(node, "MK009", f"config flag {node.value!r}")

    # ---- nested pmap --------------------------------------------------------------------------

    def _nested(self) -> None:
        bodies: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, ast.expr]] = []
        for node in self.file.nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                refs = self.file.decorator_refs(node)
                if refs:
                    bodies.append((node, refs[-1][1]))
                for (_, outer), (dec, inner) in itertools.pairwise(refs):
                    self._report_nested(dec, outer, inner, "stacked pmap decorators")
            ref = self.file.pmapped_call(node)
            if ref is None:
                continue
            assert isinstance(node, ast.Call)
            fun = node.args[0] if node.args else keyword(node, "fun")
            if fun is None:
                continue
            inner = self.file.pmapped_value(fun)
            # pmap(partial(train_step, lr=...)): the body is train_step's.
            while isinstance(fun, ast.Call) and self.file.qual(fun.func) == PARTIAL and fun.args:
                fun = fun.args[0]
                inner = inner or self.file.pmapped_value(fun)
            if inner is not None:
                self._report_nested(fun, ref, inner, "pmap of a pmapped function")
            elif isinstance(fun, ast.Lambda):
                bodies.append((fun, ref))
            else:
                name = fun.attr if isinstance(fun, ast.Attribute) else _dotted(fun)
                bodies.extend((d, ref) for d in self.file.defs.get(name or "", []))
        for body, outer in bodies:
            stmts: Sequence[ast.AST] = [body.body] if isinstance(body, ast.Lambda) else body.body
            for stmt in stmts:
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Call):
                        inner = self.file.pmapped_value(node.func)
                        if inner is not None:
                            what = _dotted(node.func) or "a pmapped function"
                            self._report_nested(
                                node, outer, inner, f"`{what}` called in a pmapped function"
                            )

    def _report_nested(self, node: ast.expr, outer: ast.expr, inner: ast.expr, what: str) -> None:
        if not (self.file.is_jax(outer) or self.file.is_jax(inner)):
            return
        fixable = all(self._ref_fixable(r) for r in (outer, inner))
        note = "" if fixable else "not fixed: a jax.pmap here is not rewritten (see MK001)"
        self._add(node, "MK002", f"nested pmap: {what}", fixable=fixable, note=note)

    def _ref_fixable(self, ref: ast.expr) -> bool:
        if not self.file.is_jax(ref):
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
        end = self.file.lines[end_line - 1].encode("utf-8")[: node.end_col_offset or 0]
        end_col = len(end.decode("utf-8", "replace"))
        if isinstance(node, ast.Subscript):
            edit = Edit(
                node.lineno, self._col(node), "", read.fix, None, "subscript", end_line, end_col
            )
        else:
            root = _root(node.func)
            binding = None
            if root is not None and root in self.file.bindings:
                binding = (root, self.file.bindings[root])
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
        rows = [ln.encode("utf-8") for ln in self.file.lines[first : last + 1]]
        rows[-1] = rows[-1][: node.end_col_offset]  # type: ignore[attr-defined]
        rows[0] = rows[0][node.col_offset :]  # type: ignore[attr-defined]
        text = " ".join(b" ".join(rows).decode("utf-8", "replace").split())
        return text if len(text) <= width else text[: width - 3] + "..."


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


def _keyword_note(keywords: list[ast.keyword], allowed: frozenset[str], qual: str) -> str:
    for kw in keywords:
        if kw.arg is None:
            return "not fixed: keywords passed with **; check them, then edit"
        if kw.arg not in allowed:
            return f"not fixed: keyword {kw.arg}= is not in {qual}'s legacy signature"
    return ""
