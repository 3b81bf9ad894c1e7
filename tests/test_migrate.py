"""`meshkit migrate`: golden reports and fixes, exit codes, formats, and the facts the texts state.

Golden files live in tests/golden/migrate: `<case>.py` is the input; `<case>.<run>.txt` a
transcript (command, stdout, stderr, exit status) of one run on a copy of it; `<case>.fixed.py`
the file after --fix; `all_rules.diff` the output of --diff. Regenerate them with
MESHKIT_UPDATE_GOLDEN=1 and review the changes before committing them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshkit._src.migrate.command import EPILOG
from meshkit._src.migrate.rules import (
    COMMON_UTILS,
    DEVICE_PUT,
    FLAX_JAX_UTILS,
    PMAP_KEYWORDS,
    RULES,
)
from meshkit._src.migrate.scan import scan_source
from meshkit.cli import main

GOLDEN = Path(__file__).resolve().parent / "golden" / "migrate"
UPDATE = os.environ.get("MESHKIT_UPDATE_GOLDEN") == "1"
# Cases with a report run (concise unless named here) and, where something is fixable, a fix run.
CASES = [
    "all_rules",
    "aliases",
    "formatting",
    "nested",
    "loops",
    "host_reads",
    "not_fixable",
    "removed_apis",
    "clean",
    "entry_point",
    "wmt_tohost",
    "imagenet_out_axes",
    "jax_api",
]
FULL_REPORT = {"all_rules"}
FIXABLE = [case for case in CASES if case not in ("not_fixable", "clean")]


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["migrate", *args])
    return code, out.getvalue(), err.getvalue()


def transcript(args: list[str], code: int, out: str, err: str) -> str:
    text = f"$ meshkit migrate {' '.join(args)}\n{out}"
    if err:
        text += f"[stderr]\n{err}"
    return text + f"[exit {code}]\n"


def check_golden(name: str, actual: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_bytes(actual.encode("utf-8"))
    expected = path.read_bytes().decode("utf-8")
    assert actual == expected, f"{name} differs; MESHKIT_UPDATE_GOLDEN=1 rewrites it"


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A copy of the golden inputs as the working directory (runs see relative paths)."""
    for f in GOLDEN.glob("*.py"):
        if not f.name.endswith(".fixed.py"):
            shutil.copy(f, tmp_path / f.name)
    shutil.copytree(GOLDEN / "tree", tmp_path / "tree")
    shutil.copytree(GOLDEN / "flow", tmp_path / "flow")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---- golden reports and fixes -----------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_report_golden(work, case):
    args = ([] if case in FULL_REPORT else ["--concise"]) + [f"{case}.py"]
    code, out, err = run_cli(*args)
    check_golden(f"{case}.report.txt", transcript(args, code, out, err))
    assert code == (0 if case == "clean" else 1)
    before = (work / f"{case}.py").read_bytes()
    assert before == (GOLDEN / f"{case}.py").read_bytes()  # reporting writes nothing


@pytest.mark.parametrize("case", FIXABLE)
def test_fix_golden(work, case):
    args = ["--fix", "--concise", f"{case}.py"]
    code, out, err = run_cli(*args)
    check_golden(f"{case}.fix.txt", transcript(args, code, out, err))
    fixed = (work / f"{case}.py").read_text(encoding="utf-8")
    check_golden(f"{case}.fixed.py", fixed)
    compile(fixed, f"{case}.fixed.py", "exec")
    # A second --fix finds nothing more to do, and what remains is what the fix run reported.
    code2, out2, _ = run_cli("--fix", "--concise", f"{case}.py")
    assert (work / f"{case}.py").read_text(encoding="utf-8") == fixed
    assert code2 == code
    assert [ln for ln in out2.splitlines() if ": MK" in ln] == [
        ln for ln in out.splitlines() if ": MK" in ln
    ]


