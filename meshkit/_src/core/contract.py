"""The environment variables ``meshkit launch`` sets for its ranks (both sides, no JAX)."""

from __future__ import annotations

ENV_COORDINATOR = "MESHKIT_COORDINATOR"
ENV_NUM_PROCESSES = "MESHKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHKIT_PROCESS_ID"
ENV_CPU_DEVICES = "MESHKIT_CPU_DEVICES"
ENV_LOCAL_DEVICE_IDS = "MESHKIT_LOCAL_DEVICE_IDS"
ENV_INIT_TIMEOUT = "MESHKIT_INIT_TIMEOUT"
# jax.distributed.initialize's heartbeat and shutdown timeouts, in whole seconds.
ENV_HEARTBEAT_TIMEOUT = "MESHKIT_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "MESHKIT_SHUTDOWN_TIMEOUT"
# JAX's persistent compilation cache directory (``meshkit launch --compilation-cache``).
ENV_COMPILATION_CACHE = "MESHKIT_COMPILATION_CACHE"
# Which start of the whole group this is: 0, then 1 after the first restart.
ENV_ATTEMPT = "MESHKIT_ATTEMPT"
# The run's status directory (stages, events).
ENV_STATUS = "MESHKIT_LAUNCH_STATUS"
# Seconds from a preemption notice to the end of every rank.
ENV_PREEMPT_GRACE = "MESHKIT_PREEMPT_GRACE"
DEFAULT_PREEMPT_GRACE_S = 25.0

# The first words of the stall watchdog's report (for people; the launcher reads events).
WATCHDOG_MARK = "meshkit watchdog:"
INSIDE, OUTSIDE = "inside a meshkit call", "outside meshkit"
