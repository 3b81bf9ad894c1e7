"""``meshkit migrate``: report legacy pmap patterns, and rewrite the mechanical ones.

Reporting needs only the standard library (`ast`, in `meshkit._src.migrate.scan`); ``--fix`` and
``--diff`` need libcst (``pip install 'meshkit[migrate]'``), imported only then. After fixing,
each file is scanned again, so what the report and the exit status say remains is what the new
text holds.

Jupyter notebooks (``*.ipynb``) are scanned and fixed by their code cells
(`meshkit._src.migrate.notebook`). ``--fix`` computes every new text before it writes any, and
writes each file whole or not at all (`meshkit._src.migrate.files.write_atomic`). What the run
finds goes into one `meshkit._src.migrate.formats.FileResult` per path, which the reports read.

Exit status: 0 nothing found (or, with ``--fix``, nothing left); 1 findings remain; 2 a path
is missing, a file cannot be read, parsed or written, or libcst is missing for ``--fix`` /
``--diff``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import gc
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from .facts import Facts
from .files import FirstParty, decode, discover, write_atomic
from .findings import Finding
from .formats import REPORTS, FileResult
from .notebook import CodeModule, NotebookError, load_notebook
from .rules import RULES
from .scan import project_facts, scan_source

EXIT_CLEAN = 0
EXIT_FINDINGS = 1
EXIT_ERROR = 2
_NEEDS_LIBCST = (
    "error: --fix and --diff need libcst, which meshkit installs as an extra: "
    "pip install 'meshkit[migrate]'"
)

_EPILOG = """\
examples:
  meshkit migrate src/                  report, one line per finding and its explanation
  meshkit migrate --diff src/ > mk.patch  the rewrites as a patch, report on stderr
  meshkit migrate --fix src/ train.py   rewrite the mechanical cases in place
  meshkit migrate --fix notebooks/ a.ipynb   notebooks too: their code cells, in place
  meshkit migrate --format json src/    for tools (--format sarif: SARIF 2.1.0)
  meshkit migrate --ignore MK010 src/   CI gate without one rule
  meshkit migrate --exclude 'tests/*' --exclude '*_pb2.py' src/   skip paths (fnmatch patterns)
  cat train.py | meshkit migrate --fix -   the fixed source on stdout, the report on stderr

rules:
{rules}

--fix rewrites MK001 (jax.pmap -> meshkit.pmap_compat, unless out_axes is negative, None or
computed), MK005-MK007 (flax.jax_utils / common_utils helpers and jax.device_put_replicated /
sharded -> meshkit's), so MK002 when every pmap involved is rewritten, MK010 where the read has
a meshkit equivalent (x[0] -> meshkit.unreplicate(x), np.asarray(x) and jax.device_get(x) ->
meshkit.local_from_global(x)), and MK012 where one name replaces a removed one (jax.tree_map ->
jax.tree.map); it adds `import meshkit` (or `import jax`) with the third-party imports, and
drops imports nothing uses any more. The others need a person. `# meshkit: ignore` or
`# meshkit: ignore[MK010]` on a line silences its findings.

notebooks (*.ipynb): the code cells are read as one module (IPython magics and shell lines are
kept as they are); findings read path.ipynb:cell N:line:col, --diff shows the cells' code.
--fix computes every new text first, then writes each file whole (a temporary file, renamed);
a file that cannot be written is an error, left unchanged, and the others are still written.

exit status: 0 nothing found (or nothing left after --fix); 1 findings remain; 2 a path is
missing, a file cannot be read, parsed or written, or libcst is missing for --fix/--diff."""


EPILOG = _EPILOG.format(rules="\n".join(f"  {r.code}  {r.name}" for r in RULES.values()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``meshkit migrate`` on its subparser."""
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="files (*.py, *.ipynb), or directories searched for both; - reads one Python "
        "file from stdin",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="skip files and directories whose path (as found) or name matches this fnmatch "
        "pattern; repeatable",
    )
    parser.add_argument(
        "--fix", action="store_true", help="rewrite the mechanical cases in place (needs libcst)"
    )
    parser.add_argument(
        "--diff",
        action="store_true",
        help="print the rewrites as a unified diff (the report goes to stderr); with --fix, "
        "also write them",
    )
    parser.add_argument(
        "--format",
        choices=["text", "json", "sarif"],
        default="text",
        help="report format (default text); sarif: SARIF 2.1.0, for code-scanning tools",
    )
    parser.add_argument(
        "--concise", action="store_true", help="one line per finding, without the explanation"
    )
    parser.add_argument(
        "--select", default=None, metavar="CODES", help="only these rules, e.g. MK001,MK003"
    )
    parser.add_argument(
        "--ignore", default=None, metavar="CODES", help="skip these rules, e.g. MK010"
    )


