r"""Jupyter notebooks for ``meshkit migrate``: code cells as one module, and back.

A notebook's code cells run in one namespace, so they are analysed as one Python module: the
cells in order, each after a boundary comment line, with a map from the module's lines to
(code cell, line in the cell). Code cells count from 1, markdown and raw cells not counted.
IPython syntax that is not Python (``%magic``, a ``%%cell`` magic's whole cell, ``!shell``,
``x = !ls``, ``obj?``) becomes a numbered placeholder line, one line for one line and indented
as it was, and comes back unchanged when the module is split into cells again. The placeholder
is ``pass`` where the line may change what an import finds (``%pip``, ``%env``, ``%cd``, a cell
magic, any line magic not known to be harmless, a shell line that installs: ``!pip install``):
``meshkit migrate --fix`` puts no import above it. It is ``...`` for help (``obj?``), an
assignment from a magic (``x = !ls``), other shell lines and the display and timing magics
(``%matplotlib``, ``%time`` ...), which the import placement skips.

Writing keeps the file's JSON layout as far as `json` can: the indentation found (nbformat
writes 1), non-ASCII characters as they were, key order, the final newline; a changed cell's
``source`` is a list of lines, each ending in ``\n`` but the last, as nbformat writes it (a
string where the cell had a string). Outputs, metadata and unchanged cells are untouched.

Standard library only: reporting needs no more.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_BOUNDARY = "# <<meshkit migrate: code cell {}>>"
_BOUNDARY_RE = re.compile(r"^[ \t]*# <<meshkit migrate: code cell (\d+)>>[ \t]*$")
_MAGIC = "{}  # meshkit migrate: IPython line {}"  # pass (a barrier for imports) or ...
_MAGIC_RE = re.compile(r"^[ \t]*(?:pass|\.\.\.)  # meshkit migrate: IPython line (\d+)[ \t]*$")
# Line magics that change nothing an import finds.
_HARMLESS = frozenset(
    {"autoreload", "config", "history", "load_ext", "lsmagic", "matplotlib", "pprint"}
    | {"precision", "prun", "reload_ext", "time", "timeit", "who", "whos", "xmode"}
)
# `files = !ls`, `out = %sx ls`, `a, b = %time f()`: an assignment from a magic or a command.
_ASSIGN_MAGIC = re.compile(r"^[\w\s,.()\[\]*]+=\s*[!%]")
# `obj?`, `obj.attr??`, `%magic?`, `*pattern*?`: IPython's help.
_HELP = re.compile(r"^[\w.*%\[\]]*\?{1,2}$")
# A shell line that may install what an import then finds.
_INSTALLS = re.compile(r"\b(?:pip3?|conda|mamba|micromamba|uv|install|setup\.py)\b")
_WORD = re.compile(r"[A-Za-z_]\w*")
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


class NotebookError(ValueError):
    """The file is not a notebook meshkit migrate reads, or its cells cannot be rebuilt."""


@dataclass(frozen=True)
class CodeModule:
    """The code cells of a notebook as one Python module.

    Attributes:
        text: the module's source.
        lines: for each line of ``text`` (index = line - 1): (code cell from 1, line in the
            cell from 1); (cell, 0) for the boundary line in front of a cell.
        added: for each cell, whether the module added a newline after its last line.
        magics: the original text of each line replaced by ``pass``, by its number.
        words: every identifier in those lines (an import they use must stay).
    """

    text: str
    lines: tuple[tuple[int, int], ...]
    added: tuple[bool, ...]
    magics: dict[int, str] = field(default_factory=dict)
    words: frozenset[str] = frozenset()

    def locate(self, line: int) -> tuple[int, int]:
        """(code cell, line in the cell) of a 1-based line of ``text``."""
        if not self.lines:
            return 1, 1
        cell, in_cell = self.lines[min(max(line, 1), len(self.lines)) - 1]
        return cell, max(in_cell, 1)

    def split(self, text: str) -> list[str]:
        """A rewritten ``text`` as the sources of the code cells, IPython lines restored.

        Args:
            text: this module's text after a rewrite that kept the boundary comments and the
                ``pass`` lines (it may add, drop and change other lines).

        Returns:
            Each code cell's source (without the newline the module added after its last line).

        Raises:
            NotebookError: the boundaries or the IPython lines are not all there, in order.
        """
        cells: list[list[str]] = [[]]
        seen: set[int] = set()
        for line in _lines(text):
            body = line.rstrip("\r\n")
            boundary = _BOUNDARY_RE.match(body)
            if boundary is not None:
                if int(boundary.group(1)) != len(cells) + 1:
                    raise NotebookError("the rewritten code lost the order of its cells")
                cells.append([])
                continue
            magic = _MAGIC_RE.match(body)
            if magic is not None:
                number = int(magic.group(1))
                if number not in self.magics or number in seen:
                    raise NotebookError("the rewritten code changed an IPython line")
                seen.add(number)
                line = self.magics[number] + line[len(body) :]
            cells[-1].append(line)
        if len(cells) != len(self.added) or seen != set(self.magics):
            raise NotebookError("the rewritten code lost a cell boundary or an IPython line")
        sources = ["".join(c) for c in cells]
        return [
            s[:-1] if added and s.endswith("\n") else s
            for s, added in zip(sources, self.added, strict=True)
        ]


@dataclass(frozen=True)
class Notebook:
    r"""A notebook as read: its JSON, its code cells, and how the file was laid out.

    Attributes:
        doc: the notebook's JSON document.
        code: indexes in ``doc["cells"]`` of the code cells.
        sources: each code cell's source as one string.
        indent: the JSON indentation (None: all on one line).
        ascii: whether non-ASCII characters were written as ``\u`` escapes.
        final_newline: whether the file ended with a newline.
    """

    doc: dict[str, Any]
    code: tuple[int, ...]
    sources: tuple[str, ...]
    indent: int | str | None = 1
    ascii: bool = False
    final_newline: bool = True

    def module(self) -> CodeModule:
        """The code cells as one module (see `CodeModule`)."""
        return _module(self.sources)

    def with_sources(self, sources: Sequence[str]) -> Notebook:
        """The notebook with new code cell sources; a cell whose text is the same is untouched.

        Args:
            sources: one per code cell, in order.
        """
        cells = list(self.doc["cells"])
        for index, old, new in zip(self.code, self.sources, sources, strict=True):
            if new != old:
                cell = dict(cells[index])
                was = cell.get("source")
                cell["source"] = new if isinstance(was, str) else _lines(new)
                cells[index] = cell
        doc = {**self.doc, "cells": cells}
        return Notebook(doc, self.code, tuple(sources), self.indent, self.ascii, self.final_newline)

    def dumps(self) -> bytes:
        """The notebook's file content, laid out as the file read was."""
        text = json.dumps(self.doc, indent=self.indent, ensure_ascii=self.ascii)
        return (text + ("\n" if self.final_newline else "")).encode("utf-8")


