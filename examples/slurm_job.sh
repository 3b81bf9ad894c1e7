#!/bin/bash
# A SLURM batch job that runs a meshkit program as 2 tasks (processes), 4 CPU devices each.
#
#     sbatch examples/slurm_job.sh                          # runs examples/hello_mesh.py
#     sbatch examples/slurm_job.sh my_program.py ARGS...    # runs your program
#
# Submit it from the directory the program's path is relative to (the job starts there).
# PYTHON names the interpreter (default: python3 on the job's PATH); sbatch passes your
# environment on to the job, and srun passes it on to every task.
#
#SBATCH --job-name=meshkit
#SBATCH --ntasks=2
#SBATCH --time=00:10:00
#SBATCH --output=meshkit-%j.out

set -euo pipefail

if [ $# -eq 0 ]; then
  set -- examples/hello_mesh.py
fi

# CPU only, 4 devices per process. On GPUs delete these two lines: JAX then gives each task the
# GPU of its local rank (see docs/multi-host.md for one process driving all of a node's GPUs).
export MESHKIT_CPU_DEVICES="${MESHKIT_CPU_DEVICES:-4}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"

# The script itself runs once; srun starts one process per task and gives each the SLURM_*
# variables through which meshkit.init() joins them (JAX's SLURM detection). Running python
# here without srun would be one process alone: meshkit.init() raises a MeshkitError then.
srun "${PYTHON:-python3}" "$@"
