"""A process's life and end: the exit path, fail-fast, preemption, the stall watchdog.

Their background work runs in one thread per process, ``meshkit-service`` (in `exit`).
"""