def load_notebook(raw: bytes) -> Notebook:
    """A notebook from a file's bytes.

    Args:
        raw: the content of a ``.ipynb`` file (nbformat 4, UTF-8 JSON).

    Returns:
        The notebook.

    Raises:
        NotebookError: not UTF-8, not JSON, not nbformat 4, or a cell without a usable
            ``source``; the message says which.
    """
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise NotebookError(f"not UTF-8 ({e.reason})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise NotebookError(f"not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cells"), list):
        raise NotebookError("not a Jupyter notebook (no list of cells)")
    version = doc.get("nbformat")
    if version != 4:
        raise NotebookError(f"nbformat {version!r}; meshkit migrate reads nbformat 4")
    code: list[int] = []
    sources: list[str] = []
    for index, cell in enumerate(doc["cells"]):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if not isinstance(source, str):
            raise NotebookError(f"code cell {len(code) + 1} has no text as its source")
        code.append(index)
        sources.append(source)
    return Notebook(
        doc,
        tuple(code),
        tuple(sources),
        indent=_indent(text),
        ascii=text.isascii() and "\\u" in text,
        final_newline=text.endswith("\n"),
    )


def _indent(text: str) -> int | str | None:
    """The indentation of the JSON's second line (nbformat: 1 space); None for one line."""
    lines = text.lstrip("\ufeff").split("\n", 2)
    if len(lines) < 2 or not lines[1].strip():
        return None
    width = len(lines[1]) - len(lines[1].lstrip(" \t"))
    indent = lines[1][:width]
    return len(indent) if indent == " " * width else indent or None


def _lines(text: str) -> list[str]:
    r"""The lines of a text as Python counts them (``\n``, ``\r\n``, ``\r``), with their ends."""
    return _LINE.findall(text)


def _module(sources: Sequence[str]) -> CodeModule:
    chunks: list[str] = []
    lines: list[tuple[int, int]] = []
    magics: dict[int, str] = {}
    for cell, source in enumerate(sources, start=1):
        if cell > 1:
            chunks.append(_BOUNDARY.format(cell) + "\n")
            lines.append((cell, 0))
        text = source if source.endswith("\n") or not source else source + "\n"
        for n, line in enumerate(_python(_lines(text), magics), start=1):
            chunks.append(line)
            lines.append((cell, n))
    words = frozenset(w for line in magics.values() for w in _WORD.findall(line))
    added = tuple(not s.endswith("\n") for s in sources)
    return CodeModule("".join(chunks), tuple(lines), added, magics, words)


def _python(lines: list[str], magics: dict[int, str]) -> list[str]:
    """A cell's lines with the IPython ones replaced by numbered ``pass`` lines."""

    def replace(i: int, indent: str, barrier: bool = True) -> None:
        body = lines[i].rstrip("\r\n")
        number = len(magics)
        magics[number] = body
        placeholder = _MAGIC.format("pass" if barrier else "...", number)
        out[i] = indent + placeholder + lines[i][len(body) :]

    out = list(lines)
    first = next((ln for ln in lines if ln.strip()), "")
    if first.lstrip().startswith("%%"):  # a cell magic: the whole cell is its input
        for i in range(len(lines)):
            replace(i, "")
        return out
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped and _is_ipython(stripped) and _at_statement_start(out[:i]):
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip(" \t"))]
            barrier = _is_barrier(stripped)
            replace(i, indent, barrier)
            while lines[i].rstrip("\r\n").endswith("\\") and i + 1 < len(lines):
                i += 1  # a magic continued on the next line
                replace(i, indent, barrier)
        i += 1
    return out


def _is_ipython(stripped: str) -> bool:
    """Whether a line (stripped) is IPython syntax, given that it starts a statement."""
    if stripped[0] in "%!?":
        return True
    if stripped.startswith("#"):
        return False
    return _ASSIGN_MAGIC.match(stripped) is not None or _HELP.match(stripped) is not None


def _is_barrier(stripped: str) -> bool:
    """Whether an IPython line may change what an import finds (see the module docstring)."""
    if stripped.startswith("%") and not stripped.startswith("%%"):
        name = stripped[1:].split(maxsplit=1)[0] if stripped[1:].strip() else ""
        return name.rstrip("?") not in _HARMLESS
    if stripped.startswith("?") or stripped.endswith("?"):
        return False  # help
    if stripped.startswith("!"):
        return _INSTALLS.search(stripped) is not None
    return _ASSIGN_MAGIC.match(stripped) is None


def _at_statement_start(lines: list[str]) -> bool:
    """Whether the line after ``lines`` starts a statement.

    It does when the lines close every bracket, string and backslash continuation.
    """
    if not lines:
        return True
    if lines[-1].rstrip("\r\n").endswith("\\"):
        return False
    try:
        for _ in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
            pass
    except (tokenize.TokenError, SyntaxError):
        return False
    return True
