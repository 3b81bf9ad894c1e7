"""Legacy pmap training programs, as users have them, through meshkit in 1 and 2 processes.

tests/legacy/ holds two programs written the way flax's imagenet and wmt examples are (a
`TrainState`, `jax_utils.replicate`, `common_utils.shard`, `get_metrics`, `prefetch_to_device`,
`pmap(partial(train_step, ...))`, ``out_axes=(None, 0)``, `pad_shard_unpad`, a `tohost` helper,
``static_broadcasted_argnums``). Each runs as written with plain `jax.pmap` in one process of 8
CPU devices: the reference. Then in two forms, each in 1 process x 8 devices and 2 processes x 4:

- drop-in: `jax.pmap` replaced by `meshkit.pmap_compat` and flax's helpers by meshkit's, with
  `meshkit.init()` first, as a user does by hand;
- migrated: the program as `meshkit migrate --fix` leaves it.

The training metrics equal the reference's to 1e-6, and the processes' predictions, put
together, equal the reference's (the global batch is the same in every run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import require, run_python

import meshkit
from meshkit.testing._forks import starter

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

LEGACY = Path(__file__).resolve().parent / "legacy"
PROGRAMS = ("classifier_pmap.py", "translate_pmap.py")
_PRELOAD = ("flax.linen", "optax")

# What a user replaces by hand to move a pmap program onto meshkit.
_DROP_IN = (
    ("jax.pmap(", "meshkit.pmap_compat("),
    ("jax_utils.replicate(", "meshkit.replicate("),
    ("jax_utils.unreplicate(", "meshkit.unreplicate("),
    ("jax_utils.prefetch_to_device(", "meshkit.prefetch_to_device("),
    ("jax_utils.pad_shard_unpad(", "meshkit.pad_shard_unpad("),
    ("common_utils.shard(", "meshkit.shard("),
    ("common_utils.get_metrics(", "meshkit.get_metrics("),
)


@pytest.fixture(autouse=True)
def _ecosystem():
    require("flax", "the legacy programs are flax programs")
    require("optax", "the legacy programs train with optax")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    env.update(extra)
    return env


def _metrics(stdout: str) -> dict:
    lines = [ln[ln.index("METRICS ") + 8 :] for ln in stdout.splitlines() if "METRICS " in ln]
    assert len(lines) == 1, stdout[-2000:]
    return json.loads(lines[0])


def _alone(script: Path, **env: str) -> list[dict]:
    done = run_python([str(script)], _env(**env), cwd=script.parent, timeout=240, preload=_PRELOAD)
    assert done.returncode == 0, done.stderr[-4000:]
    return [_metrics(done.stdout)]


def _launched(script: Path, **env: str) -> list[dict]:
    result = meshkit.launch(
        [str(script)], num_processes=2, devices_per_process=4, timeout=240, stream=False,
        keep_output=True, env=_env(**env),
        starter=starter(None, "tests/test_legacy_programs.py", preload=_PRELOAD),
    )  # fmt: skip
    assert result.returncode == 0, [r.tail for r in result.ranks]
    return [_metrics(r.stdout) for r in result.ranks]


def _drop_in(name: str, where: Path) -> Path:
    text = (LEGACY / name).read_text()
    for old, new in _DROP_IN:
        assert old in text or old.startswith(("jax_utils.p", "jax_utils.u")), old
        text = text.replace(old, new)
    first_import = text.index("\nimport ")
    text = text[:first_import] + "\nimport meshkit\n\nmeshkit.init()\n" + text[first_import:]
    path = where / name
    path.write_text(text)
    return path


def _migrated(name: str, where: Path) -> Path:
    path = where / name
    shutil.copy(LEGACY / name, path)
    done = subprocess.run(
        [sys.executable, "-m", "meshkit", "migrate", "--fix", "--concise", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = path.read_text()
    assert "jax.pmap(" not in text, done.stdout + text
    assert "meshkit.init()" in text, done.stdout
    if name == "translate_pmap.py":  # its tohost reads pmap outputs and numpy batches alike
        assert "return meshkit.local_from_global(x).reshape(" in text, done.stdout + text
    return path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[int, dict[str, str]]:
    """JAX compilation caches for the module's runs, by process count (one and two).

    Both forms of a program trace to the same computations as each other (the cache's key
    leaves out source locations), so the second form reads what the first compiled: about 3
    CPU-s a process. A cache for each process count keeps the one-process executables apart
    from the two-process ones. Only process 0 writes; a process that reads an entry while it
    is being written gets JAX's warning and compiles, as without a cache.
    """
    return {
        n: {
            "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp(f"jax-cache-{n}")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        }
        for n in (1, 2)
    }


@pytest.fixture(scope="module")
def references(compiled) -> dict[str, dict]:
    # Plain jax.pmap's computations differ from pmap_compat's: none is read back.
    return {
        name: _alone(LEGACY / name, LEGACY_CPU_DEVICES="8", **compiled[1])[0] for name in PROGRAMS
    }


def _same_run(runs: list[dict], reference: dict) -> None:
    """``runs``: every process's report, in process order."""
    for run in runs:
        got, want = run["train"], reference["train"]
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
    for key in ("predictions", "predicted"):
        if key in reference:
            together = [row for run in runs for row in run[key]]
            assert together == reference[key], key
    if "logits_sum" in reference:
        total = sum(run["logits_sum"] for run in runs)
        np.testing.assert_allclose(total, reference["logits_sum"], rtol=1e-5)
    for field in ("final_step", "step"):
        if field in reference:
            assert {run[field] for run in runs} == {reference[field]}


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("form", ["drop-in", "migrated"])
def test_legacy_program_equals_plain_jax_pmap_in_one_and_two_processes(
    name, form, references, compiled, tmp_path
):
    if form == "migrated":
        pytest.importorskip("libcst", reason="meshkit migrate --fix needs libcst")
        script = _migrated(name, tmp_path)
    else:
        script = _drop_in(name, tmp_path)
    _same_run(_alone(script, MESHKIT_CPU_DEVICES="8", **compiled[1]), references[name])
    _same_run(_launched(script, **compiled[2]), references[name])
