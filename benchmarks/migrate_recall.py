"""Recall of ``meshkit migrate`` on a corpus of real pmap-era files, labelled by hand.

The manifest (benchmarks/migrate_corpus.json) names each third-party file by repository, commit
and path, with its sha256 and the patterns a person found in it by reading it (rule, line, for
notebooks the code cell counting code cells only from 1, and the code). The files themselves are
not in this repository: they live in a corpus directory laid out as ``<owner>/<repo>/<path>``
(``--corpus``, default ``$MESHKIT_CORPUS`` or ``~/.cache/meshkit/migrate-corpus``); ``--fetch``
downloads the missing ones from raw.githubusercontent.com at the recorded commits.

For each repository it copies the available files into a temporary directory, keeping their
relative paths, and runs ``python -m meshkit migrate --format json --concise`` once on that
directory (so that a value flowing from one module into a helper of another can be followed).
A label is found when a finding has its path, cell, line and rule; a finding on a (path, cell,
line, rule) the manifest lacks is a false report. Then ``--fix`` runs on a second copy and every
file it changed must still compile (a notebook: each code cell, without its ``%`` and ``!``
lines).

Prints a table and ends with ``recall: X/Y = Z%   false reports: F   fixed files compiling: A/B``.
Exit status 0; with ``--check``, 1 when recall is below 95%, a false report, or a fixed file that
does not compile. A corpus with no file available is not an error: the script says how to get
the files and exits 0 (CI machines do not have them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "migrate_corpus.json"
DEFAULT_CORPUS = Path("~/.cache/meshkit/migrate-corpus")
RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
RECALL_GOAL = 0.95
FETCH_TIMEOUT_S = 30

# (path relative to its repository, code cell or 0 for a .py file, line, rule)
Key = tuple[str, int, int, str]


@dataclass(frozen=True)
class Label:
    """One pattern the manifest records."""

    repo: str
    path: str
    cell: int
    line: int
    rule: str
    code: str
    note: str = ""

    @property
    def key(self) -> Key:
        return (self.path, self.cell, self.line, self.rule)


@dataclass(frozen=True)
class Finding:
    """One finding of ``meshkit migrate``, its path made relative to its repository."""

    repo: str
    path: str
    cell: int
    line: int
    rule: str
    message: str

    @property
    def key(self) -> Key:
        return (self.path, self.cell, self.line, self.rule)


@dataclass
class Comparison:
    """Labels against findings: what was found, missed, and reported without a label."""

    found: list[Label] = field(default_factory=list)
    missed: list[Label] = field(default_factory=list)
    false_reports: list[Finding] = field(default_factory=list)

    @property
    def labelled(self) -> int:
        return len(self.found) + len(self.missed)

    @property
    def recall(self) -> float:
        return len(self.found) / self.labelled if self.labelled else 1.0

    def per_rule(self) -> dict[str, tuple[int, int, int]]:
        """rule -> (found, labelled, false reports)."""
        rules = sorted(
            {x.rule for x in self.found}
            | {x.rule for x in self.missed}
            | {x.rule for x in self.false_reports}
        )
        table = {}
        for rule in rules:
            found = sum(1 for x in self.found if x.rule == rule)
            missed = sum(1 for x in self.missed if x.rule == rule)
            false = sum(1 for x in self.false_reports if x.rule == rule)
            table[rule] = (found, found + missed, false)
        return table


@dataclass
class FixCheck:
    """What ``--fix`` did to the copy: files changed, which of them compile, findings left."""

    changed: list[str] = field(default_factory=list)
    not_compiling: list[str] = field(default_factory=list)  # "repo/path: error"
    broken_before: list[str] = field(default_factory=list)  # did not compile before the fix
    remaining: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def compiling(self) -> int:
        return len(self.changed) - len(self.not_compiling)


def load_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def labels_of(entries: Iterable[Mapping[str, Any]]) -> list[Label]:
    return [
        Label(
            repo=e["repo"],
            path=e["path"],
            cell=int(p.get("cell", 0)),
            line=int(p["line"]),
            rule=p["rule"],
            code=p.get("code", ""),
            note=p.get("note", ""),
        )
        for e in entries
        for p in e["patterns"]
    ]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def split_available(
    entries: Iterable[Mapping[str, Any]], corpus: Path
) -> tuple[list[Mapping[str, Any]], list[tuple[Mapping[str, Any], str]]]:
    """The entries whose file is in the corpus with the recorded sha256, and the others (why)."""
    available: list[Mapping[str, Any]] = []
    unavailable: list[tuple[Mapping[str, Any], str]] = []
    for e in entries:
        file = corpus / e["repo"] / e["path"]
        if not file.is_file():
            unavailable.append((e, "missing"))
        elif sha256(file) != e["sha256"]:
            unavailable.append((e, "sha256 differs"))
        else:
            available.append(e)
    return available, unavailable


def fetch_missing(entries: Iterable[Mapping[str, Any]], corpus: Path) -> list[str]:
    """Downloads the files not in the corpus at their commits; returns one line per failure."""
    problems = []
    for e in entries:
        file = corpus / e["repo"] / e["path"]
        if file.is_file() and sha256(file) == e["sha256"]:
            continue
        url = RAW_URL.format(repo=e["repo"], commit=e["commit"], path=e["path"])
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
                data = response.read()
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            problems.append(f"{e['repo']}/{e['path']}: cannot fetch {url}: {reason}")
            continue
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            problems.append(f"{e['repo']}/{e['path']}: fetched, but its sha256 differs")
            continue
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(data)
    return problems


def copy_repos(entries: Iterable[Mapping[str, Any]], corpus: Path, dest: Path) -> list[str]:
    """Copies each entry's file to ``dest/<owner>/<repo>/<path>``; returns the repositories."""
    repos: list[str] = []
    for e in entries:
        target = dest / e["repo"] / e["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(corpus / e["repo"] / e["path"], target)
        if e["repo"] not in repos:
            repos.append(e["repo"])
    return repos


def run_migrate(root: Path, extra: Sequence[str]) -> tuple[dict[str, Any], str]:
    """``python -m meshkit migrate --format json <extra> root``: (the JSON report, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "meshkit", "migrate", "--format", "json", *extra, str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"meshkit migrate exited {proc.returncode} without a JSON report: {' | '.join(tail)}"
        ) from None
    return report, proc.stderr


def findings_of(report: Mapping[str, Any], repo: str, root: Path) -> list[Finding]:
    """The report's findings with paths relative to ``root`` (the copy of ``repo``)."""
    found = []
    for f in report.get("findings", []):
        path = Path(f["path"])
        try:
            rel = path.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            rel = path.as_posix()
        found.append(
            Finding(
                repo=repo,
                path=rel,
                cell=int(f.get("cell") or 0),
                line=int(f["line"]),
                rule=f["code"],
                message=f.get("message", ""),
            )
        )
    return found


def compare(labels: Iterable[Label], findings: Iterable[Finding]) -> Comparison:
    """Labels against findings, per repository and (path, cell, line, rule)."""
    found_keys = {(f.repo, *f.key) for f in findings}
    labelled_keys = set()
    result = Comparison()
    for label in labels:
        full = (label.repo, *label.key)
        labelled_keys.add(full)
        (result.found if full in found_keys else result.missed).append(label)
    seen: set[tuple[str, str, int, int, str]] = set()
    for f in findings:
        full = (f.repo, *f.key)
        if full not in labelled_keys and full not in seen:
            seen.add(full)
            result.false_reports.append(f)
    return result


def compile_errors(text: str, name: str) -> list[str]:
    """Why ``text`` does not compile: one message, or none (a notebook: per code cell)."""
    if name.endswith(".ipynb"):
        try:
            notebook = json.loads(text)
        except json.JSONDecodeError as err:
            return [f"not JSON: {err}"]
        errors = []
        cells = [c for c in notebook.get("cells", []) if c.get("cell_type") == "code"]
        for number, cell in enumerate(cells, 1):
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else source
            lines = ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.split("\n")]
            try:
                compile("\n".join(lines), f"{name}[cell {number}]", "exec")
            except SyntaxError as err:
                errors.append(f"cell {number} line {err.lineno}: {err.msg}")
        return errors
    try:
        compile(text, name, "exec")
    except SyntaxError as err:
        return [f"line {err.lineno}: {err.msg}"]
    return []


