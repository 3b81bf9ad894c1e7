"""benchmarks/migrate_corpus.json's schema, and migrate_recall.py's counting on a tiny corpus.

The real corpus is third-party code kept out of the repository; here a fake manifest and one
file written in tmp_path exercise the comparison: a label found, a label missed, a false report,
an unavailable file, and the --fix compile check.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest

from meshkit._src.migrate.rules import RULES

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import migrate_recall  # noqa: E402

HEX40 = re.compile(r"[0-9a-f]{40}")
HEX64 = re.compile(r"[0-9a-f]{64}")


def test_manifest_schema():
    manifest = migrate_recall.load_manifest()
    assert manifest["version"] == 1
    files = manifest["files"]
    assert files
    seen = set()
    for entry in files:
        assert set(entry) >= {"repo", "commit", "path", "sha256", "lines", "patterns"}, entry
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", entry["repo"]), entry["repo"]
        assert HEX40.fullmatch(entry["commit"]), entry
        assert HEX64.fullmatch(entry["sha256"]), entry
        assert entry["path"], entry
        assert not entry["path"].startswith("/"), entry
        assert isinstance(entry["lines"], int)
        assert entry["lines"] > 0
        key = (entry["repo"], entry["path"])
        assert key not in seen, f"listed twice: {key}"
        seen.add(key)
        notebook = entry["path"].endswith(".ipynb")
        for p in entry["patterns"]:
            assert p["rule"] in RULES, p
            assert isinstance(p["line"], int), p
            assert p["line"] >= 1, p
            assert isinstance(p["code"], str), p
            assert p["code"], p
            if notebook:
                assert isinstance(p["cell"], int), p
                assert p["cell"] >= 1, p
            else:
                assert "cell" not in p, p
            assert notebook or p["line"] <= entry["lines"], p
    assert len({e["repo"] for e in files}) >= 8


SOURCE = """\
import jax
import numpy as np

