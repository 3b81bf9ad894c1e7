"""SLURM: a task of a job step, or a batch script's one copy of the program?

JAX's SLURM detector (``jax._src.clusters.slurm_cluster``) joins a process as a task of a job
step when the five `STEP_VARS` are set, as ``srun`` sets them for each task. A batch script and
an ``salloc`` shell run outside any step with only some of them (``docs/multi-host.md``,
"Without srun"), so JAX detects nothing and the process would run alone although the job asked
for several tasks; `check_step` says so, before JAX is asked.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..core.engines import STEP_VARS
from ..core.errors import MeshkitError

__all__ = ["STEP_VARS", "check_step"]


_NOT_A_STEP = """\
meshkit.init(): SLURM_NTASKS={n} says this SLURM job runs {n} tasks, but this process is not a
task of a job step, so there are no other processes to join: it would run alone and compute the
whole program by itself.
Found: {found}.
Missing: {missing}.
srun sets these five for each task it starts, and JAX's SLURM detection needs them all; the
commands of a batch script itself, and those typed in an salloc shell, run once, outside any job
step.
Consider starting the program with srun in the job script (`srun python program.py` starts the
{n} tasks), or, to run one process on purpose, `srun --ntasks=1 python program.py` or
meshkit.init(num_processes=1)."""

_BAD_VALUE = """\
meshkit.init(): {what} (SLURM's variables {found}).
srun sets these for each task of a job step: SLURM_NTASKS is the step's task count (>= 1),
SLURM_PROCID this task's index below it, SLURM_LOCALID its index on this node (>= 0).
Consider running the program under srun, and not setting SLURM_* variables by hand."""


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else None


def check_step(environ: Mapping[str, str]) -> None:
    """Raise if SLURM's variables ask for several tasks but this process is not one of a step.

    Reads ``environ`` (normally ``os.environ``) only. Nothing is raised without SLURM's
    variables, for a single task (``sbatch`` without ``--ntasks``, ``srun -n 1``), or for a task
    of a job step whose values are consistent.

    Args:
        environ: the environment to classify.

    Raises:
        MeshkitError: ``SLURM_NTASKS`` above 1 without the rest of `STEP_VARS` (a batch
            script or an ``salloc`` shell; the error names the variables found and those
            missing), or a step's ``SLURM_NTASKS``, ``SLURM_PROCID`` or ``SLURM_LOCALID`` that
            is not a count or index (``SLURM_PROCID`` not below ``SLURM_NTASKS``).

    Example:
        >>> check_step({})  # no SLURM: nothing to say
        >>> check_step({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"})  # sbatch, one task
    """
    found = [name for name in STEP_VARS if name in environ]
    if not found:
        return
    listed = ", ".join(f"{name}={environ[name]}" for name in found)
    n, pid, local = (_int(environ, v) for v in ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"))
    if "SLURM_NTASKS" in environ and (n is None or n < 1):
        what = f"SLURM_NTASKS={environ['SLURM_NTASKS']!r} is not a task count >= 1"
        raise MeshkitError(_BAD_VALUE.format(what=what, found=listed))
    if len(found) < len(STEP_VARS):
        if n is not None and n > 1:
            missing = ", ".join(name for name in STEP_VARS if name not in environ)
            raise MeshkitError(_NOT_A_STEP.format(n=n, found=listed, missing=missing))
        return  # one task, or no task count: a single process, as JAX also sees it
    assert n is not None
    if pid is None or pid >= n:
        what = (
            f"SLURM_PROCID={environ['SLURM_PROCID']!r} is not a task index below SLURM_NTASKS={n}"
        )
        raise MeshkitError(_BAD_VALUE.format(what=what, found=listed))
    if local is None:
        what = f"SLURM_LOCALID={environ['SLURM_LOCALID']!r} is not a task index >= 0"
        raise MeshkitError(_BAD_VALUE.format(what=what, found=listed))