def check_fix(entries: Sequence[Mapping[str, Any]], corpus: Path, work: Path) -> FixCheck:
    """Runs ``--fix`` on a copy of each repository and compiles every file it changed."""
    check = FixCheck()
    for repo in copy_repos(entries, corpus, work):
        try:
            report, _ = run_migrate(work / repo, ["--fix"])
        except RuntimeError as err:
            check.errors.append(f"{repo}: {err}")
            continue
        check.remaining += len(report.get("findings", []))
        check.errors.extend(f"{repo}: {e['error']}" for e in report.get("errors", []))
    for e in entries:
        name = f"{e['repo']}/{e['path']}"
        before = (corpus / e["repo"] / e["path"]).read_text(encoding="utf-8")
        after = (work / e["repo"] / e["path"]).read_text(encoding="utf-8")
        if after == before:
            continue
        check.changed.append(name)
        if compile_errors(before, e["path"]):
            check.broken_before.append(name)
        errors = compile_errors(after, e["path"])
        if errors:
            check.not_compiling.append(f"{name}: {'; '.join(errors)}")
    return check


def render(
    comparison: Comparison,
    fix: FixCheck | None,
    unavailable: Sequence[tuple[Mapping[str, Any], str]],
    scan_errors: Sequence[str],
) -> str:
    """The human report: the per-rule table, each miss and false report, the fix check."""
    lines: list[str] = []
    for e, why in unavailable:
        lines.append(f"unavailable ({why}): {e['repo']}/{e['path']}")
    if unavailable:
        lines.append(f"{len(unavailable)} file(s) unavailable, not counted; --fetch gets them.\n")
    for err in scan_errors:
        lines.append(f"scan error: {err}")
    head = f"{'rule':<7} {'found':>6} {'labelled':>9} {'recall':>8} {'false reports':>14}"
    lines += [head, "-" * len(head)]
    for rule, (found, labelled, false) in comparison.per_rule().items():
        recall = f"{100 * found / labelled:.0f}%" if labelled else "-"
        lines.append(f"{rule:<7} {found:>6} {labelled:>9} {recall:>8} {false:>14}")
    lines.append("")

    def where(repo: str, path: str, cell: int, line: int) -> str:
        return f"{repo}/{path}:{f'cell {cell}:' if cell else ''}{line}"

    for m in comparison.missed:
        note = f"  [{m.note}]" if m.note else ""
        lines.append(f"missed {m.rule} {where(m.repo, m.path, m.cell, m.line)}: {m.code}{note}")
    for f in comparison.false_reports:
        lines.append(f"false report {f.rule} {where(f.repo, f.path, f.cell, f.line)}: {f.message}")
    outside = sum(1 for m in comparison.missed if m.note)
    if outside:
        lines.append(f"({outside} of the misses carry a note, e.g. an API the REMOVED table lacks)")
    if fix is not None:
        lines.append("")
        lines.append(
            f"--fix changed {len(fix.changed)} file(s); {fix.compiling} compile; "
            f"{fix.remaining} finding(s) remain after it"
        )
        for name in fix.not_compiling:
            lines.append(f"does not compile after --fix: {name}")
        for name in fix.broken_before:
            lines.append(f"(did not compile before --fix either: {name})")
        for err in fix.errors:
            lines.append(f"--fix error: {err}")
    return "\n".join(lines)