@dataclass
class _Write:
    """A file --fix rewrites: written once every new text is known."""

    result: FileResult
    path: Path
    data: bytes
    findings: list[Finding]  # what the new text holds
    cells: list[int] = field(default_factory=list)


STDIN = "<stdin>"  # the name a source read from stdin (the path -) has in reports


def run(
    args: argparse.Namespace,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    stdin: BinaryIO | None = None,
) -> int:
    """Run ``meshkit migrate`` with parsed arguments; returns the exit status.

    Args:
        args: the namespace `add_arguments` describes.
        stdout: where the report (or, with ``--diff``, the patch) goes; default sys.stdout.
        stderr: where errors (and, with ``--diff``, the text report) go; default sys.stderr.
        stdin: where the path ``-`` is read from; default sys.stdin's bytes. With ``--fix``,
            its fixed source goes to ``stdout`` and the report to ``stderr``.

    Returns:
        0, 1 or 2, as the module docstring says.
    """
    # A scan makes millions of small AST and fact objects that live until the file is done;
    # with the default threshold (700) the collector walks them again and again, and on a
    # 20,000-line file it took a third of the time, growing faster than the file.
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], _GC_THRESHOLD), *threshold[1:])
    try:
        return _run(args, stdout, stderr, stdin)
    finally:
        gc.set_threshold(*threshold)


_GC_THRESHOLD = 100_000


def _run(
    args: argparse.Namespace,
    stdout: TextIO | None,
    stderr: TextIO | None,
    stdin: BinaryIO | None,
) -> int:
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    try:
        select = _codes(args.select, "--select")
        ignore = _codes(args.ignore, "--ignore") or set()
    except ValueError as e:
        print(f"error: {e}", file=err)
        return EXIT_ERROR
    rewrite = args.fix or args.diff
    fix_source = add_init = None
    if rewrite:
        try:
            from .fix import add_init, fix_source
        except ImportError:
            print(_NEEDS_LIBCST, file=err)
            return EXIT_ERROR
    files, missing = discover([p for p in args.paths if p != "-"], args.exclude)
    results: list[FileResult] = [FileResult(p, error="no such file or directory") for p in missing]
    piped: str | None = None  # with - and --fix: the fixed source, for stdout
    sources: list[Path | None] = [*([None] if "-" in args.paths else []), *files]
    first_party = FirstParty(Path(p) for p in args.paths if p != "-" and Path(p).is_dir())
    writes: list[_Write] = []  # with --fix: written once every new text is known
    read: list[tuple[FileResult, Path | None, str, str]] = []
    notebooks: list[tuple[FileResult, Path]] = []
    for path in sources:
        result = FileResult(STDIN if path is None else str(path))
        results.append(result)
        if path is not None and path.suffix == ".ipynb":
            notebooks.append((result, path))
            continue
        try:
            if path is None:
                raw = (stdin if stdin is not None else sys.stdin.buffer).read()
            else:
                raw = path.read_bytes()
            source, encoding = decode(raw)
        except (OSError, UnicodeDecodeError, SyntaxError) as e:
            result.error = _describe(e)
            continue
        if path is None:
            piped = source
        read.append((result, path, source, encoding))
    # Pmap outputs flow between the run's files (a helper in utils.py reads what train.py
    # passes it): what each file says of its functions, before any file is scanned.
    texts = {r.path: source for r, _, source, _ in read}
    texts.update((r.path, code) for r, p in notebooks if (code := _notebook_code(p)) is not None)
    facts = _deep(project_facts, texts)
    for result, path in notebooks:
        writes.extend(_notebook(result, path, args, select, ignore, fix_source, first_party, facts))
    for result, path, source, encoding in read:
        try:
            result.findings = _scan(source, result.path, select, ignore, facts)
        except SyntaxError as e:
            result.error = _describe(e)
            if e.lineno:
                result.where = f"{e.lineno}:{e.offset or 1}:"
            continue
        except RecursionError as e:  # deeper than even _deep's stack allows
            result.error = _too_deep(e)
            continue
        result.before = len(result.findings)
        edits = [f.edit for f in result.findings if f.fixable and f.edit is not None]
        if fix_source is None or not edits:
            continue
        try:
            local = () if path is None else first_party.names(path)
            new = _deep(fix_source, source, edits, local)
            if new != source and add_init is not None:  # a rewritten program must join
                new, result.init_line = _deep(add_init, new, local)
            after = _scan(new, result.path, select, ignore, facts)
        except SyntaxError as e:  # libcst refused a file ast accepted
            result.error = f"cannot rewrite: {e.msg}"
            continue
        except RecursionError:  # deeper than even _deep's stack allows: the file is untouched
            result.error = "cannot rewrite: nested too deeply for libcst (the file is unchanged)"
            continue
        if new == source:
            continue
        if args.diff:
            result.diff = _unified(result.path, source, new)
        if args.fix:
            if path is None:
                piped = new
                result.findings = after
            else:
                writes.append(_Write(result, path, new.encode(encoding), after))
    _write_all(writes)
    report = REPORTS[args.format](results, args)
    if args.fix and piped is not None:  # a filter: the source out, the report aside
        out.write(piped)
        err.write(report)
    elif args.diff and args.format == "text":
        out.write("".join(r.diff for r in results))
        err.write(report)
    else:
        out.write(report)
    for r in results:
        if r.error and args.format == "text":  # json and sarif carry their errors
            print(r.error_line, file=err)
    if any(r.error for r in results):
        return EXIT_ERROR
    return EXIT_FINDINGS if any(r.findings for r in results) else EXIT_CLEAN


