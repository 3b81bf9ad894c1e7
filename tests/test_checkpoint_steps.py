"""`meshkit.checkpoint.latest` and `step_path`: the latest complete step, never a save cut short."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshkit
from meshkit import MeshkitError
from meshkit._src.checkpoint.steps import step_of

_TMP = ".orbax-checkpoint-tmp"  # orbax's mark on the directory of a save in progress


@given(
    complete=st.sets(st.integers(0, 10**6), max_size=6),
    cut_short=st.sets(st.integers(0, 10**6), max_size=3),
    others=st.sets(st.sampled_from(["final", "step_x", "steps_3", "step_-1", "notes"]), max_size=3),
)
def test_latest_is_the_highest_complete_step(complete, cut_short, others):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for step in complete:
            meshkit.checkpoint.step_path(root, step).mkdir()
        for step in cut_short:  # what a process killed mid-save leaves
            (root / f"step_{step}{_TMP}-1700000000").mkdir()
        for name in others:
            (root / name).mkdir()
        (root / "step_999999999").write_text("a file, not a checkpoint")
        found = meshkit.checkpoint.latest(root)
        if not complete:
            assert found is None
        else:
            assert found is not None
            assert (found.step, found.path) == (max(complete), root / f"step_{max(complete)}")


def test_no_root_or_an_empty_one_has_no_latest(tmp_path):
    assert meshkit.checkpoint.latest(tmp_path / "not yet") is None
    assert meshkit.checkpoint.latest(str(tmp_path)) is None


def test_step_path_and_step_of_agree():
    path = meshkit.checkpoint.step_path("/ckpt", 12)
    assert path == Path("/ckpt/step_12")
    assert step_of(path) == 12
    assert step_of("/ckpt/step_12" + _TMP) is None


def test_bad_input_is_named():
    with pytest.raises(
        MeshkitError, match=r"^meshkit.checkpoint.step_path: step must be an int >= 0; got -1\.$"
    ):
        meshkit.checkpoint.step_path("/ckpt", -1)
    with pytest.raises(MeshkitError, match=r"step must be an int >= 0; got True"):
        meshkit.checkpoint.step_path("/ckpt", True)
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.latest: root must be a str or os.PathLike; got int\.$",
    ):
        meshkit.checkpoint.latest(3)  # type: ignore[arg-type]


def test_save_keeps_the_latest_steps(tmp_path):
    from conftest import require

    require("orbax.checkpoint", "orbax")
    import numpy as np

    for step in range(1, 5):
        meshkit.checkpoint.save(meshkit.checkpoint.step_path(tmp_path, step), {"s": step}, keep=2)
    (tmp_path / f"step_3{_TMP}-1").mkdir()  # a save cut short, older than the latest
    (tmp_path / f"step_9{_TMP}-1").mkdir()  # a save of a newer step, still going on
    meshkit.checkpoint.save(meshkit.checkpoint.step_path(tmp_path, 5), {"s": np.int32(5)}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5", f"step_9{_TMP}-1"]
    assert meshkit.checkpoint.latest(tmp_path).step == 5


def test_keep_needs_a_count_and_a_step_directory(tmp_path):
    from conftest import require

    require("orbax.checkpoint", "orbax")
    with pytest.raises(
        MeshkitError, match=r"^meshkit.checkpoint.save: keep must be an int >= 1 \(the latest"
    ):
        meshkit.checkpoint.save(tmp_path / "step_1", {"s": 1}, keep=0)
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.save: keep= needs a step directory, <root>/step_<n>; got "
        r"'final'.\nConsider meshkit.checkpoint.step_path\(root, step\) as the path.",
    ):
        meshkit.checkpoint.save(tmp_path / "final", {"s": 1}, keep=3)
    assert list(tmp_path.iterdir()) == []  # nothing written


_NO_INIT = """
import os, signal, sys
import meshkit
if sys.argv[1] == "user-handler":
    signal.signal(signal.SIGTERM, lambda signum, frame: print("USER HANDLER", signum, flush=True))
before = signal.getsignal(signal.SIGTERM)
saved = [s for s in range(1, 10) if meshkit.checkpoint.should_save(s, every=4)]
print("SAVES", saved, signal.getsignal(signal.SIGTERM) is before, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("AFTER SIGTERM", [s for s in range(10, 13) if meshkit.checkpoint.should_save(s)], flush=True)
"""


@pytest.mark.parametrize("handler", ["python-default", "user-handler"])
def test_without_init_should_save_takes_no_signal(tmp_path, handler):
    # A process that never called meshkit.init: should_save is the periodic steps only, and
    # SIGTERM does what it did without meshkit (ends the process, or runs the program's handler).
    import os
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    out = subprocess.run(
        [sys.executable, "-c", _NO_INIT, handler],
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "SAVES [4, 8] True", out.stdout + out.stderr
    if handler == "python-default":
        assert out.returncode == -signal.SIGTERM, out.stderr
        assert lines == ["SAVES [4, 8] True"], out.stdout
    else:
        assert out.returncode == 0, out.stderr
        assert lines[1:] == [f"USER HANDLER {int(signal.SIGTERM)}", "AFTER SIGTERM []"]
    assert "preempt" not in out.stderr, out.stderr