def test_host_reads_in_helpers_of_other_modules(work):
    """A pmap output passed to helpers of other files of the run: the reads are found there."""
    args = ["--concise", "flow"]
    code, out, err = run_cli(*args)
    check_golden("flow.report.txt", transcript(args, code, out, err))
    reads = sorted(ln.split(": MK010")[0] for ln in out.splitlines() if ": MK010 " in ln)
    assert reads == ["flow/checkpoints.py:8:32", "flow/utils.py:12:12", "flow/utils.py:8:12"]
    # One file alone: nothing tells utils.py that train.py passes it pmap outputs.
    code, out, _ = run_cli("--concise", "flow/utils.py")
    assert code == 0
    assert "MK010" not in out
    # Fixed, the reads become meshkit's, and the run is clean of them.
    args = ["--fix", "--concise", "flow"]
    code, out, err = run_cli(*args)
    check_golden("flow.fix.txt", transcript(args, code, out, err))
    for name in ("train", "utils", "checkpoints"):
        fixed = (work / "flow" / f"{name}.py").read_text(encoding="utf-8")
        check_golden(f"flow.{name}.fixed.py", fixed)
        compile(fixed, name, "exec")
    assert "meshkit.unreplicate(xs)" in (work / "flow" / "utils.py").read_text()


_SHADOWS = """\
import jax
from flax.jax_utils import replicate
from flax.training.common_utils import shard


def total(shards):
    t = 0
    for shard in shards:  # a loop variable named like the helper
        t += shard.shape[0]
    return t


def place(x, replicate=None):  # a parameter named like the helper
    return replicate(x) if replicate else x


class Trainer:
    shard = staticmethod(lambda b: b)  # a class attribute

    def step(self, batch):
        return self.shard(batch), shard(batch)  # the second is the helper: methods skip the class


def main(batch, state):
    state = replicate(state)
    return shard(batch), [shard for shard in (1, 2)], (lambda shard: shard)(3)
"""


def test_a_local_name_that_shadows_a_helper_is_neither_reported_nor_rewritten():
    from meshkit._src.migrate.fix import fix_source

    findings = scan_source(_SHADOWS)
    assert [(f.line, f.code) for f in findings] == [(21, "MK006"), (25, "MK005"), (26, "MK006")]
    fixed = fix_source(_SHADOWS, [f.edit for f in findings if f.edit])
    assert "for shard in shards:  # a loop" in fixed
    assert "t += shard.shape[0]" in fixed
    assert "return replicate(x) if replicate else x" in fixed
    assert "return self.shard(batch), meshkit.shard(batch)  # the second" in fixed
    assert "state = meshkit.replicate(state)" in fixed
    assert (
        "return meshkit.shard(batch), [shard for shard in (1, 2)], (lambda shard: shard)(3)"
        in fixed
    )
    compile(fixed, "shadows.py", "exec")


def test_every_removed_name_is_absent_and_every_replacement_present_on_this_jax():
    import importlib

    from meshkit._src.migrate.rules import REMOVED, REMOVED_MODULES

    def exists(name: str) -> bool:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
        return False

    assert [q for q in REMOVED if exists(q)] == []
    for module in REMOVED_MODULES:  # still an attribute, no longer a module
        assert exists(module)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(module)
    assert [new for new, _ in REMOVED.values() if new is not None and not exists(new)] == []


def test_every_rule_has_a_golden_finding():
    seen = set()
    for case in CASES:
        for line in (GOLDEN / f"{case}.report.txt").read_text().splitlines():
            parts = line.split(" ")
            if len(parts) > 1 and parts[0].startswith(f"{case}.py:"):
                seen.add(parts[1])
    assert seen == set(RULES)