def summary_line(comparison: Comparison, fix: FixCheck | None) -> str:
    found, labelled = len(comparison.found), comparison.labelled
    fixed = f"{fix.compiling}/{len(fix.changed)}" if fix is not None else "-"
    return (
        f"recall: {found}/{labelled} = {100 * comparison.recall:.1f}%   "
        f"false reports: {len(comparison.false_reports)}   fixed files compiling: {fixed}"
    )


def numbers(
    comparison: Comparison, fix: FixCheck | None, available: int, unavailable: int
) -> dict[str, Any]:
    return {
        "files_available": available,
        "files_unavailable": unavailable,
        "found": len(comparison.found),
        "labelled": comparison.labelled,
        "recall": comparison.recall,
        "false_reports": len(comparison.false_reports),
        "per_rule": {
            rule: {"found": f, "labelled": n, "false_reports": x}
            for rule, (f, n, x) in comparison.per_rule().items()
        },
        "missed": [
            {"repo": m.repo, "path": m.path, "cell": m.cell, "line": m.line, "rule": m.rule}
            for m in comparison.missed
        ],
        "false": [
            {"repo": f.repo, "path": f.path, "cell": f.cell, "line": f.line, "rule": f.rule}
            for f in comparison.false_reports
        ],
        "fix": None
        if fix is None
        else {
            "changed": len(fix.changed),
            "compiling": fix.compiling,
            "remaining_findings": fix.remaining,
            "not_compiling": fix.not_compiling,
        },
    }


