"""Joining the cluster, and the dispatch point every SPMD entry passes.

`meshkit.init` decides how this process joins (launcher, JAX's cluster detection, SLURM).
"""
