"""The reports of ``meshkit migrate``: text for people, JSON for tools, SARIF for code scanning.

A run over files (`meshkit._src.migrate.command`) leaves one `FileResult` per path: its findings
(a notebook's at their code cells), or why it could not be scanned or fixed. Each report reads
only those results and the options that shape it (``--fix``, ``--diff``, ``--concise``).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .findings import Finding
from .rules import RULES

_WIDTH = 100


@dataclass
class FileResult:
    """What a run found in one path, or why it could not scan or rewrite it.

    Attributes:
        path: the path as given or found (``<stdin>`` for ``-``).
        findings: what the file holds (after ``--fix``: what its new text holds).
        before: how many findings there were before ``--fix`` / ``--diff`` rewrote the file.
        diff: the rewrite as a unified diff (with ``--diff``).
        error: why the path was not scanned, or not rewritten; "" when it was.
        where: ``"line:col:"`` of a parse error (in its cell, for a notebook).
        cells: a notebook's: each finding's code cell.
        error_cell: a notebook's: the code cell of a parse error.
        init_line: where ``--fix`` / ``--diff`` added ``meshkit.init()`` to the program's
            ``if __name__ == "__main__":`` block (None: not added).
    """

    path: str
    findings: list[Finding] = field(default_factory=list)
    before: int = 0
    diff: str = ""
    error: str = ""
    where: str = ""
    cells: list[int] = field(default_factory=list)
    error_cell: int = 0
    init_line: int | None = None

    @property
    def error_line(self) -> str:
        """The error as reported: ``path:cell N:line:col: error: why``."""
        cell = f"cell {self.error_cell}:" if self.error_cell else ""
        return f"{self.path}:{cell}{self.where} error: {self.error}"

    def located(self) -> Iterator[tuple[Finding, int | None]]:
        """Each finding with its code cell (None outside notebooks)."""
        cells: Sequence[int | None] = self.cells or [None] * len(self.findings)
        return zip(self.findings, cells, strict=True)


def _explain(label: str, text: str) -> str:
    return textwrap.fill(
        text,
        width=_WIDTH,
        initial_indent=f"    {label} ",
        subsequent_indent=" " * (len(label) + 5),
        break_on_hyphens=False,
        break_long_words=False,
    )


def _line(f: Finding, rewrite: bool, cell: int | None = None) -> str:
    mark = ""
    if f.note:
        mark = f" [{f.note}]"
    elif f.fixable and not rewrite:
        mark = " [fixable]"
    where = f"{f.path}:" if cell is None else f"{f.path}:cell {cell}:"  # ruff's notebook style
    return f"{where}{f.line}:{f.col}: {f.code} {f.message}{mark}"


def _text(results: list[FileResult], args: argparse.Namespace) -> str:
    lines: list[str] = []
    findings = [f for r in results for f in r.findings]
    for f, cell in (located for r in results for located in r.located()):
        lines.append(_line(f, args.fix, cell))
        if not args.concise:
            lines.append(_explain("why:", f.rule.why))
            lines.append(_explain("fix:", f.rule.fix))
    scanned = sum(1 for r in results if not r.error)
    files = f"{scanned} file{'s' if scanned != 1 else ''}"
    with_findings = sum(1 for r in results if r.findings)
    before = sum(r.before for r in results)
    for r in results:
        if r.init_line is not None:
            lines.append(
                f"{r.path}:{r.init_line}: added meshkit.init(), first in the program's "
                '`if __name__ == "__main__":` block: its processes join one program.'
            )
    if args.fix and before:
        fixed = before - len(findings)
        lines.append(
            f"Fixed {fixed} of {before} finding{'s' if before != 1 else ''} in {files}; "
            f"{len(findings)} remain{'s' if len(findings) == 1 else ''}."
        )
    elif findings:
        fixable = sum(1 for f in findings if f.fixable)
        lines.append(
            f"{len(findings)} finding{'s' if len(findings) != 1 else ''} in {with_findings} of "
            f"{files} ({fixable} fixable with --fix)."
        )
    else:
        lines.append(f"No legacy pmap patterns in {files}.")
    errors = sum(1 for r in results if r.error)
    if errors:
        lines.append(f"{errors} path{'s' if errors != 1 else ''} not scanned (errors on stderr).")
    return "\n".join(lines) + "\n"


def _json(results: list[FileResult], args: argparse.Namespace) -> str:
    findings = [
        {
            "path": f.path,
            **({} if cell is None else {"cell": cell}),  # a notebook's code cell, from 1
            "line": f.line,
            "column": f.col,
            "code": f.code,
            "rule": f.rule.name,
            "message": f.message,
            "fixable": f.fixable,
            "note": f.note,
            "why": f.rule.why,
            "fix": f.rule.fix,
        }
        for r in results
        for f, cell in r.located()
    ]
    doc: dict[str, Any] = {
        "version": 1,
        "files": sum(1 for r in results if not r.error),
        "findings": findings,
        "errors": [{"path": r.path, "error": r.error_line} for r in results if r.error],
        "rules": [
            {"code": r.code, "name": r.name, "why": r.why, "fix": r.fix} for r in RULES.values()
        ],
    }
    if args.fix:
        doc["fixed"] = sum(r.before for r in results) - len(findings)
    if args.diff:
        doc["diff"] = "".join(r.diff for r in results)
    return json.dumps(doc, indent=2) + "\n"


_SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _sarif(results: list[FileResult], args: argparse.Namespace) -> str:
    """The report as SARIF 2.1.0: one run, every rule described, errors as notifications."""
    from ..core.version import __version__

    def location(path: str, line: int, col: int) -> dict[str, Any]:
        return {
            "physicalLocation": {
                "artifactLocation": {"uri": Path(path).as_posix()},
                "region": {"startLine": line, "startColumn": col},
            }
        }

    rules = [
        {
            "id": r.code,
            "name": r.name,
            "shortDescription": {"text": r.name},
            "fullDescription": {"text": r.why},
            "help": {"text": r.fix},
        }
        for r in RULES.values()
    ]
    index = {code: i for i, code in enumerate(RULES)}
    found = [
        {
            "ruleId": f.code,
            "ruleIndex": index[f.code],
            "level": "warning",
            "message": {"text": f.message + (f" ({f.note})" if f.note else "")},
            "locations": [location(f.path, f.line, f.col)],
            # A notebook's region is in its code cell (from 1), named here.
            "properties": {"fixable": f.fixable, **({} if cell is None else {"cell": cell})},
        }
        for r in results
        for f, cell in r.located()
    ]
    notes = [
        {
            "level": "error",
            "message": {"text": r.error},
            "locations": [location(r.path, *_where_of(r))],
            **({"properties": {"cell": r.error_cell}} if r.error_cell else {}),
        }
        for r in results
        if r.error
    ]
    doc = {
        "$schema": _SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "meshkit migrate",
                        "version": __version__,
                        "rules": rules,
                    }
                },
                "invocations": [
                    {"executionSuccessful": not notes, "toolExecutionNotifications": notes}
                ],
                "results": found,
            }
        ],
    }
    return json.dumps(doc, indent=2) + "\n"


def _where_of(result: FileResult) -> tuple[int, int]:
    """(line, column) of a file's error: where it failed to parse, else 1:1."""
    line, _, col = result.where.rstrip(":").partition(":")
    return (int(line), int(col)) if line.isdigit() and col.isdigit() else (1, 1)


# --format's choices, each a report of the run's results.
REPORTS: dict[str, Callable[[list[FileResult], argparse.Namespace], str]] = {
    "json": _json,
    "sarif": _sarif,
    "text": _text,
}