def test_full_report_explains_every_finding(work):
    code, out, _ = run_cli("all_rules.py")
    lines = out.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("all_rules.py:")]
    for i in heads:
        code_ = lines[i].split(" ")[1]
        explanation = " ".join(
            ln.strip() for ln in lines[i + 1 : next((h for h in heads if h > i), len(lines) - 1)]
        )
        assert explanation.startswith("why: " + RULES[code_].why.split(" ")[0])
        assert "fix: " in explanation
        assert max(len(ln) for ln in lines[i + 1 : i + 3]) <= 100
    assert code == 1


def test_diff_golden_matches_the_fix(work):
    args = ["--diff", "all_rules.py"]
    code, out, err = run_cli(*args)
    check_golden("all_rules.diff", out)
    assert code == 1
    assert (work / "all_rules.py").read_bytes() == (GOLDEN / "all_rules.py").read_bytes()
    assert out.startswith("--- a/all_rules.py\n+++ b/all_rules.py\n")
    # The report goes to stderr, so the patch can be piped; it lists the original findings.
    assert "all_rules.py:18:20: MK001 jax.pmap in functools.partial [fixable]" in err
    assert "19 findings in 1 of 1 file (14 fixable with --fix)." in err
    # Every removed and added line of the patch is the fixed golden's change.
    fixed = (GOLDEN / "all_rules.fixed.py").read_text().splitlines()
    original = (GOLDEN / "all_rules.py").read_text().splitlines()
    added = [ln[1:] for ln in out.splitlines()[2:] if ln.startswith("+")]
    removed = [ln[1:] for ln in out.splitlines()[2:] if ln.startswith("-")]
    assert all(ln in fixed for ln in added)
    assert all(ln in original and ln not in fixed for ln in removed)


def test_diff_and_fix_together_write_and_print(work):
    code, out, err = run_cli("--diff", "--fix", "--concise", "aliases.py")
    assert out.startswith("--- a/aliases.py")
    assert "+import meshkit" in out
    assert (work / "aliases.py").read_text() == (GOLDEN / "aliases.fixed.py").read_text()
    assert "Fixed 11 of 11 findings in 1 file; 0 remain." in err
    assert code == 0


def test_diff_of_clean_file_is_empty(work):
    code, out, err = run_cli("--diff", "clean.py")
    assert (code, out) == (0, "")
    assert "No legacy pmap patterns in 1 file." in err


# ---- directories, errors, exit codes ----------------------------------------------------------


def test_directory_recursion_golden(work):
    args = ["--concise", "tree"]
    code, out, err = run_cli(*args)
    check_golden("tree.report.txt", transcript(args, code, out, err))
    assert "tree/a.py:3:5: MK001" in out
    assert "tree/sub/b.py:3:5: MK006" in out
    assert ".hidden" not in out
    assert "env/lib.py" not in out  # a virtual environment (pyvenv.cfg) is skipped
    assert "notes.txt" not in out
    assert code == 1


@pytest.mark.parametrize(
    ("patterns", "expected"),
    [
        (["sub"], ["tree/a.py:3:5:"]),  # a directory's name
        (["*/sub/b.py"], ["tree/a.py:3:5:"]),  # a path pattern
        (["a.py", "b.py"], []),  # file names
    ],
)
def test_exclude_skips_matching_files_and_directories(work, patterns, expected):
    args = ["--concise"] + [f"--exclude={p}" for p in patterns] + ["tree"]
    code, out, _ = run_cli(*args)
    assert [ln.split(" ")[0] for ln in out.splitlines() if ": MK" in ln] == expected
    assert code == (1 if expected else 0)


