"""meshkit under a real SLURM (a one-node cluster on localhost, tests/slurm_cluster.py).

`srun -n 2` and `sbatch examples/slurm_job.sh` run tests/slurm_program.py as 2 tasks x 4 CPU
devices: `meshkit.init()` joins through JAX's SLURM detection, and each task prints its mesh,
a psum and a `global_array_from_local` round trip. A task that raises ends the step through
meshkit's fail-fast; a batch script that runs the program without srun gets a `MeshkitError`.

Skipped, with the reason, where SLURM is not installed; CI installs it and sets
``MESHKIT_REQUIRE_SLURM=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster
from conftest import EXAMPLES, REPO, said

import meshkit

# waits: for the cluster's daemons and jobs to start, and a preempted job's grace.
pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]

PROGRAM = Path(__file__).resolve().parent / "slurm_program.py"
JOB_SCRIPT = EXAMPLES / "slurm_job.sh"
_RUN_TIMEOUT_S = 240  # one run of JAX in 2 processes; seconds on an idle machine


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_cluster.unavailable()
    if reason is not None:
        if os.environ.get("MESHKIT_REQUIRE_SLURM") == "1":
            pytest.fail(f"{reason}, but MESHKIT_REQUIRE_SLURM=1 (CI installs SLURM)")
        pytest.skip(reason)
    cluster = slurm_cluster.start()
    yield cluster
    left = cluster.stop()
    assert not left, f"processes outlived the local SLURM cluster (killed now): {left}"


def _task_env(cluster: slurm_cluster.LocalSlurm) -> dict[str, str]:
    """What srun and sbatch pass on to the tasks: this interpreter, this meshkit, 4 CPU devices."""
    here = str(Path(meshkit.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return cluster.env(
        MESHKIT_CPU_DEVICES="4", JAX_PLATFORMS="cpu", PYTHONPATH=path, PYTHON=sys.executable
    )


def _check_program_output(
    out: str, node: str, job_id: int | None = None, *, bound: bool = False
) -> None:
    """Both tasks joined one 2 x 4 mesh and computed the right numbers.

    Each task's device ids: JAX's choice, its local rank; or, where each task sees only its
    own GPU (``bound``), device 0, the one it sees.
    """
    job = re.search(r"SLURM job (\d+)", out)
    assert job, out
    assert job_id is None or int(job.group(1)) == job_id, (job_id, out)
    # JAX's SLURM coordinator: the step's first node, port 61440 + job id mod 4096.
    coordinator = f"{node}:{61440 + int(job.group(1)) % 4096}"
    for r in (0, 1):
        assert (
            f"process {r}/2: joined through cluster (SlurmCluster), coordinator {coordinator}, "
            f"SLURM job {job.group(1)}" in out
        ), out
        assert f"process {r}/2: mesh {{'data': 2, 'model': 4}}, 8 devices" in out, out
        assert f"process {r}/2: psum over 8 devices = 276" in out, out  # sum(range(24))
        ids = 0 if bound else r
        assert f"process {r}/2: local devices ({ids},);" in out, out
        rows = "0-3" if r == 0 else "4-7"
        assert f"process {r}/2: rows {rows} round trip equal, gather equal (sum 276)" in out, out


# Each task sees only its own GPU, as under `srun --gpu-bind` (this SLURM has no GPUs to bind):
# task r sees GPU 4 + r, renumbered 0, where JAX alone would ask task 1 for a device 1.
_BIND = 'CUDA_VISIBLE_DEVICES=$((SLURM_LOCALID + 4)) exec "$0" "$@"'


def test_srun_two_tasks_join_and_compute(slurm):
    srun = slurm.client("srun")
    result = slurm.run(
        [srun, "-n", "2", "-t", "5", "bash", "-c", _BIND, sys.executable, str(PROGRAM)],
        timeout=_RUN_TIMEOUT_S,
        env=_task_env(slurm),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    _check_program_output(result.stdout, slurm.node, bound=True)
    assert (
        "process 1/2: local devices (0,); JAX's SlurmCluster detector found its environment; "
        "devices 0: local rank 1 with CUDA_VISIBLE_DEVICES=5: the scheduler bound these to the "
        "task" in result.stdout
    ), result.stdout


def test_sbatch_job_script(slurm):
    """The example job script, as a user submits it, with the program as its argument."""
    out = slurm.root / "jobs" / "job-%j.out"
    job = slurm.sbatch(
        ["-o", str(out), str(JOB_SCRIPT), str(PROGRAM)],
        timeout=_RUN_TIMEOUT_S,
        env=_task_env(slurm),
        cwd=REPO,
    )
    text = (slurm.root / "jobs" / f"job-{job.id}.out").read_text()
    assert (job.state, job.status) == ("COMPLETED", 0), text
    _check_program_output(text, slurm.node, job.id)


def test_a_failing_task_ends_the_step_with_meshkits_report(slurm):
    """Task 1 raises; task 0, waiting in a collective, stops through meshkit's fail-fast."""
    srun = slurm.client("srun")
    result = slurm.run(
        [srun, "-n", "2", "-t", "5", sys.executable, str(PROGRAM), "fail"],
        timeout=_RUN_TIMEOUT_S,
        env=_task_env(slurm),
    )
    ended = time.time()
    out, err = result.stdout, result.stderr
    assert result.returncode == 1, out + err
    assert "RuntimeError: planted failure in process 1" in err, err
    # The two tasks' stderr is one stream: their lines may interleave.
    assert "meshkit: process 1 failed: RuntimeError: planted failure in process 1\n" in err, err
    assert "Process 0 stops too (status 1): the program cannot go on without process 1" in err
    # srun reports task 0 alone, or both tasks when they ended within one of its looks.
    assert re.search(
        rf"srun: error: {re.escape(slurm.node)}: tasks? 0(-1)?: Exited with exit code 1", err
    ), err
    failed_at = re.search(r"process 1 fails at ([0-9.]+)", out)
    assert failed_at, out
    # Fail-fast: exit handlers (at most 10 s), then the others' watch (1 s polls).
    assert ended - float(failed_at.group(1)) < 30, (ended, out, err)


