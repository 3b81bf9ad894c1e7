"""What a `meshkit.testing.run_in_processes` call costs, fresh processes against forked ones.

Each call launches 2 processes x 4 CPU devices that join (`meshkit.init`) and return their
process index. Calls alternate between fresh and forked; the table gives the median wall time
of a call and the machine's CPU time over it (all cores, from ``/proc/stat``: the ranks, the
fork server and the launcher, and anything else running, so run it on an idle machine).
"""

from __future__ import annotations

import os
import statistics
import sys
import time


def body() -> int:
    import jax

    return jax.process_index()


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def bench_testing_starts(rounds: int = 5) -> str:
    """The table: one row per way of starting, medians over ``rounds`` calls each."""
    from meshkit.testing import run_in_processes

    if not sys.platform.startswith("linux"):
        return "meshkit.testing starts: fork server needs Linux; not measured"
    run_in_processes(body, fork=True)  # the fork server imports JAX once, before timing
    samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(rounds):
        for fork in (False, True):
            cpu, wall = _busy_seconds(), time.perf_counter()
            assert run_in_processes(body, fork=fork) == [0, 1]
            samples[fork].append((time.perf_counter() - wall, _busy_seconds() - cpu))
    lines = [
        "meshkit.testing.run_in_processes, 2 processes x 4 CPU devices, join and return "
        f"(medians of {rounds} calls each, alternating)",
        f"{'start':<44} {'wall':>10} {'machine CPU':>12}",
        "-" * 68,
    ]
    for fork, name in ((False, "fresh python per process"), (True, "forked from the fork server")):
        wall = statistics.median(s[0] for s in samples[fork])
        cpu = statistics.median(s[1] for s in samples[fork])
        lines.append(f"{name:<44} {wall:>8.2f} s {cpu:>10.2f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    print(bench_testing_starts())
