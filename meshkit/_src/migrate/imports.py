"""Where ``meshkit migrate --fix`` puts the imports it adds: with the file's third-party ones.

The module's leading import block (after its docstring) is read as isort and ruff group it:
``__future__``, the standard library (`sys.stdlib_module_names`), third-party, and first-party
(relative imports, and the top-level names the caller knows to be local: modules and packages
next to the file or at the root of the scanned tree). A new ``import meshkit`` goes into the
third-party group at its alphabetical place; with no third-party import, after the standard
library group (a group of its own); with no import at all, after the docstring.

A statement of the leading block that sets up the environment (``os.environ``, ``os.putenv``,
``sys.path``) is never passed: importing meshkit imports jax, which reads ``JAX_*`` variables
on import. A bare ``pass`` there counts too: ``meshkit migrate`` puts one in place of a notebook's
IPython line that may change what an import finds (``%env``, ``!pip install``); a bare ``...``,
its placeholder for the harmless ones (``%matplotlib inline``), is skipped.

This module needs libcst (``pip install 'meshkit[migrate]'``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import libcst as cst

FUTURE = "__future__"
STDLIB = "stdlib"
THIRD_PARTY = "third-party"
FIRST_PARTY = "first-party"
_SETUP = re.compile(r"\b(?:os\.environ|os\.putenv|sys\.path|environ)\b")
_EMPTY = cst.Module(body=[])


def import_group(module: str, *, relative: bool = False, first_party: Collection[str] = ()) -> str:
    """The isort section of an import of ``module``.

    Args:
        module: the dotted module name imported (``"jax.numpy"``; ``""`` for ``from . import x``).
        relative: whether the import is relative (``from .x import y``).
        first_party: top-level names local to the project; a local module shadows a standard
            library one of the same name, as Python's search path has it.

    Returns:
        One of ``"__future__"``, ``"stdlib"``, ``"third-party"``, ``"first-party"``.

    Examples:
        >>> [import_group(m, first_party={"mylib"}) for m in ("os.path", "jax", "mylib.io")]
        ['stdlib', 'third-party', 'first-party']
    """
    top = module.split(".")[0]
    if relative:
        return FIRST_PARTY
    if top == FUTURE:
        return FUTURE
    if top in first_party:
        return FIRST_PARTY
    if top in sys.stdlib_module_names:
        return STDLIB
    return THIRD_PARTY


def add_imports(
    module: cst.Module, names: Sequence[str], first_party: Collection[str] = ()
) -> cst.Module:
    """The module with ``import <name>`` for each name it does not bind at the top yet.

    Args:
        module: the parsed module.
        names: top-level module names to import (``"meshkit"``, ``"jax"``).
        first_party: top-level names local to the project (see `import_group`).

    Returns:
        The new module; the same one when every name is bound already (``import jax`` and
        ``import jax.numpy`` both bind ``jax``; ``import jax as j`` does not).
    """
    for name in sorted(set(names)):
        if name not in _bound(module):
            module = _add(module, name, first_party)
    return module


@dataclass(frozen=True)
class _Import:
    index: int  # in the module's body
    group: str
    module: str


def _bound(module: cst.Module) -> set[str]:
    """Top-level names the module's top-level ``import x[.y]`` statements bind."""
    names: set[str] = set()
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Import):
                names |= {
                    _EMPTY.code_for_node(a.name).split(".")[0]
                    for a in small.names
                    if a.asname is None
                }
    return names


def _import_of(stmt: cst.BaseStatement) -> tuple[str, bool] | None:
    """(module, relative) of a line of imports only, else None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or not stmt.body:
        return None
    if not all(isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body):
        return None
    first = stmt.body[0]
    if isinstance(first, cst.Import):
        return _EMPTY.code_for_node(first.names[0].name), False
    assert isinstance(first, cst.ImportFrom)
    name = "" if first.module is None else _EMPTY.code_for_node(first.module)
    return name, bool(first.relative)


def _is_docstring(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.SimpleString | cst.ConcatenatedString)
    )


def _is_ellipsis(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.Ellipsis)
    )


def _is_setup(stmt: cst.BaseStatement) -> bool:
    """A statement an import must not move above: environment set-up, or a bare ``pass``."""
    if isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, cst.Pass) for s in stmt.body
    ):
        return True
    return _SETUP.search(_EMPTY.code_for_node(stmt)) is not None


def _leading_block(
    body: Sequence[cst.BaseStatement], first_party: Collection[str]
) -> tuple[list[_Import], int]:
    """The imports of the leading block, and the first index an import may go (the floor)."""
    floor = 1 if body and _is_docstring(body[0]) else 0
    imports: list[_Import] = []
    for index in range(floor, len(body)):
        stmt = body[index]
        found = _import_of(stmt)
        if found is not None:
            name, relative = found
            group = import_group(name, relative=relative, first_party=first_party)
            imports.append(_Import(index, group, name))
            if group == FUTURE:
                floor = index + 1
        elif _is_setup(stmt):
            floor = index + 1
        elif not _is_ellipsis(stmt):
            break
    return imports, floor


def _is_blank(line: cst.EmptyLine) -> bool:
    return line.comment is None


def _add(module: cst.Module, name: str, first_party: Collection[str]) -> cst.Module:
    body = list(module.body)
    imports, floor = _leading_block(body, first_party)
    third = [i for i in imports if i.group == THIRD_PARTY]
    stdlib = [i for i in imports if i.group == STDLIB]
    if third:
        later = [i.index for i in third if i.module.lower() > name]
        at = later[0] if later else third[-1].index + 1
    elif stdlib:
        at = stdlib[-1].index + 1
    else:
        at = floor
    at = max(at, floor)
    third_at = {i.index for i in third}
    new = cst.SimpleStatementLine([cst.Import([cst.ImportAlias(cst.Name(name))])])
    nxt = body[at] if at < len(body) else None
    own_group = at not in third_at and at - 1 not in third_at
    if nxt is not None and at in third_at:
        # In front of a third-party import: take the blank lines that open its group; the
        # comments above it stay with it.
        lines = list(nxt.leading_lines)
        k = next((n for n, line in enumerate(lines) if not _is_blank(line)), len(lines))
        new = new.with_changes(leading_lines=lines[:k])
        nxt = nxt.with_changes(leading_lines=lines[k:])
    elif own_group and at > 0:  # after a docstring, __future__, the stdlib group or a set-up
        new = new.with_changes(leading_lines=[cst.EmptyLine()])
    # A blank line after a group of its own, or before code.
    if nxt is not None and not nxt.leading_lines and (own_group or _import_of(nxt) is None):
        nxt = nxt.with_changes(leading_lines=[cst.EmptyLine()])
    tail = [] if nxt is None else [nxt, *body[at + 1 :]]
    return module.with_changes(body=[*body[:at], new, *tail])
