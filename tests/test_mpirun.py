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


def test_demo_under_mpirun(tmp_path):
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
        sys.executable, str(EXAMPLES / "hello_mesh.py"),
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
    assert proc.returncode == 0, err
    for r in (0, 1):
        assert (
            f"process {r}/2: joined through cluster (JAX's OmpiCluster detector found its "
            "environment)" in out
        )
        assert f"process {r}/2: psum over 8 devices = 28 (expected 28)" in out
    assert "Mesh {'data': 2, 'model': 4}: 8 devices on 2 processes" in out
