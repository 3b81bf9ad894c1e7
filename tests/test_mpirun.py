"""The demo under Open MPI's mpirun: meshkit.init() relies on JAX's cluster detection."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import EXAMPLES

pytestmark = pytest.mark.multiprocess


def _mpirun(script, tmp_path):
    """Run ``script`` as 2 processes x 4 CPU devices under mpirun; (returncode, stdout, stderr)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        if os.environ.get("MESHKIT_REQUIRE_MPIRUN") == "1":
            pytest.fail("mpirun not found but MESHKIT_REQUIRE_MPIRUN=1 (CI installs openmpi-bin)")
        pytest.skip("mpirun not installed (Debian: apt-get install openmpi-bin)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    command = [
        mpirun, *root, "--oversubscribe", "-np", "2",
        "-x", "MESHKIT_CPU_DEVICES=4", "-x", "JAX_PLATFORMS=cpu",
        sys.executable, str(script),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def test_demo_under_mpirun(tmp_path):
    code, out, err = _mpirun(EXAMPLES / "hello_mesh.py", tmp_path)
    assert code == 0, err
    for r in (0, 1):
        assert (
            f"process {r}/2: joined through cluster (JAX's OmpiCluster detector found its "
            "environment)" in out
        )
        assert f"process {r}/2: psum over 8 devices = 28 (expected 28)" in out
    assert "Mesh {'data': 2, 'model': 4}: 8 devices on 2 processes" in out


def test_debug_mode_under_mpirun(tmp_path):
    """Divergence detection needs only JAX's coordination service: mpirun's processes use it."""
    code, out, err = _mpirun(EXAMPLES / "debug_mode.py", tmp_path)
    assert code == 0, err
    assert (
        "step 3: DivergenceError (processes [0, 1], field 'batch'):\n"
        "  meshkit debug: call #4 of mean_loss: process 0 passed batch float32[16,4]; "
        "process 1 passed float32[8,4]." in out
    ), out
    assert "all processes reached the end" in out, out
