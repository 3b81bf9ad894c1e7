"""SLURM variables outside a job step: classified before JAX is asked (no SLURM daemons needed).

The environments are those SLURM 22.05 gives (tests/test_slurm.py checks them against a real
cluster): a task started by ``srun -n 2``, an ``sbatch -n 2`` script's own commands, an
``salloc -n 2`` shell, and an ``sbatch`` script without ``--ntasks``.
"""

from __future__ import annotations

import re
import time

import pytest
from test_runtime import run_py

from meshkit import MeshkitError
from meshkit._src.core.env import STEP_VARS, check_step
from meshkit._src.runtime import init as runtime

SRUN_TASK = {
    "SLURM_JOB_ID": "1234",
    "SLURM_JOBID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NODELIST": "vm",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
}
BATCH_SCRIPT = {
    "SLURM_JOB_ID": "1235",
    "SLURM_JOBID": "1235",
    "SLURM_NODELIST": "vm",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}
SALLOC_SHELL = {"SLURM_JOB_ID": "1237", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2"}
ONE_TASK_BATCH = {"SLURM_JOB_ID": "1236", "SLURM_NODELIST": "vm", "SLURM_PROCID": "0"}


def test_step_vars_are_what_jax_requires():
    from jax._src.clusters import slurm_cluster

    jax_side = slurm_cluster.SlurmCluster
    for env, detected in ((SRUN_TASK, True), (BATCH_SCRIPT, False), (SALLOC_SHELL, False)):
        with pytest.MonkeyPatch.context() as mp:
            for name in [n for n in STEP_VARS if n not in env]:
                mp.delenv(name, raising=False)
            for name, value in env.items():
                mp.setenv(name, value)
            assert jax_side.is_env_present() is detected, env


@pytest.mark.parametrize(
    "env", [{}, SRUN_TASK, ONE_TASK_BATCH, {**BATCH_SCRIPT, "SLURM_NTASKS": "1"}]
)
def test_a_step_a_single_task_or_no_slurm_is_fine(env):
    check_step(env)  # raises nothing


def test_batch_script_names_what_it_found_and_what_is_missing():
    with pytest.raises(MeshkitError) as info:
        check_step(BATCH_SCRIPT)
    text = str(info.value)
    assert text.startswith(
        "meshkit.init(): SLURM_NTASKS=2 says this SLURM job runs 2 tasks, but this process is "
        "not a\ntask of a job step, so there are no other processes to join"
    ), text
    assert (
        "\nFound: SLURM_JOB_ID=1235, SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_LOCALID=0.\n"
        "Missing: SLURM_STEP_NODELIST.\n" in text
    ), text
    assert "Consider starting the program with srun in the job script" in text
    assert "`srun --ntasks=1 python program.py` or\nmeshkit.init(num_processes=1)." in text


def test_salloc_shell_is_named_too():
    with pytest.raises(
        MeshkitError,
        match=r"(?s)runs 2 tasks.*\nFound: SLURM_JOB_ID=1237, SLURM_NTASKS=2\.\n"
        r"Missing: SLURM_STEP_NODELIST, SLURM_PROCID, SLURM_LOCALID\.\n",
    ):
        check_step(SALLOC_SHELL)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not a task count >= 1"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' is not a task count >= 1"),
        ({"SLURM_PROCID": "2"}, "SLURM_PROCID='2' is not a task index below SLURM_NTASKS=2"),
        ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1' is not a task index below SLURM_NTASKS=2"),
        ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID='x' is not a task index >= 0"),
    ],
)
def test_a_step_with_values_srun_never_sets(change, message):
    with pytest.raises(MeshkitError, match=r"^meshkit\.init\(\): " + re.escape(message)) as info:
        check_step({**SRUN_TASK, **change})
    assert "Consider running the program under srun" in str(info.value)


def test_init_plan_raises_in_a_batch_script(monkeypatch):
    for name, value in BATCH_SCRIPT.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MeshkitError, match="Missing: SLURM_STEP_NODELIST"):
        runtime._plan(None, None, None)
    # mpirun inside the batch script: JAX's Open MPI detector joins the processes.
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1234.0;tcp://127.0.0.1:5000")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert runtime._plan(None, None, None).cluster == "OmpiCluster"
    # Explicit arguments win: one process on purpose.
    monkeypatch.delenv("OMPI_MCA_orte_hnp_uri")
    assert runtime._plan(None, 1, None).num_processes == 1


def test_init_raises_at_once_in_a_batch_script(tmp_path):
    started = time.monotonic()
    out = run_py(
        """
        import meshkit
        try:
            meshkit.init(timeout=600)
        except meshkit.MeshkitError as e:
            print(e)
        """,
        tmp_path,
        env=BATCH_SCRIPT,
    )
    assert out.returncode == 0, out.stderr
    assert "Missing: SLURM_STEP_NODELIST." in out.stdout, out.stdout
    assert time.monotonic() - started < 60  # not JAX's wait for a process that never comes