def test_stdin_is_read_and_fixed_as_a_filter(work):
    source = (GOLDEN / "aliases.py").read_bytes()
    fixed = subprocess.run(
        [sys.executable, "-m", "meshkit", "migrate", "--fix", "--concise", "-"],
        input=source, capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert fixed.stdout.decode() == (GOLDEN / "aliases.fixed.py").read_text(encoding="utf-8")
    assert "Fixed" in fixed.stderr.decode(), fixed.stderr
    report = subprocess.run(
        [sys.executable, "-m", "meshkit", "migrate", "--concise", "-"],
        input=source, capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert report.returncode == 1
    assert report.stdout.decode().startswith("<stdin>:"), report.stdout


def test_the_pre_commit_hooks_run_meshkit_migrate(work):
    hooks = (Path(__file__).resolve().parents[1] / ".pre-commit-hooks.yaml").read_text()
    entries = [
        ln.split(":", 1)[1].split() for ln in hooks.splitlines() if ln.startswith("  entry:")
    ]
    assert [e[:2] for e in entries] == [["meshkit", "migrate"]] * 2
    report, fix = entries  # pre-commit appends the staged files
    code, out, err = run_cli(*report[2:], "aliases.py")
    assert (code, err) == (1, "")
    assert out.startswith("aliases.py:")
    code, out, err = run_cli(*fix[2:], "aliases.py")
    assert (code, err, out) == (0, "", "Fixed 11 of 11 findings in 1 file; 0 remain.\n")


def test_sarif_format_carries_every_finding_rule_and_error(work):
    code, out, err = run_cli("--format", "sarif", "all_rules.py", "broken.py")
    _, as_json, _ = run_cli("--format", "json", "all_rules.py", "broken.py")
    assert (code, err) == (2, "")  # a file that does not parse: status 2, its error in the run
    doc = json.loads(out)
    assert doc["version"] == "2.1.0"
    (run,) = doc["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == list(RULES)
    assert rules[0]["fullDescription"]["text"] == RULES["MK001"].why
    expected = json.loads(as_json)["findings"]
    got = run["results"]
    assert len(got) == len(expected) == 19
    for result, finding in zip(got, expected, strict=True):
        region = result["locations"][0]["physicalLocation"]["region"]
        assert result["ruleId"] == finding["code"] == rules[result["ruleIndex"]]["id"]
        assert (region["startLine"], region["startColumn"]) == (finding["line"], finding["column"])
        assert result["message"]["text"].startswith(finding["message"])
        assert result["properties"]["fixable"] == finding["fixable"]
    (invocation,) = run["invocations"]
    assert invocation["executionSuccessful"] is False
    (note,) = invocation["toolExecutionNotifications"]
    assert note["message"]["text"].startswith("cannot parse: invalid syntax")
    where = note["locations"][0]["physicalLocation"]
    assert where["artifactLocation"]["uri"] == "broken.py"
    assert (where["region"]["startLine"], where["region"]["startColumn"]) == (4, 7)


def test_unparsable_file_is_reported_and_others_still_scanned(work):
    args = ["--concise", "broken.py", "tree/a.py"]
    code, out, err = run_cli(*args)
    check_golden("broken.report.txt", transcript(args, code, out, err))
    assert "broken.py:4:7: error: cannot parse: invalid syntax" in err
    assert "tree/a.py:3:5: MK001" in out
    assert code == 2


def test_fix_leaves_an_unparsable_file_alone(work):
    code, _, err = run_cli("--fix", "broken.py")
    assert code == 2
    assert "cannot parse" in err
    assert (work / "broken.py").read_bytes() == (GOLDEN / "broken.py").read_bytes()


def test_a_symlink_loop_is_an_error_of_its_own_and_the_rest_is_scanned(work):
    loop = work / "tree" / "loop"
    loop.mkdir()
    (loop / "a.py").symlink_to("b.py")
    (loop / "b.py").symlink_to("a.py")
    (loop / "up").symlink_to("..")  # a directory loop: links to directories are not followed
    code, out, err = run_cli("--concise", "tree")
    assert code == 2
    assert "tree/loop/a.py: error: cannot read: Too many levels of symbolic links" in err
    assert "tree/a.py:3:5: MK001" in out  # the other files were scanned
    assert "Traceback" not in err


def test_a_module_of_a_thousand_statements_is_rewritten(work):
    # libcst's import insertion recursed once per statement: RecursionError at ~1,000.
    body = "\n".join(f"x{i} = {i}" for i in range(3000))
    (work / "long.py").write_text(f'"""A long module."""\nimport jax\n\n{body}\nf = jax.pmap(g)\n')
    code, _, err = run_cli("--fix", "long.py")
    assert (code, err) == (0, "")
    text = (work / "long.py").read_text()
    assert text.endswith("x2999 = 2999\nf = meshkit.pmap_compat(g)\n")
    assert "import meshkit" in text
    compile(text, "long.py", "exec")


def test_many_compile_calls_scan_in_linear_time():
    # Each `.compile()` rescanned the file for a lowered pmap: 4,000 re.compile lines took 34 s.
    def timed(line: str) -> float:
        body = "\n".join(line.format(i=i) for i in range(4000))
        source = f"import jax\nimport re\n\n{body}\nstep = jax.pmap(f)\n"
        # This thread's CPU time: the wall time doubled beside a second copy of the suite.
        start = time.thread_time()
        assert [f.code for f in scan_source(source)] == ["MK001"]
        return time.thread_time() - start

    plain = timed("p{i} = 'a{i}'")
    assert timed("p{i} = re.compile('a{i}')") < 5 * plain + 1.0


def test_deep_expressions_and_long_flows_scan_and_fix(work):
    """ast and the flow analysis recurse with the nesting: a 3,000-term sum of a pmap output
    (RecursionError in ast.parse on the main thread: 2,500 terms parse on 3.11 and 3.12) and a
    value passed through 3,000 names."""
    terms = " + ".join(["y"] * 3000)
    (work / "sum.py").write_text(f"import jax\np = jax.pmap(f)\ny = p(1)\nz = {terms}\nz[0]\n")
    hops = "".join(f"y{i + 1} = y{i}\n" for i in range(3000))
    (work / "hops.py").write_text(f"import jax\np = jax.pmap(f)\ny0 = p(1)\n{hops}y3000[0]\n")
    code, out, err = run_cli("--concise", "sum.py", "hops.py")
    assert "hops.py:3004:1: MK010 host read of a pmap output `y3000[0]`" in out
    if sys.version_info >= (3, 12):
        # The parser's C recursion limit is fixed there: python3.12 sum.py fails to compile too.
        with pytest.raises(RecursionError):
            compile((work / "sum.py").read_text(), "sum.py", "exec")
        assert code == 2, out
        assert err == (
            f"sum.py: error: cannot scan: nested too deeply for Python 3.{sys.version_info[1]}'s "
            "parser, which cannot compile or run this file either (the file is unchanged)\n"
        )
    else:
        assert (code, err) == (1, ""), out
        assert "sum.py:5:1: MK010 host read of a pmap output `z[0]`" in out
    before = (work / "sum.py").read_text()
    code, out, _ = run_cli("--fix", "--concise", "sum.py", "hops.py")
    assert code == (2 if sys.version_info >= (3, 12) else 0), out
    assert (work / "hops.py").read_text().endswith("meshkit.unreplicate(y3000)\n")
    if sys.version_info >= (3, 12):
        assert (work / "sum.py").read_text() == before


def test_null_bytes_and_undecodable_files_are_errors(work):
    (work / "nul.py").write_bytes(b"import jax\x00\n")
    # Not UTF-8 and no coding line: tokenize refuses it in the first two lines, decode later.
    (work / "latin.py").write_bytes(b"x = '\xe9'\n")
    (work / "latin3.py").write_bytes(b"import jax\n\nx = '\xe9'\n")
    code, _, err = run_cli("nul.py", "latin.py", "latin3.py")
    assert code == 2
    assert "nul.py: error: cannot parse: source code string cannot contain null bytes" in err
    assert "latin.py: error: cannot parse: invalid or missing encoding declaration" in err
    assert "latin3.py: error: cannot decode: invalid continuation byte" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["clean.py"], 0),
        (["loops.py"], 1),
        (["clean.py", "loops.py"], 1),
        (["broken.py"], 2),
        (["missing.py"], 2),
        (["clean.py", "missing_dir/"], 2),
        (["--select", "MK404", "clean.py"], 2),
        (["--fix", "aliases.py"], 0),  # everything found was fixed
        (["--fix", "formatting.py"], 0),
        (["--fix", "loops.py"], 1),  # MK010 and MK011 remain
        (["--fix", "not_fixable.py"], 1),
        (["--select", "MK003,MK004", "loops.py"], 0),
        (["--ignore", "MK001,MK005,MK010,MK011", "loops.py"], 0),
    ],
)
def test_exit_codes(work, args, expected):
    code, _, _ = run_cli(*args)
    assert code == expected


