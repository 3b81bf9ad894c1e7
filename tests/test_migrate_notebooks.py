"""`meshkit migrate` on Jupyter notebooks: code cells scanned as one module, fixed in place.

Notebooks are written here as nbformat writes them (`json.dumps(indent=1, sort_keys=True,
ensure_ascii=False)` and a newline), so a fixed file can be compared whole with what nbformat
would write for the expected cells.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from meshkit._src.migrate.notebook import NotebookError, load_notebook
from meshkit.cli import main


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["migrate", *args])
    return code, out.getvalue(), err.getvalue()


def lines(text: str) -> list[str]:
    """A cell's source as nbformat stores it."""
    return text.splitlines(keepends=True)


def code_cell(text: str, outputs: list[Any] | None = None, count: int | None = None) -> dict:
    return {
        "cell_type": "code",
        "execution_count": count,
        "metadata": {},
        "outputs": outputs or [],
        "source": lines(text),
    }


def markdown(text: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": lines(text)}


def notebook(*cells: dict) -> dict:
    return {
        "cells": list(cells),
        "metadata": {"kernelspec": {"display_name": "Python 3", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def nbformat_text(doc: dict) -> str:
    return json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def write(path: Path, doc: dict) -> Path:
    path.write_text(nbformat_text(doc), encoding="utf-8")
    return path


STREAM = {"name": "stdout", "output_type": "stream", "text": ["loss 0.25 — ok\n"]}

TRAIN = notebook(
    markdown("# Training, the pmap way — ünïcode kept\n"),
    code_cell("!pip install meshkit\nimport jax\nimport numpy as np\nfrom flax import jax_utils"),
    code_cell("inner = jax.pmap(lambda x: x * 2, axis_name='j')\n%time inner(1)", [STREAM], 2),
    markdown("Below: a pmap of the pmapped function above, two cells apart."),
    code_cell("print('no legacy code here')", [STREAM], 3),
    code_cell(
        "outer = jax.pmap(inner, axis_name='i')\n"
        "state = jax_utils.replicate({'w': np.ones(2)})\n"
        "compiled = outer.lower(1).compile()"
    ),
)
TRAIN_REPORT = [
    "train.ipynb:cell 2:1:9: MK001 jax.pmap call [fixable]",
    "train.ipynb:cell 4:1:9: MK001 jax.pmap call [fixable]",
    "train.ipynb:cell 4:1:18: MK002 nested pmap: pmap of a pmapped function [fixable]",
    "train.ipynb:cell 4:2:9: MK005 flax.jax_utils.replicate call (written `jax_utils.replicate`) "
    "[fixable]",
    "train.ipynb:cell 4:3:12: MK011 `outer.lower(...).compile()` of a pmapped function",
    "5 findings in 1 of 1 file (4 fixable with --fix).",
]
TRAIN_FIXED = [
    "!pip install meshkit\nimport meshkit\nimport numpy as np",
    "inner = meshkit.pmap_compat(lambda x: x * 2, axis_name='j')\n%time inner(1)",
    "print('no legacy code here')",
    "outer = meshkit.pmap_compat(inner, axis_name='i')\n"
    "state = meshkit.replicate({'w': np.ones(2)})\n"
    "compiled = outer.lower(1).compile()",
]


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "train.ipynb", TRAIN)
    return tmp_path


def with_sources(doc: dict, sources: list[str]) -> dict:
    """The notebook with its code cells' sources replaced, as nbformat would store them."""
    cells = [dict(c) for c in doc["cells"]]
    code = [c for c in cells if c["cell_type"] == "code"]
    for cell, source in zip(code, sources, strict=True):
        cell["source"] = lines(source)
    return {**doc, "cells": cells}


# ---- reports ----------------------------------------------------------------------------------


def test_a_notebook_is_scanned_by_code_cell_across_cells(work):
    code, out, err = run_cli("--concise", "train.ipynb")
    # MK002 and MK011 need the pmap of cell 2: the cells are analysed as one module.
    assert out.splitlines() == TRAIN_REPORT
    assert (code, err) == (1, "")
    assert (work / "train.ipynb").read_text(encoding="utf-8") == nbformat_text(TRAIN)


def test_a_directory_of_notebooks_skips_checkpoints(work):
    (work / "nbs" / ".ipynb_checkpoints").mkdir(parents=True)
    write(work / "nbs" / "train.ipynb", TRAIN)
    write(work / "nbs" / ".ipynb_checkpoints" / "train-checkpoint.ipynb", TRAIN)
    (work / "nbs" / "helper.py").write_text("import jax\nstep = jax.pmap(f)\n")
    code, out, _ = run_cli("--concise", "nbs")
    assert [ln.split(" ")[0] for ln in out.splitlines() if ": MK" in ln] == [
        "nbs/helper.py:2:8:",
        *["nbs/train.ipynb:cell"] * 5,
    ]
    assert out.endswith("6 findings in 2 of 2 files (5 fixable with --fix).\n")
    assert code == 1


def test_json_and_sarif_name_the_cell_and_the_line_in_it(work):
    _, out, _ = run_cli("--format", "json", "train.ipynb")
    found = json.loads(out)["findings"]
    assert [(f["path"], f["cell"], f["line"], f["column"], f["code"]) for f in found] == [
        ("train.ipynb", 2, 1, 9, "MK001"),
        ("train.ipynb", 4, 1, 9, "MK001"),
        ("train.ipynb", 4, 1, 18, "MK002"),
        ("train.ipynb", 4, 2, 9, "MK005"),
        ("train.ipynb", 4, 3, 12, "MK011"),
    ]
    assert list(found[0])[:3] == ["path", "cell", "line"]
    _, out, _ = run_cli("--format", "sarif", "train.ipynb")
    (run,) = json.loads(out)["runs"]
    got = [
        (
            r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
            r["properties"]["cell"],
            r["locations"][0]["physicalLocation"]["region"]["startLine"],
            r["ruleId"],
        )
        for r in run["results"]
    ]
    assert got == [(f["path"], f["cell"], f["line"], f["code"]) for f in found]


def test_a_python_file_has_no_cell_key(work):
    (work / "a.py").write_text("import jax\nstep = jax.pmap(f)\n")
    _, out, _ = run_cli("--format", "json", "a.py")
    assert "cell" not in json.loads(out)["findings"][0]
    _, out, _ = run_cli("--format", "sarif", "a.py")
    assert json.loads(out)["runs"][0]["results"][0]["properties"] == {"fixable": True}


# ---- --fix and --diff -------------------------------------------------------------------------


def test_fix_rewrites_the_cells_in_place_and_nothing_else(work):
    code, out, err = run_cli("--fix", "--concise", "train.ipynb")
    assert out.splitlines() == [
        "train.ipynb:cell 4:3:12: MK011 `outer.lower(...).compile()` of a pmapped function",
        "Fixed 4 of 5 findings in 1 file; 1 remains.",
    ]
    assert (code, err) == (1, "")
    text = (work / "train.ipynb").read_text(encoding="utf-8")
    # Byte for byte what nbformat writes for the new cells: the markdown, the outputs, the
    # metadata and the unchanged cell 3 are as they were; ü stays ü.
    assert text == nbformat_text(with_sources(TRAIN, TRAIN_FIXED))
    doc = json.loads(text)
    assert doc["cells"][2]["outputs"] == [STREAM]
    assert doc["cells"][2]["execution_count"] == 2
    assert doc["cells"][1]["source"] == [
        "!pip install meshkit\n",
        "import meshkit\n",
        "import numpy as np",
    ]
    # A second run finds nothing more to fix.
    code, out, _ = run_cli("--fix", "--concise", "train.ipynb")
    assert (work / "train.ipynb").read_text(encoding="utf-8") == text
    assert out.splitlines()[-1] == "Fixed 0 of 1 finding in 1 file; 1 remains."


def test_fix_keeps_the_files_own_json_layout(work):
    # Two-space indentation, keys not sorted, a source as one string, ASCII escapes, no final
    # newline: as another tool may write a notebook.
    doc = {
        "nbformat": 4,
        "nbformat_minor": 2,
        "metadata": {"title": "caf\u00e9"},
        "cells": [
            {"source": "import jax\nstep = jax.pmap(f)", "cell_type": "code", "outputs": [],
             "metadata": {}, "execution_count": None},
            {"source": ["x = jax.jit(f)"], "cell_type": "code", "outputs": [], "metadata": {},
             "execution_count": None},
        ],
    }  # fmt: skip
    (work / "other.ipynb").write_text(json.dumps(doc, indent=2))
    code, _, err = run_cli("--fix", "other.ipynb")
    assert (code, err) == (0, "")
    doc["cells"][0]["source"] = "import jax\nimport meshkit\n\nstep = meshkit.pmap_compat(f)"
    assert (work / "other.ipynb").read_text() == json.dumps(doc, indent=2)


def test_diff_shows_each_changed_cells_code(work):
    code, out, err = run_cli("--diff", "--concise", "train.ipynb")
    assert code == 1
    assert "5 findings in 1 of 1 file (4 fixable with --fix)." in err
    assert out.startswith(
        "--- a/train.ipynb:cell 1\n"
        "+++ b/train.ipynb:cell 1\n"
        "@@ -1,4 +1,3 @@\n"
        " !pip install meshkit\n"
        "-import jax\n"
        "-import numpy as np\n"
        "-from flax import jax_utils\n"
        "\\ No newline at end of file\n"
        "+import meshkit\n"
        "+import numpy as np\n"
        "\\ No newline at end of file\n"
        "--- a/train.ipynb:cell 2\n"
        "+++ b/train.ipynb:cell 2\n"
    )
    assert "train.ipynb:cell 3" not in out  # unchanged
    assert "--- a/train.ipynb:cell 4\n" in out
    assert '"cells"' not in out  # the code, not the JSON
    assert (work / "train.ipynb").read_text(encoding="utf-8") == nbformat_text(TRAIN)


# ---- IPython syntax ---------------------------------------------------------------------------

MAGICS = notebook(
    code_cell("%matplotlib inline\n%env JAX_PLATFORMS=cpu\nimport jax\nfrom jax import pmap"),
    code_cell("files = !ls\n!echo $files \\\n  more\njax.pmap?\n?jax.pmap\n"),
    code_cell(
        "def bench(x):\n"
        "    %timeit pmap(g)(x)\n"
        "    return x\n"
        "step = pmap(lambda x: x)\n"
        "s = '''\n%not a magic inside a string\n!nor this?\n'''\n"
        "total = (10\n"
        "         % 3)  # an operator on a continued line, not a magic\n"
        "step = jax.pmap(step)"
    ),
    code_cell("%%bash\nfor i in 1 2; do\n    echo $i\ndone"),
    code_cell("%%time\nstep = jax.pmap(lambda x: x)"),
)


def test_magics_and_shell_lines_do_not_break_parsing_and_come_back(work):
    write(work / "magics.ipynb", MAGICS)
    code, out, err = run_cli("--concise", "magics.ipynb")
    assert (code, err) == (1, "")
    assert [ln.split(" ", 2)[:2] for ln in out.splitlines() if ": MK" in ln] == [
        ["magics.ipynb:cell", "3:4:8:"],  # step = pmap(lambda x: x)
        ["magics.ipynb:cell", "3:11:8:"],  # step = jax.pmap(step)
        ["magics.ipynb:cell", "3:11:17:"],  # nested: a pmap of a pmapped function
    ]
    code, out, err = run_cli("--fix", "--concise", "magics.ipynb")
    assert (code, err) == (0, "")
    sources = [
        "".join(c["source"]) for c in json.loads((work / "magics.ipynb").read_text())["cells"]
    ]
    original = ["".join(c["source"]) for c in MAGICS["cells"]]
    # After the %env line, not above it; `from jax import pmap` stays: %timeit uses pmap (and
    # is not reported unused). A shell line that installs nothing is no barrier.
    assert sources[0] == (
        "%matplotlib inline\n%env JAX_PLATFORMS=cpu\nimport jax\nfrom jax import pmap\n"
        "import meshkit"
    )
    assert sources[1] == original[1]
    assert sources[2] == original[2].replace(
        "step = pmap(lambda", "step = meshkit.pmap_compat(lambda"
    ).replace("step = jax.pmap(step)", "step = meshkit.pmap_compat(step)")
    assert "    %timeit pmap(g)(x)\n" in sources[2]
    assert sources[3:] == original[3:]  # cell magics: not Python, not scanned


def test_the_first_code_cell_gets_the_import_after_a_pip_install(work):
    doc = notebook(
        code_cell("!pip install -q 'meshkit[migrate]'"),
        code_cell("from flax.jax_utils import replicate\nstate = replicate({})"),
    )
    write(work / "pip.ipynb", doc)
    code, _, err = run_cli("--fix", "pip.ipynb")
    assert (code, err) == (0, "")
    sources = ["".join(c["source"]) for c in json.loads((work / "pip.ipynb").read_text())["cells"]]
    assert sources == [
        "!pip install -q 'meshkit[migrate]'\n\nimport meshkit",
        "state = meshkit.replicate({})",
    ]


# ---- errors -----------------------------------------------------------------------------------


def test_files_that_are_not_notebooks_are_errors_and_others_are_processed(work):
    (work / "bad.ipynb").write_text('{"cells": [')
    (work / "old.ipynb").write_text(json.dumps({"cells": [], "nbformat": 3}))
    (work / "list.ipynb").write_text("[1, 2]")
    (work / "latin.ipynb").write_bytes(b'{"cells": "\xe9"}')
    write(work / "numbers.ipynb", {**notebook(), "cells": [{"cell_type": "code", "source": 3}]})
    code, out, err = run_cli("--concise", "bad.ipynb", "old.ipynb", "list.ipynb", "latin.ipynb",
                             "numbers.ipynb", "train.ipynb")  # fmt: skip
    assert code == 2
    assert err.splitlines() == [
        "bad.ipynb: error: cannot read notebook: not JSON (Expecting value at line 1 column 12)",
        "old.ipynb: error: cannot read notebook: nbformat 3; meshkit migrate reads nbformat 4",
        "list.ipynb: error: cannot read notebook: not a Jupyter notebook (no list of cells)",
        "latin.ipynb: error: cannot read notebook: not UTF-8 (invalid continuation byte)",
        "numbers.ipynb: error: cannot read notebook: code cell 1 has no text as its source",
    ]
    assert out.splitlines()[:-2] == TRAIN_REPORT[:-1]
    assert out.splitlines()[-1] == "5 paths not scanned (errors on stderr)."


def test_a_cell_that_does_not_parse_is_named(work):
    write(work / "broken.ipynb", notebook(code_cell("import jax"), code_cell("x = 1\ndef f(:\n")))
    code, _, err = run_cli("--fix", "broken.ipynb", "train.ipynb")
    assert code == 2
    assert err == "broken.ipynb:cell 2:2:7: error: cannot parse: invalid syntax\n"
    assert (
        json.loads((work / "train.ipynb").read_text())["cells"][1]["source"][1]
        == "import meshkit\n"
    )
    _, out, _ = run_cli("--format", "sarif", "broken.ipynb")
    (note,) = json.loads(out)["runs"][0]["invocations"][0]["toolExecutionNotifications"]
    assert note["properties"] == {"cell": 2}
    assert note["locations"][0]["physicalLocation"]["region"] == {"startLine": 2, "startColumn": 7}


def test_stdin_stays_python(work, monkeypatch):
    # A notebook's JSON on stdin is read as Python: a dict display, with nothing to report.
    raw = (work / "train.ipynb").read_bytes()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(raw)))
    code, out, _ = run_cli("--concise", "-")
    assert (code, out) == (0, "No legacy pmap patterns in 1 file.\n")


# ---- the notebook module ----------------------------------------------------------------------


def test_load_notebook_errors_say_why():
    with pytest.raises(NotebookError, match=r"^not JSON \(Expecting value at line 1 column 1\)$"):
        load_notebook(b"")
    with pytest.raises(NotebookError, match=r"^nbformat None; meshkit migrate reads nbformat 4$"):
        load_notebook(b'{"cells": []}')


def test_split_refuses_text_that_lost_a_cell_or_a_magic():
    code = load_notebook(nbformat_text(MAGICS).encode()).module()
    assert code.split(code.text) == ["".join(c["source"]) for c in MAGICS["cells"]]
    with pytest.raises(
        NotebookError, match=r"^the rewritten code lost a cell boundary or an IPython line$"
    ):
        code.split(code.text.replace("# <<meshkit migrate: code cell 5>>\n", ""))
    with pytest.raises(NotebookError, match=r"^the rewritten code lost the order of its cells$"):
        code.split(code.text.replace("# <<meshkit migrate: code cell 3>>\n", ""))
    with pytest.raises(
        NotebookError, match=r"^the rewritten code lost a cell boundary or an IPython line$"
    ):
        code.split(code.text.replace("pass  # meshkit migrate: IPython line 1", "x = 1"))
    with pytest.raises(NotebookError, match=r"^the rewritten code changed an IPython line$"):
        code.split(code.text.replace("IPython line 1\n", "IPython line 99\n"))


def test_the_line_map_points_into_cells():
    code = load_notebook(nbformat_text(TRAIN).encode()).module()
    assert [code.locate(n) for n in range(1, 8)] == [
        (1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 1), (2, 2),
    ]  # fmt: skip  # the boundary line in front of cell 2 counts as its first line
