"""A process's life and end: fail-fast, the stall watchdog, diagnosis, launch progress.

Fail-fast ends a failing process soon and tells the others; the watchdog reports a stalled one;
the diagnosis explains JAX's cross-process timeouts; ranks mark their stages for the launcher.
"""
