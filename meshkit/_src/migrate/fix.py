"""The fixer of ``meshkit migrate --fix``: the scanner's mechanical edits, applied with libcst.

libcst keeps every byte it is not told to change, so comments and formatting survive. Three
steps: the references the scanner marked (by position and text) become ``meshkit.<name>`` (a
name JAX removed becomes its replacement: ``jax.tree.map`` for ``jax.tree_map``); the imports
they went through are dropped where nothing uses them any more (a comment on the lines
above a dropped import moves to the next statement; one at the end of the import's own line
goes with it); ``import meshkit`` (and ``import jax``, where a replacement needs it) is added
once, with the file's third-party imports (`meshkit._src.migrate.imports`).

A rewritten program must join its processes: `add_init` puts ``meshkit.init()`` first in its
``if __name__ == "__main__":`` block, where nothing in the file joins yet.

This module needs libcst (``pip install 'meshkit[migrate]'``); the scanner does not.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Sequence

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from .findings import Edit
from .imports import add_imports


def fix_source(
    source: str,
    edits: Sequence[Edit],
    first_party: Collection[str] = (),
    keep: Collection[str] = (),
) -> str:
    r"""The source with the edits applied, the unused imports dropped and meshkit imported.

    Args:
        source: the file's text.
        edits: the scanner's edits of the findings to fix.
        first_party: top-level module names local to the project (modules next to the file):
            their imports form the first-party group, after which ``import meshkit`` never goes.
            Without them, every import that is not ``__future__``, standard library or
            relative counts as third-party.
        keep: names used where the scanner does not look (a notebook's IPython magics): an
            import binding one of them is never dropped.

    Returns:
        The new text (the same text when no edit applies).

    Raises:
        SyntaxError: libcst cannot parse the source.

    Examples:
        >>> from meshkit._src.migrate.scan import scan_source
        >>> src = "import jax\n\nstep = jax.pmap(f)  # per device\n"
        >>> edits = [f.edit for f in scan_source(src) if f.edit]
        >>> print(fix_source(src, edits), end="")
        import meshkit
        <BLANKLINE>
        step = meshkit.pmap_compat(f)  # per device
    """
    if not edits:
        return source
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as e:
        raise SyntaxError(f"libcst: {e.message} (line {e.raw_line})") from None
    rewriter = _Rewriter(edits)
    module = MetadataWrapper(module).visit(rewriter)
    candidates = {e.binding for e in edits if e.binding is not None}
    if rewriter.applied or candidates:
        used = _used_names(module.code) | set(keep)
        drop = {b for b in candidates if b[0] not in used}
        if drop:
            module = module.visit(_DropImports(drop))
    # What the new names need: meshkit for its helpers, jax for a removed JAX name's
    # replacement written through jax (where the file reached it another way).
    needed = sorted({e.new.split(".")[0] for e in rewriter.applied} & {"meshkit", "jax"})
    if needed:
        module = add_imports(module, needed, first_party)
    return module.code


def _dotted(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


class _Rewriter(cst.CSTTransformer):
    """Replaces each marked reference (position and text must both match)."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, edits: Sequence[Edit]) -> None:
        super().__init__()
        self.todo = {(e.line, e.col, e.old): e for e in edits if e.form == "name" and e.old}
        self.wraps = {
            (e.form, e.line, e.col, e.end_line, e.end_col): e for e in edits if e.form != "name"
        }
        self.applied: list[Edit] = []
        self.deleted: list[cst.SimpleStatementLine] = []

    def leave_Subscript(
        self, original_node: cst.Subscript, updated_node: cst.Subscript
    ) -> cst.BaseExpression:
        edit = self._wrap("subscript", original_node)
        if edit is None:
            return updated_node
        return _call(edit.new, updated_node.value, updated_node)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        named = self._wrap("keywords", original_node)
        if named is not None:
            updated_node = _name_arguments(updated_node, named)
        edit = self._wrap("call", original_node)
        if edit is None or edit.keep >= len(updated_node.args):
            return updated_node
        return _call(edit.new, updated_node.args[edit.keep].value, updated_node)

    def leave_WithItem(
        self, original_node: cst.WithItem, updated_node: cst.WithItem
    ) -> cst.WithItem:
        edit = self._wrap("with", original_node.item)
        if edit is None:
            return updated_node
        return updated_node.with_changes(item=_call(edit.new, updated_node.item, updated_node.item))

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        if len(original_node.body) != 1 or not isinstance(original_node.body[0], cst.Expr):
            return updated_node
        if self._wrap("delete", original_node.body[0]) is None:
            return updated_node
        # Dropped by the enclosing block, which gives its blank lines and comments above to
        # the next statement.
        marker = cst.SimpleStatementLine([cst.Pass()], leading_lines=updated_node.leading_lines)
        self.deleted.append(marker)
        return marker

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        return updated_node.with_changes(body=self._without_deleted(updated_node.body))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return updated_node.with_changes(body=self._without_deleted(updated_node.body))

    def _without_deleted(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        out: list[cst.BaseStatement] = []
        carried: list[cst.EmptyLine] = []
        for stmt in body:
            if any(stmt is d for d in self.deleted):
                carried.extend(stmt.leading_lines)  # type: ignore[attr-defined]
                continue
            if carried and isinstance(stmt, cst.SimpleStatementLine | cst.BaseCompoundStatement):
                stmt = stmt.with_changes(leading_lines=[*carried, *stmt.leading_lines])
                carried = []
            out.append(stmt)
        return out or list(body)  # a block of deleted calls only is not rewritten (checked)

    def _wrap(self, form: str, original: cst.CSTNode) -> Edit | None:
        """The edit of a subscript or call at exactly this node's position, if any."""
        if not self.wraps:
            return None
        where = self.get_metadata(PositionProvider, original)
        assert isinstance(where, CodeRange)
        key = (form, where.start.line, where.start.column, where.end.line, where.end.column)
        edit = self.wraps.pop(key, None)
        if edit is not None:
            self.applied.append(edit)
        return edit

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        return self._replace(original_node, updated_node)

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.BaseExpression:
        return self._replace(original_node, updated_node)

    def _replace(
        self, original: cst.Name | cst.Attribute, updated: cst.Name | cst.Attribute
    ) -> cst.BaseExpression:
        text = _dotted(original)
        if text is None or not self.todo:
            return updated
        where = self.get_metadata(PositionProvider, original)
        assert isinstance(where, CodeRange)
        edit = self.todo.pop((where.start.line, where.start.column, text), None)
        if edit is None:
            return updated
        self.applied.append(edit)
        first, *rest = edit.new.split(".")
        value: cst.BaseExpression = cst.Name(first)
        for attr in rest[:-1]:
            value = cst.Attribute(value=value, attr=cst.Name(attr))
        return cst.Attribute(
            value=value, attr=cst.Name(rest[-1]), lpar=updated.lpar, rpar=updated.rpar
        )


def _name_arguments(call: cst.Call, edit: Edit) -> cst.Call:
    """The call with positional arguments named and keywords renamed.

    Arguments from ``edit.keep`` on take the names of ``edit.new`` (comma-separated); the
    ``a=b`` pairs of ``edit.old`` rename keywords (named ones included).
    """
    names = [n for n in edit.new.split(",") if n]
    renames = dict(pair.split("=") for pair in edit.old.split(",") if pair)
    args = list(call.args)
    for i, arg in enumerate(args):
        if arg.keyword is None and edit.keep <= i < edit.keep + len(names) and not arg.star:
            name = names[i - edit.keep]
            args[i] = arg.with_changes(
                keyword=cst.Name(renames.get(name, name)),
                equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""),
                    whitespace_after=cst.SimpleWhitespace(""),
                ),
            )
        elif arg.keyword is not None and arg.keyword.value in renames:
            args[i] = arg.with_changes(keyword=cst.Name(renames[arg.keyword.value]))
    return call.with_changes(args=args)