def test_usage_errors_exit_2(work, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["migrate"])
    assert raised.value.code == 2
    assert "PATH" in capsys.readouterr().err
    code, _, err = run_cli("--ignore", "mk001,XX9", "clean.py")
    assert code == 2
    assert "--ignore: unknown rule code(s) XX9; the rules are MK001," in err


def test_missing_libcst_is_named(work, monkeypatch):
    monkeypatch.delitem(sys.modules, "meshkit._src.migrate.fix", raising=False)
    monkeypatch.setitem(sys.modules, "libcst", None)  # import libcst now raises ImportError
    for flag in ("--fix", "--diff"):
        code, out, err = run_cli(flag, "aliases.py")
        assert code == 2
        assert out == ""
        assert "pip install 'meshkit[migrate]'" in err
    # Reporting does not need it.
    code, out, _ = run_cli("--concise", "aliases.py")
    assert code == 1
    assert "MK001" in out
    assert (work / "aliases.py").read_bytes() == (GOLDEN / "aliases.py").read_bytes()


# ---- selection, suppression, formats ----------------------------------------------------------


def test_select_and_ignore(work):
    _, out, _ = run_cli("--concise", "--select", "MK003,mk004", "all_rules.py")
    codes = [ln.split(" ")[1] for ln in out.splitlines() if ln.startswith("all_rules.py:")]
    assert codes == ["MK003", "MK004"]
    _, out, _ = run_cli("--concise", "--ignore", "MK001", "all_rules.py")
    codes = {ln.split(" ")[1] for ln in out.splitlines() if ln.startswith("all_rules.py:")}
    # all_rules.py holds the pmap-era rules; JAX's 2025-26 API moves (MK013 on) are jax_api.py's.
    assert codes == {c for c in RULES if c <= "MK012"} - {"MK001"}


