"""The guarantee's stuck program (`failures.stuck`) as a script, for the schedulers that start
scripts (mpirun, srun): ``python tests/guarantee_programs/stuck.py``."""

import failures  # this script's directory comes first on sys.path

import meshkit

meshkit.init()
failures.stuck()
