"""Stop a run: every rank and every process the ranks started, politely first.

SIGTERM first, because JAX's preemption handler catches it and a rank may have state to
save; SIGKILL after a grace period, or at once on a second signal to the launcher.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from .reaper import Reaper
from .spawn import Rank

POLL_S = 0.02  # how often the launcher polls its own children
_SCAN_S = 0.05  # a look through /proc costs more than a poll of our own children


def stop(
    ranks: Sequence[Rank], grace: float, reaper: Reaper | None, hurry: Callable[[], bool]
) -> list[int]:
    """End the ranks and every process they started; the pids that would not end.

    SIGTERM to every live rank's group and to the run's other processes (`Reaper`), SIGKILL
    to what is left after ``grace`` seconds, or as soon as ``hurry()`` is true (a second signal
    to the launcher).

    Args:
        ranks: the ranks started so far.
        grace: seconds between SIGTERM and SIGKILL.
        reaper: finds the processes the ranks started outside their groups (None: none).
        hurry: polled while waiting; True skips the rest of the grace period.

    Returns:
        The pids of processes the ranks started that are still there after SIGKILL.
    """
    live = [rk for rk in ranks if rk.proc.poll() is None]
    for rk in live:
        rk.stopped = True
    for rk in ranks:
        # Also the group of a rank that has exited: its own children may still be there.
        rk.signal(signal.SIGTERM)
    strays = reaper.signal(signal.SIGTERM) if reaper is not None else 0
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not hurry():
        if any(rk.proc.poll() is None for rk in live):
            time.sleep(POLL_S)
        elif strays and reaper is not None and reaper.strays():
            time.sleep(_SCAN_S)
        else:
            break
    for rk in ranks:
        rk.signal(signal.SIGKILL)
    left = reaper.sweep() if reaper is not None else []
    for rk in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rk.proc.wait(timeout=10)
    return left
