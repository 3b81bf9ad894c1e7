"""Test helpers for multi-process JAX code (public).

`run_in_processes` runs a module-level function in N real processes started by meshkit's
launcher, each joined through `meshkit.init`, and returns what each returned.
`launch_in_processes` does the same but hands back the whole
`meshkit.LaunchResult`, for tests that expect a failure.
"""

from ._multiprocess import launch_in_processes, run_in_processes

__all__ = ["launch_in_processes", "run_in_processes"]
