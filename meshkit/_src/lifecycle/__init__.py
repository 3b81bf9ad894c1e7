"""A process's life and end: the exit path, fail-fast, preemption, stalls.

Their background work runs in one thread per process, ``meshkit-service`` (in `exit`).
"""