def _reference(dotted: str) -> cst.BaseExpression:
    """``a.b.c`` as a libcst expression."""
    first, *rest = dotted.split(".")
    value: cst.BaseExpression = cst.Name(first)
    for attr in rest:
        value = cst.Attribute(value=value, attr=cst.Name(attr))
    return value


def _call(func: str, arg: cst.BaseExpression, replaced: cst.BaseExpression) -> cst.Call:
    """``func(arg)`` in place of ``replaced``, keeping the parentheses around it."""
    inner = arg.with_changes(lpar=[], rpar=[]) if len(arg.lpar) == 1 else arg
    return cst.Call(
        func=_reference(func), args=[cst.Arg(inner)], lpar=replaced.lpar, rpar=replaced.rpar
    )


def _used_names(code: str) -> set[str]:
    """Names the code still uses: every name read or written, string annotations, __all__."""
    tree = ast.parse(code)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    annotations: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            annotations.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns:
            annotations.append(node.returns)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                for c in ast.walk(node.value) if node.value is not None else ():
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        used.add(c.value)
    for annotation in annotations:
        for c in ast.walk(annotation):
            if isinstance(c, ast.Constant) and isinstance(c.value, str):
                try:
                    parsed = ast.parse(c.value, mode="eval")
                except SyntaxError:
                    continue
                used |= {n.id for n in ast.walk(parsed) if isinstance(n, ast.Name)}
    return used


