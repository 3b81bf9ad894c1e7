"""Running launchers on simulated hosts (`hosts.Hosts`): one per host, bounded, nothing left.

Shared by the test modules of runs on several machines (``test_hosts*.py``), which each skip,
with the reason printed, where simulated hosts cannot be made, and fail instead under
``MESHKIT_REQUIRE_HOSTS=1`` (CI runs as root).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from hosts import Hosts, unavailable

__all__ = [
    "COORDINATOR", "LIMIT_S", "PORT", "finish", "launcher", "left", "require_hosts", "start",
    "wait_for",
]  # fmt: skip


def require_hosts() -> None:
    """Skip (with the reason) where simulated hosts cannot be made; fail under CI's setting."""
    why = unavailable()
    if why is not None:
        if os.environ.get("MESHKIT_REQUIRE_HOSTS") == "1":
            pytest.fail(f"{why}, but MESHKIT_REQUIRE_HOSTS=1 (CI runs as root)")
        pytest.skip(why)


PORT = 29500  # each host has its own ports: a second copy of the suite uses other namespaces
COORDINATOR = f"198.18.0.1:{PORT}"
LIMIT_S = 90  # no launcher of these tests may run longer


def launcher(
    node: int, args: Sequence[str], nnodes: int = 2, coordinator: str = COORDINATOR
) -> list[str]:
    return [
        sys.executable, "-m", "meshkit", "launch", "--nnodes", str(nnodes), "--node-rank",
        str(node), "--coordinator", coordinator, "--timeout", str(LIMIT_S), *args,
    ]  # fmt: skip


def start(hosts: Hosts, tmp: Path, runs: Sequence[Sequence[str]]) -> list[subprocess.Popen]:
    """One launcher per host, ``runs[i]`` its command; output to files in ``tmp``."""
    procs = []
    for i, argv in enumerate(runs):
        with open(tmp / f"launcher{i}.out", "w") as out, open(tmp / f"launcher{i}.err", "w") as err:
            procs.append(hosts.popen(i, argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL))
    return procs


def finish(procs: Sequence[subprocess.Popen], tmp: Path) -> list[tuple[int, str, str]]:
    """Each launcher's exit status, stdout and stderr; a launcher over `LIMIT_S` fails the test."""
    deadline = time.monotonic() + LIMIT_S + 30
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait(timeout=10)
            pytest.fail(f"a launcher ran past {LIMIT_S + 30} s")
    return [
        (
            p.returncode,
            (tmp / f"launcher{i}.out").read_text(),
            (tmp / f"launcher{i}.err").read_text(),
        )
        for i, p in enumerate(procs)
    ]


def wait_for(paths: Sequence[Path], limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not all of {paths} appeared within {limit} s"
        time.sleep(0.1)


def left(hosts: Hosts) -> list[int]:
    return [pid for i in range(hosts.n) for pid in hosts.pids(i)]