def test_a_stuck_task_is_named_by_every_task_and_the_step_ends(slurm):
    """Task 1 blocks in its own code before step 5 (the guarantee's stuck program): with no
    launcher to report it, every task prints the stall verdict, and the step ends with status 1
    (for SLURM's requeue to act)."""
    srun = slurm.client("srun")
    stuck = REPO / "tests" / "guarantee_programs" / "stuck.py"
    result = slurm.run(
        [srun, "-n", "2", "-t", "5", sys.executable, str(stuck)],
        timeout=_RUN_TIMEOUT_S,
        env={**_task_env(slurm), "MESHKIT_STALL_TIMEOUT": "3"},
    )
    out, err = result.stdout, result.stderr
    assert result.returncode == 1, out + err
    assert "STEP 4 8.0" in out, out
    assert "STEP 5" not in out, out
    assert err.count("Process 1 holds the run: the others wait for a collective") >= 2, err
    assert err.count("step 5 of should_save") >= 4, err  # both places, in both tasks' reports
    assert "ends with status 1 (MESHKIT_STALL_TIMEOUT=3; 0 turns the end off)" in err, err


def test_batch_script_without_srun_is_an_error(slurm):
    """The batch script's own command is one process: SLURM_NTASKS=2 but no job step."""
    script = slurm.root / "jobs" / "no_srun.sh"
    script.write_text(
        "#!/bin/bash\n"
        "env | grep '^SLURM_' | sort\n"
        '"$PYTHON" -c "import meshkit; meshkit.init()"\n'
    )
    out = slurm.root / "jobs" / "no-srun-%j.out"
    started = time.monotonic()
    job = slurm.sbatch(
        ["-n", "2", "-t", "2", "-o", str(out), str(script)],
        timeout=_RUN_TIMEOUT_S,
        env=_task_env(slurm),
    )
    took = time.monotonic() - started
    text = (slurm.root / "jobs" / f"no-srun-{job.id}.out").read_text()
    assert (job.state, job.status) == ("FAILED", 1), text
    # What SLURM gives a batch script: the job's variables, none of a step's.
    assert "SLURM_NTASKS=2\n" in text, text
    assert "SLURM_PROCID=0\n" in text, text
    assert not re.search(r"^SLURM_STEP_\w*=", text, re.MULTILINE), text
    assert (
        "MeshkitError: meshkit.init(): SLURM_NTASKS=2 says this SLURM job runs 2 tasks, "
        "but this process is not a\ntask of a job step" in text
    ), text
    assert (
        f"Found: SLURM_JOB_ID={job.id}, SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_LOCALID=0.\n"
        "Missing: SLURM_STEP_NODELIST.\n" in text
    ), text
    assert "Consider starting the program with srun in the job script" in text, text
    assert took < 120, took  # an error, not JAX waiting for a process that never comes


PREEMPTIBLE = EXAMPLES / "preemptible_training.py"


def test_a_job_preempted_by_scancel_resumes_exactly_when_submitted_again(
    slurm, tmp_path, preemptible_reference
):
    """`scancel --signal=TERM` reaches both tasks of the running step: they save at one step
    and end with 143; the job submitted again resumes there and ends with the uninterrupted
    run's loss and parameters, bit for bit (2 tasks x 4 CPU devices). (`scontrol requeue` does
    the same, but SLURM holds a requeued job for two minutes, and starting it sooner races with
    slurmd's cleanup of the first run: "Job N already killed, do not launch batch job".)"""
    final, _ = preemptible_reference  # the uninterrupted run (conftest's, shared)
    out = slurm.root / "jobs" / "preempted-%j.out"
    script = slurm.root / "jobs" / "preemptible.sh"
    script.write_text(
        f'#!/bin/bash\nsrun "$PYTHON" {PREEMPTIBLE} train {tmp_path / "ck"} --step-time 0.3\n'
    )
    job = slurm.submit(["-n", "2", "-t", "5", "-o", str(out), str(script)], env=_task_env(slurm))
    log = slurm.root / "jobs" / f"preempted-{job}.out"
    deadline = time.monotonic() + 2 * _RUN_TIMEOUT_S
    while "LOSS 4 " not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no output"
        time.sleep(0.2)
    scancel = slurm.run([slurm.client("scancel"), "--signal=TERM", str(job)], timeout=60)
    assert scancel.returncode == 0, scancel.stderr
    first = slurm.wait(job, timeout=_RUN_TIMEOUT_S)
    text = log.read_text()
    assert first.status == 143, (first, text)  # preempted: the tasks' status, the script's
    saved = re.findall(r"meshkit: preempted \((?:SIGTERM|process \d)\): saved step (\d+);", text)
    assert len(saved) == 2, text
    assert len(set(saved)) == 1, text  # both tasks, one step
    job = slurm.submit(["-n", "2", "-t", "5", "-o", str(out), str(script)], env=_task_env(slurm))
    again = slurm.wait(job, timeout=_RUN_TIMEOUT_S)
    text = (slurm.root / "jobs" / f"preempted-{job}.out").read_text()
    assert (again.state, again.status) == ("COMPLETED", 0), (again, text)
    assert f"START at step {saved[0]}" in text, text
    assert said(text, "FINAL ") == [final], text
