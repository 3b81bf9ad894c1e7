"""Exact resume, end to end: `examples/preemptible_training.py` (flax nnx + optax, grain through
`meshkit.global_batches`) interrupted, then started again, ends as the uninterrupted run.

- a preemption notice (SIGTERM) to process 1 after step 6: every process saves at one step and
  ends with 143; started again on 2 processes x 4 devices the run ends with the uninterrupted
  run's loss and parameters, bit for bit, and on 1 process x 8 devices and 4 processes x 2
  devices within 1e-6 relative;
- a crash (process 1 killed with SIGKILL after step 6) under ``--max-restarts 1``: the group
  starts again from the last periodic checkpoint, and ends bit for bit as the uninterrupted run.

The SLURM case (a job preempted with ``scancel --signal=TERM`` and submitted again) is in
`tests/test_slurm.py`, with the cluster it needs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLES, said
from ranks.preloads import ECOSYSTEM

import meshkit
from meshkit.testing._forks import starter

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]

PROGRAM = EXAMPLES / "preemptible_training.py"
_LIMIT_S = 240


def _launch(
    root: Path, *args: str, n: int = 2, d: int = 4, max_restarts: int = 0
) -> meshkit.LaunchResult:
    return meshkit.launch(
        [str(PROGRAM), "train", str(root), *args], num_processes=n, devices_per_process=d,
        platform="cpu", timeout=_LIMIT_S, stream=False, keep_output=True,
        max_restarts=max_restarts, starter=starter(None, "tests/test_resume.py", ECOSYSTEM),
    )  # fmt: skip


def _final(result: meshkit.LaunchResult) -> str:
    lines = said(result.ranks[0].stdout, "FINAL ")
    assert len(lines) == 1, result.report
    return lines[0]


def _params(npz: Path) -> list[np.ndarray]:
    with np.load(npz) as saved:
        return [saved[k] for k in sorted(saved.files, key=lambda k: int(k.split("_")[1]))]


@pytest.fixture(scope="module")
def uninterrupted(preemptible_reference) -> tuple[str, list[np.ndarray]]:
    """The uninterrupted run, 2 processes x 4 CPU devices: its FINAL line and parameters
    (conftest's, shared with test_slurm)."""
    final, npz = preemptible_reference
    return final, _params(npz)


def test_a_preempted_run_resumes_exactly_on_the_same_and_on_other_process_counts(
    tmp_path, uninterrupted
):
    final, params = uninterrupted
    cut = tmp_path / "cut"
    preempted = _launch(cut, "--notice-at", "6")
    assert preempted.preempted, preempted.report
    assert preempted.returncode == 143
    assert [r.returncode for r in preempted.ranks] == [143, 143], preempted.report
    saved = meshkit.checkpoint.latest(cut)
    assert saved is not None
    assert 6 <= saved.step < 24, saved
    # The same checkpoint, resumed three ways.
    for n in (1, 4):
        shutil.copytree(cut, tmp_path / f"on{n}")
    resumed = _launch(cut)
    assert resumed.returncode == 0, resumed.report
    assert f"START at step {saved.step}" in resumed.ranks[0].stdout
    assert _final(resumed) == final  # loss and parameters, bit for bit
    for n, d in ((1, 8), (4, 2)):
        other = _launch(tmp_path / f"on{n}", n=n, d=d)
        assert other.returncode == 0, other.report
        loss = float(_final(other).split()[1])
        assert loss == pytest.approx(float(final.split()[1]), rel=1e-6), (n, d)
        for got, want in zip(_params(tmp_path / f"on{n}" / "final.npz"), params, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_crashed_process_restarts_the_group_from_the_last_periodic_checkpoint(
    tmp_path, uninterrupted
):
    # Process 1 is killed (SIGKILL) after step 6: nothing tells the others, the launcher sees
    # it die, stops them and starts the group again, which resumes from step 4.
    final, _ = uninterrupted
    result = _launch(tmp_path / "ck", "--crash-at", "6", max_restarts=1)
    assert result.returncode == 0, result.report
    assert [a.number for a in result.attempts] == [0, 1], result.report
    assert "rank 1 failed first (killed by SIGKILL)" in result.attempts[0].cause, result.report
    assert result.attempts[1].restored_step == 4  # the last periodic checkpoint: every 4
    assert "START at step 4" in result.ranks[0].stdout
    assert _final(result) == final