def _module_name(node: cst.BaseExpression) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _binding(alias: cst.ImportAlias, module: str | None) -> tuple[str, str]:
    """(name bound, what it refers to), as the scanner computes it."""
    name = _module_name(alias.name)
    asname = alias.asname
    bound = _module_name(asname.name) if asname is not None else None
    if module is None:  # import a.b [as c]
        return (bound, name) if bound else (name.split(".")[0], name.split(".")[0])
    return (bound or name, f"{module}.{name}")


class _DropImports(cst.CSTTransformer):
    """Drops the import aliases of the given bindings; empty import statements go too."""

    def __init__(self, drop: set[tuple[str, str]]) -> None:
        super().__init__()
        self.drop = drop

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        body, carried = self._filter(updated_node.body)
        footer = [*carried, *updated_node.footer] if _has_comment(carried) else updated_node.footer
        return updated_node.with_changes(body=body, footer=footer)

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body, carried = self._filter(updated_node.body)
        if not body:  # a block that only imported: keep it a block
            body = [cst.SimpleStatementLine([cst.Pass()], leading_lines=carried)]
            carried = []
        footer = [*carried, *updated_node.footer] if _has_comment(carried) else updated_node.footer
        return updated_node.with_changes(body=body, footer=footer)

    def _filter(
        self, statements: Sequence[cst.BaseStatement]
    ) -> tuple[list[cst.BaseStatement], list[cst.EmptyLine]]:
        """The statements with the dropped imports out; the lines above those carried down."""
        out: list[cst.BaseStatement] = []
        carried: list[cst.EmptyLine] = []
        for stmt in statements:
            if isinstance(stmt, cst.SimpleStatementLine):
                small = [s for s in (self._small(s) for s in stmt.body) if s is not None]
                if not small:
                    carried.extend(stmt.leading_lines)
                    continue
                if len(small) != len(stmt.body):
                    small[-1] = small[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
                if any(a is not b for a, b in zip(small, stmt.body, strict=False)):
                    stmt = stmt.with_changes(body=small)
            if carried and isinstance(stmt, cst.SimpleStatementLine | cst.BaseCompoundStatement):
                own = list(stmt.leading_lines)
                lines = [*carried, *own] if _has_comment(carried) or not own else own
                stmt = stmt.with_changes(leading_lines=lines)
                carried = []
            out.append(stmt)
        return out, carried

    def _small(self, stmt: cst.BaseSmallStatement) -> cst.BaseSmallStatement | None:
        if isinstance(stmt, cst.Import):
            names = list(stmt.names)
            keep = [_binding(a, None) not in self.drop for a in names]
        elif (
            isinstance(stmt, cst.ImportFrom)
            and not stmt.relative
            and stmt.module is not None
            and not isinstance(stmt.names, cst.ImportStar)
        ):
            module = _module_name(stmt.module)
            names = list(stmt.names)
            keep = [_binding(a, module) not in self.drop for a in names]
        else:
            return stmt
        if all(keep):
            return stmt
        kept = [a for a, k in zip(names, keep, strict=True) if k]
        if not kept:
            return None
        if not keep[-1]:  # the new last alias ends the list as the old last one did
            kept[-1] = kept[-1].with_changes(comma=names[-1].comma)
        return stmt.with_changes(names=kept)


def _has_comment(lines: Sequence[cst.EmptyLine]) -> bool:
    return any(line.comment is not None for line in lines)


_INIT = "meshkit.init()  # meshkit migrate: join this program's processes (before any JAX work)\n"
_JOINS = {"meshkit.init", "jax.distributed.initialize"}


def _joins(tree: ast.Module) -> bool:
    """Whether the code calls ``meshkit.init`` or ``jax.distributed.initialize`` anywhere."""
    aliases = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "meshkit"
        for a in node.names
        if a.name == "init"
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in _JOINS or name in aliases:
                return True
    return False


def _is_main_guard(test: cst.BaseExpression) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return False
    target = test.comparisons[0]
    if not isinstance(target.operator, cst.Equal):
        return False
    sides = {cst.Module([]).code_for_node(n).strip() for n in (test.left, target.comparator)}
    return "__name__" in sides and ({'"__main__"', "'__main__'"} & sides) != set()


def add_init(source: str, first_party: Collection[str] = ()) -> tuple[str, int | None]:
    r"""``meshkit.init()`` first in the program's ``if __name__ == "__main__":`` block.

    Nothing changes where the file has no such block at its top level (a library module: its
    program's entry point is elsewhere), or already calls ``meshkit.init`` or
    ``jax.distributed.initialize``. ``import meshkit`` is added if needed.

    Args:
        source: a file's text, as `fix_source` left it.
        first_party: as for `fix_source`.

    Returns:
        The new text, and the line of the call added (None when nothing was added).

    Examples:
        >>> src = "import jax\n\nif __name__ == '__main__':\n    print(jax.device_count())\n"
        >>> new, line = add_init(src)
        >>> print(new.splitlines()[line - 1].strip())
        meshkit.init()  # meshkit migrate: join this program's processes (before any JAX work)
        >>> new.splitlines()[:2], line
        (['import jax', 'import meshkit'], 5)
    """
    if _joins(ast.parse(source)):
        return source, None
    module = cst.parse_module(source)
    guards = [
        i for i, s in enumerate(module.body) if isinstance(s, cst.If) and _is_main_guard(s.test)
    ]
    if not guards:
        return source, None
    stmt = module.body[guards[0]]
    assert isinstance(stmt, cst.If)
    call = cst.parse_statement(_INIT)
    block = stmt.body
    if isinstance(block, cst.IndentedBlock):
        body = block.with_changes(body=[call, *block.body])
    else:  # `if __name__ == "__main__": main()`: the one line becomes a block
        assert isinstance(block, cst.SimpleStatementSuite)
        body = cst.IndentedBlock(body=[call, cst.SimpleStatementLine(body=block.body)])
    statements = list(module.body)
    statements[guards[0]] = stmt.with_changes(body=body)
    module = add_imports(module.with_changes(body=statements), ["meshkit"], first_party)
    new = module.code
    line = next(n for n, text in enumerate(new.splitlines(), 1) if text.strip() == _INIT.strip())
    return new, line
