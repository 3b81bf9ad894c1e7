"""meshkit under Ray, for real: a local Ray cluster, 2 workers of 4 CPU devices each.

tests/ray_programs/ray_job.py starts the cluster in its own process and runs the program as two
plain actors or through Ray Train's `JaxTrainer` (whose training function runs in a worker
thread, not the main thread). Each worker joins JAX by hand, as Ray Train does on GPUs and
TPUs, then calls `meshkit.init()`, which adopts the join. Required in CI (which installs ray);
skipped elsewhere with the reason printed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import processes_with_marker, require

from meshkit.testing import free_ports

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]

JOB = Path(__file__).resolve().parent / "ray_programs" / "ray_job.py"


def _job(
    tmp_path: Path,
    marker: str,
    mode: str,
    *extra: str,
    heartbeat: int | None = None,
    stall: int | None = None,
) -> tuple[subprocess.CompletedProcess[str], list]:
    require("ray", "the Ray tests start a local Ray cluster")
    require("ray.train.v2.jax", "Ray Train's JaxTrainer")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHKIT_", "JAX_"))}
    env.update(
        {"RAY_JOB_OUT": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
    )
    env["MESHKIT_TEST_MARKER"] = marker  # Ray's processes inherit it: none may outlive the job
    if heartbeat is not None:
        env["RAY_JOB_HEARTBEAT"] = str(heartbeat)
    if stall is not None:
        env["RAY_JOB_STALL_TIMEOUT"] = str(stall)
    first = free_ports(2)  # a coordinator port for each of a job's (at most two) runs
    done = subprocess.run(
        [sys.executable, str(JOB), mode, f"{first},{first + 1}", *extra],
        capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path,
        start_new_session=True,
    )  # fmt: skip
    totals = [
        json.loads(line[line.index("TOTAL ") + 6 :])
        for line in done.stdout.splitlines()
        if "TOTAL " in line
    ]
    return done, totals


def _lines(stdout: str, word: str) -> list[str]:
    """The driver's lines holding ``word``: Ray forwards the workers' output to the same stdout,
    a piece of which may stand before the driver's line without a newline of its own."""
    return [line for line in stdout.splitlines() if word in line]


def _ray_processes_left(marker: str, wait: float = 30.0) -> list[str]:
    """This job's Ray cluster processes (gcs_server, raylet) alive ``wait`` seconds after it.

    ``ray.shutdown`` stops them; an idle worker Ray started may take longer to notice, and is
    killed here (the marker fixture then finds nothing of the job left)."""
    deadline = time.monotonic() + wait
    while (left := processes_with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    cluster = []
    for pid in left:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "gcs_server" in args or "raylet" in args:
                cluster.append(args)
            os.kill(pid, 9)
        except OSError:
            pass  # ended meanwhile
    return cluster


@pytest.fixture(scope="module")
def actors_job(tmp_path_factory) -> dict[str, object]:
    """Both runs of plain actors, in turn in one Ray cluster (Ray starts once for the two
    tests): a healthy run, then one whose rank 1 dies. JAX's heartbeat timeout is 10 s in both
    (a healthy run never misses a heartbeat). Each run's part of the output starts at its
    ``RUN`` line, on stdout and on stderr.

    Its own marker, since the job serves two tests: no process of it may outlive the module.
    """
    marker = uuid.uuid4().hex
    try:
        done, _ = _job(tmp_path_factory.mktemp("ray"), marker, "actors", ",die:1", heartbeat=10)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        healthy, died = done.stdout.split("RUN 1 die:1", 1)
        died_err = done.stderr.split("RUN 1 die:1", 1)[1]
        yield {"healthy": healthy, "died": died, "died output": died + died_err,
               "cluster left": _ray_processes_left(marker)}  # fmt: skip
    finally:
        left = processes_with_marker(marker)
        for pid in left:
            os.kill(pid, 9)
        assert not left, f"processes left behind: {left}"


def test_two_ray_actors_run_a_meshkit_program_over_all_devices(actors_job):
    results = sorted(
        (
            json.loads(ln[ln.index("RESULT ") + 7 :])
            for ln in _lines(actors_job["healthy"], "RESULT ")
        ),
        key=lambda r: r["rank"],
    )
    assert [(r["process"], r["processes"], r["devices"]) for r in results] == [(0, 2, 8), (1, 2, 8)]
    # psum over the 8 devices of both workers: 4 devices x 2 rows x (1 + 2).
    assert {r["total"] for r in results} == {24.0}
    assert {r["step_total"] for r in results} == {24.0}
    assert {r["source"] for r in results} == {"jax.distributed"}
    assert not actors_job["cluster left"]


def test_jaxtrainer_runs_meshkit_in_its_worker_thread_and_names_a_failing_or_stuck_worker(
    tmp_path, marker
):
    # Two runs in one Ray cluster: rank 1 raises at step 1; then rank 1 blocks at step 1 in the
    # training function's thread (alive, stuck), and the stall verdict of both workers ends it.
    done, totals = _job(tmp_path, marker, "trainer", "1,stuck:1", stall=3)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    failed, stuck = done.stdout.split("RUN 1 stuck:1", 1)
    stuck += done.stderr  # Ray forwards the workers' output; the first run says no stall
    ranks = {t["rank"]: t for t in totals}
    assert sorted(ranks) == [0, 1], done.stdout[-3000:]
    for t in ranks.values():
        # The training function's thread is not the main thread, and is the program's thread.
        assert t["thread"] is False
        assert (t["processes"], t["devices"], t["total"]) == (2, 8, 24.0)
    assert "FAILED WorkerGroupError" in failed
    assert "RuntimeError: rank 1 fails at step 1" in failed
    # The stuck run: each worker (Ray forwards their output) prints the verdict; the run ends.
    assert stuck.count("Process 1 holds the run: the others wait for a collective") >= 2, stuck
    assert "ends with status 1 (MESHKIT_STALL_TIMEOUT=3; 0 turns the end off)" in stuck, stuck
    assert "FAILED WorkerGroupError" in stuck, stuck
    assert not _ray_processes_left(marker)


def test_a_worker_that_dies_is_named_by_ray_and_the_other_ends_at_jaxs_heartbeat(actors_job):
    # Rank 1's process dies (os._exit) while rank 0 waits in a collective: no exception to
    # report, nothing told. Ray names the dead actor at once; rank 0 ends when JAX's
    # coordination service misses rank 1's heartbeats (10 s here, 100 s by JAX's default),
    # naming task 1. Never a hang.
    died = actors_job["died"]
    errors = {
        int(m.group(1)): (float(m.group(2)), line)
        for line in _lines(died, "ERROR ")
        if (m := re.search(r"ERROR (\d+) ([\d.]+) ", line))
    }
    assert sorted(errors) == [0, 1], died[-3000:]
    assert "ActorDiedError" in errors[1][1]
    assert errors[0][0] - errors[1][0] < 60  # JAX's heartbeat ended rank 0, not a timeout
    assert "stopped sending heartbeats" in actors_job["died output"]
    assert not actors_job["cluster left"]