def test_fix_respects_select(work):
    code, _, _ = run_cli("--fix", "--select", "MK005", "aliases.py")
    text = (work / "aliases.py").read_text()
    assert "meshkit.replicate" in text
    assert "pmap(lambda x: x)" in text  # MK001 was not selected: jax.pmap stays
    assert code == 0  # nothing selected remains


def test_ignore_comments_silence_and_protect_lines():
    src = (
        "import jax\n"
        "a = jax.pmap(f)  # meshkit: ignore\n"
        "b = jax.pmap(f, out_axes=-1)  # meshkit: ignore[MK003]\n"
        "c = jax.pmap(f)  # meshkit:ignore[mk002, MK001]\n"
    )
    found = [(f.line, f.code) for f in scan_source(src)]
    assert found == [(3, "MK001")]


def test_json_format(work):
    code, out, err = run_cli("--format", "json", "loops.py", "broken.py")
    doc = json.loads(out)
    assert code == 2
    assert err == ""  # everything is in the document
    assert doc["version"] == 1
    assert doc["files"] == 1
    assert doc["errors"] == [
        {"path": "broken.py", "error": "broken.py:4:7: error: cannot parse: invalid syntax"}
    ]
    first = doc["findings"][0]
    assert first == {
        "path": "loops.py",
        "line": 7,
        "column": 10,
        "code": "MK001",
        "rule": "jax.pmap",
        "message": "jax.pmap call",
        "fixable": True,
        "note": "",
        "why": RULES["MK001"].why,
        "fix": RULES["MK001"].fix,
    }
    assert [f["code"] for f in doc["findings"]].count("MK010") == 6
    assert "fixed" not in doc
    assert "diff" not in doc


