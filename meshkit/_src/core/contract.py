"""The contract between ``meshkit launch`` and the ranks it starts.

The launcher writes these environment variables for each rank; `meshkit.init` reads them. Both
sides import the names from here, so neither needs the other's module (the launcher imports no
JAX). The status directory (``MESHKIT_LAUNCH_STATUS``) is where ranks leave what the launcher
reads while the run goes on and after it ends.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_PREEMPT_GRACE_S",
    "ENV_ATTEMPT",
    "ENV_COMPILATION_CACHE",
    "ENV_COORDINATOR",
    "ENV_CPU_DEVICES",
    "ENV_HEARTBEAT_TIMEOUT",
    "ENV_INIT_TIMEOUT",
    "ENV_LOCAL_DEVICE_IDS",
    "ENV_NUM_PROCESSES",
    "ENV_PREEMPT_GRACE",
    "ENV_PROCESS_ID",
    "ENV_SHUTDOWN_TIMEOUT",
    "ENV_STATUS",
    "INSIDE",
    "OUTSIDE",
    "WATCHDOG_MARK",
]

# Written by `meshkit launch` for every rank, read by `meshkit.init`.
ENV_COORDINATOR = "MESHKIT_COORDINATOR"
ENV_NUM_PROCESSES = "MESHKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHKIT_PROCESS_ID"
ENV_CPU_DEVICES = "MESHKIT_CPU_DEVICES"
ENV_LOCAL_DEVICE_IDS = "MESHKIT_LOCAL_DEVICE_IDS"
ENV_INIT_TIMEOUT = "MESHKIT_INIT_TIMEOUT"
# jax.distributed.initialize's heartbeat and shutdown timeouts, in whole seconds
# (`meshkit._src.runtime.distributed_options`); `meshkit launch` sets them from its flags.
ENV_HEARTBEAT_TIMEOUT = "MESHKIT_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "MESHKIT_SHUTDOWN_TIMEOUT"
# JAX's persistent compilation cache directory (`meshkit._src.runtime.compile_cache`); `meshkit
# launch --compilation-cache DIR` sets it, as an absolute path, for every rank.
ENV_COMPILATION_CACHE = "MESHKIT_COMPILATION_CACHE"
# Which start of the whole group this is: 0, then 1 after the first restart (--max-restarts).
ENV_ATTEMPT = "MESHKIT_ATTEMPT"
# The run's status directory: a rank marks its stage there (`meshkit._src.core.rank_stages`).
ENV_STATUS = "MESHKIT_LAUNCH_STATUS"
# Seconds from a preemption notice to the end of every rank (`meshkit._src.lifecycle.preemption`);
# the launcher waits that long, and a margin, for its ranks after forwarding a notice.
ENV_PREEMPT_GRACE = "MESHKIT_PREEMPT_GRACE"
DEFAULT_PREEMPT_GRACE_S = 25.0

# The first words of the stall watchdog's report, for people: `meshkit launch` reads the
# ``stalled`` event (`meshkit._src.core.events`), never these lines.
WATCHDOG_MARK = "meshkit watchdog:"
# Where the watchdog found the main thread waiting (also how the launcher's summary words it).
INSIDE, OUTSIDE = "inside a meshkit call", "outside meshkit"
