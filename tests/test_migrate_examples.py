"""`meshkit migrate --fix` on a runnable legacy script: the fixed script prints the same lines.

examples/legacy_pmap_script.py is pmap-era code (jax.pmap, host reads of its outputs). It runs
as written with `jax.pmap`, then fixed by `meshkit migrate --fix` (meshkit.pmap_compat,
meshkit.unreplicate, meshkit.local_from_global), in one process with 8 CPU devices and in 2
processes x 4 under the launcher; each process prints the same lines before and after.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import meshkit

pytest.importorskip("libcst", reason="meshkit migrate --fix needs libcst (meshkit[migrate])")

_PRINTED = re.compile(r"(?:step \d+|eval|checkpoint|mean \|w\|)[: ][^[\n]*")
SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "legacy_pmap_script.py"


@pytest.fixture(scope="module")
def fixed(tmp_path_factory) -> Path:
    """The example, copied and fixed; what the fix left is checked here."""
    path = tmp_path_factory.mktemp("migrated") / SCRIPT.name
    shutil.copy(SCRIPT, path)
    done = subprocess.run(
        [sys.executable, "-m", "meshkit", "migrate", "--fix", "--concise", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr  # one read needs a person
    remaining = [ln for ln in done.stdout.splitlines() if ": MK" in ln]
    assert len(remaining) == 1, done.stdout
    assert (
        "MK010 host read of a pmap output `float(abs(state['params']['w']).mean())`"
        in (remaining[0])
    )
    assert "Fixed 6 of 7 findings" in done.stdout
    text = path.read_text()
    assert "jax.pmap(" not in text
    assert "partial(jax.pmap" not in text
    assert text.count("meshkit.unreplicate(") == 2
    assert text.count("meshkit.local_from_global(") == 2
    return path


def _alone(script: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_fixed_example_prints_the_same_lines_in_one_process(fixed):
    before = _alone(SCRIPT)
    assert len(before) == 6
    assert before[3] == "eval: 95/96 correct on this process's rows"  # it trains
    assert _alone(fixed) == before


def _launched(script: Path) -> list[list[str]]:
    result = meshkit.launch(
        [str(script)], num_processes=2, devices_per_process=4, timeout=240, stream=False,
        keep_output=True,
    )  # fmt: skip
    assert result.returncode == 0, [r.tail for r in result.ranks]
    # gloo's C++ code prints connection counts to the same stdout (a count that varies, and
    # not always on a line of its own): keep the script's lines
    return [_PRINTED.findall(r.stdout) for r in result.ranks]


@pytest.mark.multiprocess
def test_fixed_example_prints_the_same_lines_in_two_processes(fixed):
    before = _launched(SCRIPT)
    assert [len(lines) for lines in before] == [6, 6]
    assert before[0] != before[1]  # each process's own rows and devices
    assert _launched(fixed) == before