step = jax.pmap(lambda x: x * 2)
out = step(np.ones((8, 3)))
print(np.asarray(out))
"""


def _corpus(tmp_path: Path) -> tuple[Path, Path]:
    """A corpus with one file, and a manifest that labels a found, a missed line and a gap."""
    corpus = tmp_path / "corpus"
    file = corpus / "someone" / "proj" / "train.py"
    file.parent.mkdir(parents=True)
    file.write_text(SOURCE)
    manifest = {
        "version": 1,
        "files": [
            {
                "repo": "someone/proj",
                "commit": "0" * 40,
                "path": "train.py",
                "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
                "lines": 6,
                "patterns": [
                    {"line": 4, "rule": "MK001", "code": "jax.pmap(lambda x: x * 2)"},
                    {"line": 5, "rule": "MK010", "code": "invented, to be missed"},
                ],
            },
            {
                "repo": "someone/other",
                "commit": "1" * 40,
                "path": "absent.py",
                "sha256": "2" * 64,
                "lines": 1,
                "patterns": [{"line": 1, "rule": "MK001", "code": "jax.pmap"}],
            },
        ],
    }
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    return corpus, path


def test_compare_counts_found_missed_and_false_reports():
    labels = migrate_recall.labels_of(
        [
            {
                "repo": "a/b",
                "path": "t.py",
                "patterns": [
                    {"line": 4, "rule": "MK001", "code": "x"},
                    {"line": 2, "cell": 3, "rule": "MK010", "code": "y"},
                    {"line": 9, "rule": "MK012", "code": "z"},
                ],
            }
        ]
    )
    findings = [
        migrate_recall.Finding("a/b", "t.py", 0, 4, "MK001", "found"),
        migrate_recall.Finding("a/b", "t.py", 3, 2, "MK010", "found in a cell"),
        migrate_recall.Finding("a/b", "t.py", 0, 4, "MK010", "no such label"),
        migrate_recall.Finding("a/b", "t.py", 0, 4, "MK010", "the same twice"),
        migrate_recall.Finding("a/c", "t.py", 0, 9, "MK012", "another repository"),
    ]
    result = migrate_recall.compare(labels, findings)
    assert [(x.line, x.rule) for x in result.found] == [(4, "MK001"), (2, "MK010")]
    assert [(x.line, x.rule) for x in result.missed] == [(9, "MK012")]
    assert [(f.repo, f.line, f.rule) for f in result.false_reports] == [
        ("a/b", 4, "MK010"),
        ("a/c", 9, "MK012"),
    ]
    assert result.recall == pytest.approx(2 / 3)
    assert result.per_rule() == {
        "MK001": (1, 1, 0),
        "MK010": (1, 1, 1),
        "MK012": (0, 1, 1),
    }


def test_findings_take_the_cell_key_when_present(tmp_path: Path):
    report = {
        "findings": [
            {"path": str(tmp_path / "nb.ipynb"), "line": 2, "cell": 5, "code": "MK001"},
            {"path": str(tmp_path / "sub" / "m.py"), "line": 7, "code": "MK012"},
        ]
    }
    found = migrate_recall.findings_of(report, "o/r", tmp_path)
    assert [(f.path, f.cell, f.line, f.rule) for f in found] == [
        ("nb.ipynb", 5, 2, "MK001"),
        ("sub/m.py", 0, 7, "MK012"),
    ]


def test_compile_errors_of_python_and_notebook_cells():
    assert migrate_recall.compile_errors("x = 1\n", "a.py") == []
    assert migrate_recall.compile_errors("x = (\n", "a.py")
    notebook = {
        "cells": [
            {"cell_type": "markdown", "source": ["not ( code"]},
            {"cell_type": "code", "source": ["%matplotlib inline\n", "!pip install x\n", "y = 2"]},
            {"cell_type": "code", "source": "def f(:\n  pass"},
        ]
    }
    errors = migrate_recall.compile_errors(json.dumps(notebook), "n.ipynb")
    assert len(errors) == 1
    assert errors[0].startswith("cell 2 ")


def test_end_to_end_on_a_tiny_corpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    corpus, manifest = _corpus(tmp_path)
    out = tmp_path / "numbers.json"
    status = migrate_recall.main(
        ["--corpus", str(corpus), "--manifest", str(manifest), "--json", str(out), "--check"]
    )
    text = capsys.readouterr().out
    numbers = json.loads(out.read_text())
    assert numbers["files_available"] == 1
    assert numbers["files_unavailable"] == 1
    assert "unavailable (missing): someone/other/absent.py" in text
    # MK001 on line 4 is found; the invented MK010 on line 5 is missed.
    assert numbers["per_rule"]["MK001"]["found"] == 1
    assert {"repo": "someone/proj", "path": "train.py", "cell": 0, "line": 5, "rule": "MK010"} in (
        numbers["missed"]
    )
    assert numbers["labelled"] == 2
    # Whatever else the scanner reports (np.asarray(out) on line 6, unlabelled) is a false report.
    assert numbers["false_reports"] == len(numbers["false"])
    assert all(f["line"] != 4 or f["rule"] != "MK001" for f in numbers["false"])
    assert text.strip().splitlines()[-1].startswith("recall: ")
    assert status == 1  # --check: recall 50% < 95%
    assert numbers["fix"]["changed"] == numbers["fix"]["compiling"]


def test_no_corpus_is_not_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    status = migrate_recall.main(["--corpus", str(tmp_path / "none"), "--check"])
    assert status == 0
    assert "No corpus file is available" in capsys.readouterr().out


def test_fetch_fails_cleanly_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def refuse(*args: object, **kwargs: object) -> None:
        raise migrate_recall.urllib.error.URLError("no network here")

    monkeypatch.setattr(migrate_recall.urllib.request, "urlopen", refuse)
    _, manifest = _corpus(tmp_path)
    entries = migrate_recall.load_manifest(manifest)["files"]
    problems = migrate_recall.fetch_missing(entries, tmp_path / "empty")
    assert len(problems) == 2
    assert all("cannot fetch" in p for p in problems)
