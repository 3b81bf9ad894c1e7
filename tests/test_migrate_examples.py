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

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshkit
from meshkit.testing._forks import starter

_PRINTED = re.compile(r"(?:step \d+|eval|checkpoint|mean \|w\|)[: ][^[\n]*")
SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "legacy_pmap_script.py"


@pytest.fixture(scope="module")
def fixed(tmp_path_factory) -> Path:
    """The example, copied and fixed; what the fix left is checked here."""
    pytest.importorskip("libcst", reason="meshkit migrate --fix needs libcst (meshkit[migrate])")
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
        keep_output=True, starter=starter(None, "tests/test_migrate_examples.py"),
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


# ---- the rewrites give the legacy reads' numbers -----------------------------------------------

_DTYPES = st.sampled_from([np.float32, np.int32, np.bool_, np.float16])


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    dtype=_DTYPES,
    seed=st.integers(0, 2**16),
    tupled=st.booleans(),
)
def test_fixed_reads_equal_the_legacy_reads_of_jax_pmap_outputs(shape, dtype, seed, tupled):
    """MK010's rewrites, checked against the reads they replace on jax.pmap's own outputs.

    `x[0]` and `tree_map(lambda a: a[0], x)` of a jax.pmap output equal
    `meshkit.unreplicate(x)` of the pmap_compat output; `np.asarray(x)` and
    `jax.device_get(x)` equal `meshkit.local_from_global(x)` (values, dtype and shape).
    """
    n = jax.local_device_count()
    x = np.random.default_rng(seed).standard_normal((n, *shape)).astype(dtype)

    def f(a):
        return (a, {"b": a * 2 if dtype != np.bool_ else ~a}) if tupled else a

    legacy = jax.pmap(f)(x)
    fixed = meshkit.pmap_compat(f)(x)
    tree = legacy if tupled else (legacy,)
    new_tree = fixed if tupled else (fixed,)
    first = jax.tree_util.tree_map(lambda a: a[0], tree)
    read_whole = jax.device_get(tree)
    for old, new in (
        (first, meshkit.unreplicate(new_tree)),
        (read_whole, meshkit.local_from_global(new_tree)),
        (np.asarray(tree[0]), meshkit.local_from_global(new_tree[0])),
        (tree[0][0], meshkit.unreplicate(new_tree[0])),
    ):
        olds, news = jax.tree_util.tree_leaves(old), jax.tree_util.tree_leaves(new)
        assert len(olds) == len(news)
        for o, w in zip(olds, news, strict=True):
            o, w = np.asarray(o), np.asarray(w)
            assert (o.dtype, o.shape) == (w.dtype, w.shape)
            np.testing.assert_array_equal(o, w)