def _write_all(writes: Sequence[_Write]) -> None:
    """Write each file whole; one that cannot be written is its result's error, unchanged."""
    for w in writes:
        try:
            write_atomic(w.path, w.data)
        except OSError as e:
            w.result.error = f"cannot write: {e.strerror or e} (the file is unchanged)"
            continue
        w.result.findings, w.result.cells = w.findings, w.cells


def _notebook(
    result: FileResult,
    path: Path,
    args: argparse.Namespace,
    select: set[str] | None,
    ignore: set[str],
    fix_source: Callable[..., str] | None,
    first_party: FirstParty,
    facts: Facts,
) -> list[_Write]:
    """Scan a notebook's code cells into ``result``; with ``--fix``, the write to make.

    ``fix_source``: `meshkit._src.migrate.fix.fix_source`, None without --fix and --diff.
    """
    try:
        notebook = load_notebook(path.read_bytes())
    except OSError as e:
        result.error = _describe(e)
        return []
    except NotebookError as e:
        result.error = f"cannot read notebook: {e}"
        return []
    code = notebook.module()
    try:
        found = _scan(code.text, result.path, select, ignore, facts)
    except SyntaxError as e:
        result.error = _describe(e)
        if e.lineno:
            result.error_cell, line = code.locate(e.lineno)
            result.where = f"{line}:{e.offset or 1}:"
        return []
    except RecursionError as e:
        result.error = _too_deep(e)
        return []
    result.findings, result.cells = _in_cells(found, code)
    result.before = len(result.findings)
    edits = [f.edit for f in result.findings if f.fixable and f.edit is not None]  # as found
    if fix_source is None or not edits:
        return []
    try:
        # Names the IPython lines use keep their imports: the scanner does not see those lines.
        local = first_party.names(path)
        new_text = _deep(fix_source, code.text, edits, local, code.words)
        fixed = notebook.with_sources(code.split(new_text))
        new_code = fixed.module()
        after = _scan(new_code.text, result.path, select, ignore, facts)
    except (SyntaxError, NotebookError) as e:
        result.error = f"cannot rewrite: {e.msg if isinstance(e, SyntaxError) else e}"
        return []
    except RecursionError:
        result.error = "cannot rewrite: nested too deeply for libcst (the file is unchanged)"
        return []
    changed = [
        (n, old, new)
        for n, (old, new) in enumerate(zip(notebook.sources, fixed.sources, strict=True), 1)
        if old != new
    ]
    if not changed:
        return []
    if args.diff:
        result.diff = "".join(_unified(f"{result.path}:cell {n}", o, w) for n, o, w in changed)
    if not args.fix:
        return []
    return [_Write(result, path, fixed.dumps(), *_in_cells(after, new_code))]