def test_json_format_with_fix_and_diff(work):
    code, out, _ = run_cli("--format", "json", "--fix", "--diff", "loops.py")
    doc = json.loads(out)
    assert doc["fixed"] == 10  # MK010's reads are all x[0] or tree_map(lambda a: a[0], x)
    assert {f["code"] for f in doc["findings"]} == {"MK011"}
    assert doc["diff"].startswith("--- a/loops.py\n")
    assert code == 1


# ---- file encodings and line endings ----------------------------------------------------------


def test_fix_keeps_crlf_line_endings(work):
    src = b"import jax\r\n\r\n# a comment\r\nstep = jax.pmap(f)  # keep\r\n"
    (work / "crlf.py").write_bytes(src)
    code, _, _ = run_cli("--fix", "crlf.py")
    assert code == 0
    assert (work / "crlf.py").read_bytes() == (
        b"import meshkit\r\n\r\n# a comment\r\nstep = meshkit.pmap_compat(f)  # keep\r\n"
    )


def test_fix_keeps_a_declared_encoding(work):
    src = "# -*- coding: latin-1 -*-\nimport jax\nname = 'café'; step = jax.pmap(f)\n"
    (work / "latin1.py").write_bytes(src.encode("latin-1"))
    code, out, _ = run_cli("--concise", "latin1.py")
    assert "latin1.py:3:23: MK001 jax.pmap call [fixable]" in out  # columns count characters
    code, _, _ = run_cli("--fix", "latin1.py")
    assert code == 0
    # The import adder leaves a blank line between the imports and the code.
    assert (work / "latin1.py").read_bytes() == (
        "# -*- coding: latin-1 -*-\nimport meshkit\n\nname = 'café'; step = meshkit.pmap_compat(f)\n"
    ).encode("latin-1")


def test_import_meshkit_is_not_added_twice_and_imports_in_use_stay():
    from meshkit._src.migrate.fix import fix_source

    src = (
        "import jax\n"
        "import meshkit\n"
        "from jax import pmap, jit\n"
        "x: 'jax.Array'\n"
        "step = pmap(jit(f))\n"
        "__all__ = ['pmap']\n"
    )
    edits = [f.edit for f in scan_source(src) if f.edit]
    assert fix_source(src, edits) == (
        "import jax\n"
        "import meshkit\n"
        "from jax import pmap, jit\n"
        "x: 'jax.Array'\n"
        "step = meshkit.pmap_compat(jit(f))\n"
        "__all__ = ['pmap']\n"
    )


def test_unused_legacy_imports_are_reported_and_dropped_without_adding_meshkit():
    from meshkit._src.migrate.fix import fix_source

    src = (
        "from jax import pmap, jit  # pmap is unused\n"
        "from jax import device_put_replicated\n"
        "from jax.sharding import PmapSharding\n"
        "x = jit(f)\n"
    )
    found = scan_source(src)
    assert [(f.line, f.code, f.message, f.fixable) for f in found] == [
        (1, "MK001", "unused import of jax.pmap", True),
        (2, "MK007", "unused import of jax.device_put_replicated", True),
        (3, "MK008", "import of jax.sharding.PmapSharding", False),
    ]
    new = fix_source(src, [f.edit for f in found if f.fixable and f.edit])
    assert new == (
        "from jax import jit  # pmap is unused\nfrom jax.sharding import PmapSharding\nx = jit(f)\n"
    )


