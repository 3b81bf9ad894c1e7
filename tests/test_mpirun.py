"""The demo under Open MPI's mpirun: meshkit.init() relies on JAX's cluster detection; a
stuck process is named by every process there too, with no launcher to say it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLES

pytestmark = pytest.mark.multiprocess


def _mpirun(script, tmp_path, marker, *extra: str):
    """Run ``script`` as 2 processes x 4 CPU devices under mpirun, with ``extra`` variables
    (``NAME=value``) set in both; (returncode, stdout, stderr).

    Open MPI starts its processes outside mpirun's process group: ``marker`` (the fixture) finds
    any left behind.
    """
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
        "-x", f"MESHKIT_TEST_MARKER={marker}",
        *(x for pair in extra for x in ("-x", pair)),
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


def test_demo_under_mpirun(tmp_path, marker):
    code, out, err = _mpirun(EXAMPLES / "hello_mesh.py", tmp_path, marker)
    assert code == 0, err
    for r in (0, 1):
        assert (
            f"process {r}/2: joined through cluster (JAX's OmpiCluster detector found its "
            "environment)" in out
        )
        assert f"process {r}/2: psum over 8 devices = 28 (expected 28)" in out
    assert "Mesh {'data': 2, 'model': 4}: 8 devices on 2 processes" in out


def test_debug_mode_under_mpirun(tmp_path, marker):
    """Divergence detection needs only JAX's coordination service: mpirun's processes use it."""
    code, out, err = _mpirun(EXAMPLES / "debug_mode.py", tmp_path, marker)
    assert code == 0, err
    assert (
        "step 3: DivergenceError (processes [0, 1], field 'batch'):\n"
        "  meshkit debug: call #4 of mean_loss: process 0 passed batch float32[16,4]; "
        "process 1 passed float32[8,4]." in out
    ), out
    assert "all processes reached the end" in out, out


FAILURES = Path(__file__).resolve().parent / "guarantee_programs" / "failures.py"


def test_a_stuck_process_is_named_by_every_process_under_mpirun(tmp_path, marker):
    """No launcher collects a report: each process prints the verdict, and the run ends."""
    script = FAILURES.with_name("stuck.py")  # the guarantee's stuck program, as a script
    code, out, err = _mpirun(script, tmp_path, marker, "MESHKIT_STALL_TIMEOUT=3")
    assert code != 0, out + err
    assert "STEP 4 8.0" in out, out
    assert "STEP 5" not in out, out
    # The report at a fifth of the deadline, from each process (then the end, from the first).
    assert err.count("Process 1 holds the run: the others wait for a collective") >= 2, err
    lines = FAILURES.read_text().splitlines()
    (line,) = [i for i, text in enumerate(lines, 1) if text.endswith("# user line: stuck")]
    place = f"failures.py:{line} in stuck, in wait ("
    assert err.count(f"  process 1 is in Python at {FAILURES.parent}/{place}") >= 2, err
    assert err.count("step 5 of should_save") >= 4, err  # both places, in both reports
    assert "ends with status 1 (MESHKIT_STALL_TIMEOUT=3; 0 turns the end off)" in err, err