def _notebook_code(path: Path) -> str | None:
    """A notebook's code cells as one module, for `project_facts` (None: `_notebook` says why)."""
    try:
        return load_notebook(path.read_bytes()).module().text
    except (OSError, NotebookError):
        return None


def _in_cells(found: list[Finding], code: CodeModule) -> tuple[list[Finding], list[int]]:
    """Findings of a notebook's code module at their lines in their cells, and those cells.

    An import reported unused that an IPython line uses (``%timeit pmap(f)(x)``) is left out:
    the scanner does not see those lines, and ``--fix`` keeps such an import.
    """
    found = [
        f
        for f in found
        if not (f.edit and not f.edit.old and f.edit.binding and f.edit.binding[0] in code.words)
    ]
    located = [code.locate(f.line) for f in found]
    findings = [
        dataclasses.replace(f, line=line) for f, (_, line) in zip(found, located, strict=True)
    ]
    return findings, [cell for cell, _ in located]


def _too_deep(error: RecursionError) -> str:
    """Why a file nested too deeply cannot be scanned: Python's own parser, or the scan's stack.

    Since Python 3.12 the parser's C recursion limit is fixed, whatever `sys.setrecursionlimit`
    says: a file it cannot parse (a sum of 3,000 terms) cannot be compiled or run there either.
    """
    where = str(error)
    if "during ast construction" in where or "during compilation" in where:
        version = ".".join(map(str, sys.version_info[:2]))
        return (
            f"cannot scan: nested too deeply for Python {version}'s parser, which cannot "
            "compile or run this file either (the file is unchanged)"
        )
    return "cannot scan: nested too deeply, even for a 200,000-frame stack (the file is unchanged)"


def _scan(
    source: str, path: str, select: set[str] | None, ignore: set[str], facts: Facts
) -> list[Finding]:
    """`scan_source` in `_deep`'s thread: ast and the flow analysis recurse with the nesting.

    Raises:
        SyntaxError: the source does not parse.
        RecursionError: nested beyond even that thread's limit.
    """
    scan = functools.partial(scan_source, select=select, ignore=ignore, facts=facts)
    return _deep(scan, source, path)


_DEEP_STACK = 512 * 1024 * 1024  # bytes: libcst recurses once per statement in places
_DEEP_LIMIT = 200_000


def _deep(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a thread with a large stack and recursion limit, for libcst.

    libcst's visitors recurse through a module's statements: a docstring and about 1,000
    top-level statements exceed Python's default recursion limit. A thread of its own gets a
    C stack large enough for a raised limit (raising it on the main thread's 8 MiB stack would
    crash instead of raising).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    limit = sys.getrecursionlimit()
    previous = threading.stack_size(_DEEP_STACK)
    try:
        thread = threading.Thread(target=target, name="meshkit-migrate-fix")
        sys.setrecursionlimit(max(limit, _DEEP_LIMIT))  # before the thread recurses
        try:
            thread.start()
        except RuntimeError:  # no room for such a stack (a ulimit -v): as deep as we can here
            sys.setrecursionlimit(limit)  # the main thread's stack holds only the usual limit
            return fn(*args)
        thread.join()
    finally:
        threading.stack_size(previous)
        sys.setrecursionlimit(limit)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _codes(value: str | None, option: str) -> set[str] | None:
    if value is None:
        return None
    codes = {c.strip().upper() for c in value.split(",") if c.strip()}
    unknown = sorted(codes - RULES.keys())
    if unknown:
        raise ValueError(
            f"{option}: unknown rule code(s) {', '.join(unknown)}; "
            f"the rules are {', '.join(RULES)}."
        )
    return codes


def _describe(e: Exception) -> str:
    if isinstance(e, SyntaxError):
        return f"cannot parse: {e.msg}"
    if isinstance(e, UnicodeDecodeError):
        return f"cannot decode: {e.reason}"
    return f"cannot read: {e.strerror or e}" if isinstance(e, OSError) else str(e)


def _unified(path: str, old: str, new: str) -> str:
    """A unified diff; relative paths get git's a/ and b/ so that ``git apply`` takes it."""
    name = Path(path).as_posix()
    before, after = (name, name) if Path(path).is_absolute() else (f"a/{name}", f"b/{name}")
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), before, after
    )
    marked = (ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in lines)
    return "".join(marked)