def test_diff_of_an_absolute_path_has_no_git_prefix(work):
    path = str(work / "aliases.py")
    code, out, _ = run_cli("--diff", "--concise", path)
    assert out.startswith(f"--- {path}\n+++ {path}\n")
    assert code == 1


def test_dropping_the_only_statement_of_a_block_leaves_pass():
    from meshkit._src.migrate.fix import fix_source

    src = (
        "try:\n"
        "    # optional\n"
        "    from flax.jax_utils import replicate\n"
        "except ImportError:\n"
        "    pass\n"
        "x = replicate(1)\n"
    )
    edits = [f.edit for f in scan_source(src) if f.edit]
    new = fix_source(src, edits)
    assert new == (
        "import meshkit\n"
        "\n"
        "try:\n"
        "    # optional\n"
        "    pass\n"
        "except ImportError:\n"
        "    pass\n"
        "x = meshkit.replicate(1)\n"
    )
    compile(new, "x.py", "exec")


# ---- entry points ------------------------------------------------------------------------------


def test_python_dash_m_meshkit_migrate(work):
    env = {k: v for k, v in os.environ.items() if k != "MESHKIT_UPDATE_GOLDEN"}
    out = subprocess.run(
        [sys.executable, "-m", "meshkit", "migrate", "--concise", "loops.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=work,
        env=env,
    )
    expected = (GOLDEN / "loops.report.txt").read_text().split("\n", 1)[1]
    assert out.stdout == expected.split("[exit")[0]
    assert out.returncode == 1
    help_ = subprocess.run(
        [sys.executable, "-m", "meshkit", "--help"], capture_output=True, text=True, timeout=120
    )
    assert "migrate" in help_.stdout


def test_help_lists_rules_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["migrate", "--help"])
    text = capsys.readouterr().out
    for code, rule in RULES.items():
        assert f"  {code}  {rule.name}" in text
    assert "exit status: 0 nothing found" in text
    assert text.count("meshkit migrate ") >= 5  # the examples
    assert EPILOG.splitlines()[0] == "examples:"


def test_every_rule_is_listed_in_the_json_report_and_on_the_docs_page(work):
    _, out, _ = run_cli("--format", "json", "clean.py")
    assert [r["code"] for r in json.loads(out)["rules"]] == list(RULES)
    page = (Path(__file__).resolve().parent.parent / "docs" / "migrating-from-pmap.md").read_text()
    for code in RULES:
        assert f"| {code} |" in page  # the rules table
        assert f"#### {code} " in page or f", {code} " in page  # its section


# ---- the facts the rule texts state -------------------------------------------------------------


def test_stated_jax_facts_hold_for_the_installed_jax():
    import jax

    assert not hasattr(jax, "device_put_replicated")  # MK007
    assert not hasattr(jax, "device_put_sharded")
    with pytest.raises(ImportError):
        from jax.sharding import PmapSharding  # noqa: F401  # MK008
    with pytest.raises(AttributeError, match="Unrecognized config option"):
        jax.config.update("jax_pmap_shmap_merge", True)  # MK009


def test_pmap_keywords_are_jax_pmaps_and_pmap_compats():
    import inspect

    import jax

    import meshkit

    assert set(inspect.signature(jax.pmap).parameters) == PMAP_KEYWORDS
    assert set(inspect.signature(meshkit.pmap_compat).parameters) >= PMAP_KEYWORDS


@pytest.mark.parametrize("table", [FLAX_JAX_UTILS, COMMON_UTILS, DEVICE_PUT])
def test_rewritten_helpers_take_the_keywords_fix_allows(table):
    import inspect

    import meshkit

    missing = [name for name, _ in table.values() if not hasattr(meshkit, name)]
    if missing:
        pytest.skip(f"meshkit does not export {', '.join(missing)} yet")
    for name, keywords in table.values():
        params = inspect.signature(getattr(meshkit, name)).parameters
        assert keywords <= set(params), name
