"""The scanner of ``meshkit migrate``: legacy pmap patterns in Python source, through `ast`.

A file is parsed, its names resolved (`meshkit._src.migrate.resolve`), the run's flow of pmap
outputs between files analysed (`meshkit._src.migrate.flow`), then every rule checked
(`meshkit._src.migrate.checks`); the findings are sorted and filtered here.

A ``# meshkit: ignore`` comment (or ``# meshkit: ignore[MK001,MK010]``) on a finding's first
line silences it, and ``--fix`` then leaves that line alone.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Collection, Mapping

from .checks import Checks
from .facts import Facts
from .findings import Finding
from .flow import analyze
from .resolve import ResolvedFile

# Every rule needs one of these in the text (an import, an attribute or the flag's name), so a
# file without any is parsed (to report syntax errors) but not analysed.
# (MK012's names resolve through an import that names jax.)
_MAYBE = re.compile(r"(?i:pmap)|jax_utils|common_utils|device_put_|\bjax\b")
_DEFINES = re.compile(r"^\s*(?:async\s+)?def\s", re.MULTILINE)  # helpers pmap outputs reach
_IGNORE = re.compile(r"#\s*meshkit:\s*ignore(?:\[(?P<codes>[A-Za-z0-9,\s]*)\])?")


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

    Examples:
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
    file = ResolvedFile(tree, source, path)
    if facts is None or path not in facts.modules:
        facts = analyze({path: file}, Facts.for_paths({path: source}))
    found = Checks(file).scan(facts)
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
    files = {}
    for path, source in sources.items():
        try:
            tree = ast.parse(source, filename=path)
        except (SyntaxError, ValueError, RecursionError):
            continue  # scan_source reports why
        if _MAYBE.search(source) or _DEFINES.search(source):
            files[path] = ResolvedFile(tree, source, path)
    return analyze(files, facts)


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
