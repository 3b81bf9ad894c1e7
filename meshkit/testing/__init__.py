"""Test helpers for per-device and multi-process JAX code (public).

* `reference_spmd` runs per-device code the naive way (one mesh coordinate at a time, numpy
  collectives) and `assert_spmd_matches_reference` checks `meshkit.spmd` against it: use them
  for your own per-device functions.
* `meshkit.testing.strategies` has hypothesis strategies for meshes, axis names, specs and
  arrays that split evenly (it needs ``hypothesis``: ``pip install meshkit[testing]``).
* `run_in_processes` runs a module-level function in N real processes started by meshkit's
  launcher, each joined through `meshkit.init`, and returns what each returned;
  `launch_in_processes` hands back the whole `meshkit.LaunchResult`, for tests that expect a
  failure.
* `WarmCluster` launches N processes once, joins them, and runs many test bodies in them
  (a body that raises fails its own test; one that hangs is timed out and the cluster
  restarts). ``pytest -p meshkit.testing.pytest_plugin`` gives each test module one, as the
  ``warm_cluster`` fixture.
* `free_ports` finds consecutive free TCP ports, for tests that start ``meshkit launch
  --coordinator HOST:PORT`` themselves (machine 0 serves PORT and PORT+1).
"""

from meshkit._src.launch.ports import free_ports

from ._multiprocess import launch_in_processes, run_in_processes
from ._reference import assert_spmd_matches_reference, reference_spmd
from ._warm import RankReply, WarmCluster

__all__ = [
    "RankReply",
    "WarmCluster",
    "assert_spmd_matches_reference",
    "free_ports",
    "launch_in_processes",
    "reference_spmd",
    "run_in_processes",
]