def measure(
    entries: Sequence[Mapping[str, Any]], corpus: Path, *, fix: bool = True
) -> tuple[Comparison, FixCheck | None, list[str]]:
    """Scans the available entries (one run per repository) and, with ``fix``, checks --fix."""
    findings: list[Finding] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="meshkit-corpus-") as tmp:
        scan_root = Path(tmp) / "scan"
        for repo in copy_repos(entries, corpus, scan_root):
            try:
                report, _ = run_migrate(scan_root / repo, ["--concise"])
            except RuntimeError as err:
                errors.append(f"{repo}: {err}")
                continue
            errors.extend(f"{repo}: {e['error']}" for e in report.get("errors", []))
            findings += findings_of(report, repo, scan_root / repo)
        checked = check_fix(entries, corpus, Path(tmp) / "fix") if fix else None
    return compare(labels_of(entries), findings), checked, errors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--corpus",
        type=Path,
        default=Path(os.environ.get("MESHKIT_CORPUS") or DEFAULT_CORPUS).expanduser(),
        help="the corpus directory, <owner>/<repo>/<path> (default: $MESHKIT_CORPUS, else "
        "~/.cache/meshkit/migrate-corpus)",
    )
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help=argparse.SUPPRESS)
    parser.add_argument(
        "--fetch", action="store_true", help="download missing files at their commits"
    )
    parser.add_argument("--no-fix", action="store_true", help="skip the --fix compile check")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the numbers as JSON")
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 below {RECALL_GOAL:.0%} recall, on a false report or a fixed file "
        "that does not compile",
    )
    args = parser.parse_args(argv)
    corpus: Path = args.corpus.expanduser()
    entries = load_manifest(args.manifest)["files"]
    if args.fetch:
        for problem in fetch_missing(entries, corpus):
            print(f"fetch: {problem}")
    available, unavailable = split_available(entries, corpus)
    if not available:
        print(
            f"No corpus file is available under {corpus} ({len(entries)} listed in "
            f"{args.manifest.name}); nothing measured. Put the files there as "
            "<owner>/<repo>/<path> (or set MESHKIT_CORPUS, or pass --corpus DIR), or run "
            "with --fetch where the network reaches raw.githubusercontent.com."
        )
        return 0
    comparison, fix, errors = measure(available, corpus, fix=not args.no_fix)
    print(render(comparison, fix, unavailable, errors))
    print(summary_line(comparison, fix))
    if args.json:
        args.json.write_text(
            json.dumps(numbers(comparison, fix, len(available), len(unavailable)), indent=2) + "\n"
        )
    failed = (
        comparison.recall < RECALL_GOAL
        or bool(comparison.false_reports)
        or (fix is not None and bool(fix.not_compiling))
    )
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
