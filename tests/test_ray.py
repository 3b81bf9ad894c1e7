"""meshkit under Ray, for real: a local Ray cluster, 2 workers of 4 CPU devices each.

tests/ray_programs/ray_job.py starts the cluster in its own process and runs the program as two
plain actors or through Ray Train's `JaxTrainer` (whose training function runs in a worker
thread, not the main thread). Each worker joins JAX by hand, as Ray Train does on GPUs and
TPUs, then calls `meshkit.init()`, which adopts the join. Required in CI (which installs ray);
skipped elsewhere with the reason printed.

Ray starts once for the module: one job makes every run in turn in one cluster (`ray_job`),
and each test reads its runs' part of the output.
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

# The first test waits for the whole job (every run): 3 runs of up to 280 s would exceed 300 s.
pytestmark = [pytest.mark.multiprocess, pytest.mark.waits, pytest.mark.timeout(600)]

JOB = Path(__file__).resolve().parent / "ray_programs" / "ray_job.py"
_RUNS = ("actors", "actors:die:1", "trainer:1+stuck:1")
_JOB_LIMIT_S = 540  # the three runs; one took up to 280 s on a busy machine


def _job(
    tmp_path: Path, marker: str, runs: str, heartbeat: int, stall: int
) -> subprocess.CompletedProcess[str]:
    require("ray", "the Ray tests start a local Ray cluster")
    require("ray.train.v2.jax", "Ray Train's JaxTrainer")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHKIT_", "JAX_"))}
    env.update(
        {"RAY_JOB_OUT": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
    )
    env["MESHKIT_TEST_MARKER"] = marker  # Ray's processes inherit it: none may outlive the job
    env["RAY_JOB_HEARTBEAT"] = str(heartbeat)  # the actors' runs
    env["RAY_JOB_STALL_TIMEOUT"] = str(stall)  # the trainer's workers
    count = runs.count(",") + 1
    first = free_ports(count)  # a coordinator port for each run
    ports = ",".join(str(first + i) for i in range(count))
    return subprocess.run(
        [sys.executable, str(JOB), runs, ports],
        capture_output=True, text=True, timeout=_JOB_LIMIT_S, env=env, cwd=tmp_path,
        start_new_session=True,
    )  # fmt: skip


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
def ray_job(tmp_path_factory) -> dict[str, object]:
    """Every run of the module, in turn in one Ray cluster (Ray starts once): plain actors, a
    healthy run and one whose rank 1 dies (JAX's heartbeat timeout 10 s in both: a healthy run
    misses no heartbeat); then `JaxTrainer` (``MESHKIT_STALL_TIMEOUT=3`` for its workers) with
    one retry: rank 1 raises in the first attempt and is stuck in the second.

    Returns the job and, by run, its output from the run's ``RUN`` line: ``stdout`` to the next
    run's (the driver prints its lines in order), and ``output``, stdout and stderr to the end
    (Ray forwards the workers' lines a moment later, maybe after the next ``RUN`` line). Its own
    marker, since the job serves every test: no process of it may outlive the module.
    """
    marker = uuid.uuid4().hex
    try:
        done = _job(tmp_path_factory.mktemp("ray"), marker, ",".join(_RUNS), heartbeat=10, stall=3)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        heads = [f"RUN {i} {spec}" for i, spec in enumerate(_RUNS)]
        runs = []
        for i, head in enumerate(heads):
            out = done.stdout.split(head, 1)[1]
            runs.append({
                "stdout": out.split(heads[i + 1], 1)[0] if i + 1 < len(heads) else out,
                "output": out + done.stderr.split(head, 1)[1],
            })  # fmt: skip
        totals = [
            json.loads(line[line.index("TOTAL ") + 6 :])
            for line in done.stdout.splitlines()
            if "TOTAL " in line
        ]
        yield {"done": done, "runs": runs, "totals": totals,
               "cluster left": _ray_processes_left(marker)}  # fmt: skip
    finally:
        left = processes_with_marker(marker)
        for pid in left:
            os.kill(pid, 9)
        assert not left, f"processes left behind: {left}"


def test_two_ray_actors_run_a_meshkit_program_over_all_devices(ray_job):
    healthy = ray_job["runs"][0]["stdout"]
    results = sorted(
        (json.loads(ln[ln.index("RESULT ") + 7 :]) for ln in _lines(healthy, "RESULT ")),
        key=lambda r: r["rank"],
    )
    assert [(r["process"], r["processes"], r["devices"]) for r in results] == [(0, 2, 8), (1, 2, 8)]
    # psum over the 8 devices of both workers: 4 devices x 2 rows x (1 + 2).
    assert {r["total"] for r in results} == {24.0}
    assert {r["step_total"] for r in results} == {24.0}
    assert {r["source"] for r in results} == {"jax.distributed"}
    assert not ray_job["cluster left"]


def test_jaxtrainer_runs_meshkit_in_its_worker_thread_and_names_a_failing_or_stuck_worker(
    ray_job,
):
    # One run with max_failures=1: rank 1 raises at step 1, and Ray Train starts both workers
    # again (new processes, joined anew); then rank 1 blocks at step 1 in the training
    # function's thread (alive, stuck), and the stall verdict of both workers ends the run.
    run = ray_job["runs"][2]
    failed, stuck = run["stdout"], run["output"]  # Ray forwards the workers' output
    ranks = {t["rank"]: t for t in ray_job["totals"] if t["run"] == 2}
    assert sorted(ranks) == [0, 1], ray_job["done"].stdout[-3000:]
    for t in ranks.values():
        # The training function's thread is not the main thread, and is the program's thread.
        assert t["thread"] is False
        assert (t["processes"], t["devices"], t["total"]) == (2, 8, 24.0)
    # Both attempts joined and computed: four worker processes.
    workers = set(re.findall(r"RayTrainWorker pid=(\d+)\S* TOTAL ", stuck))
    assert len(workers) == 4, stuck[-3000:]
    assert "RuntimeError: rank 1 fails at step 1" in failed
    # The second attempt: each worker prints the verdict; the run ends.
    assert stuck.count("Process 1 holds the run: the others wait for a collective") >= 2, stuck
    assert "ends with status 1 (MESHKIT_STALL_TIMEOUT=3; 0 turns the end off)" in stuck, stuck
    assert "FAILED WorkerGroupError" in failed, stuck
    assert not ray_job["cluster left"]


def test_a_worker_that_dies_is_named_by_ray_and_the_other_ends_at_jaxs_heartbeat(ray_job):
    # Rank 1's process dies (os._exit) while rank 0 waits in a collective: no exception to
    # report, nothing told. Ray names the dead actor at once; rank 0 ends when JAX's
    # coordination service misses rank 1's heartbeats (10 s here, 100 s by JAX's default),
    # naming task 1. Never a hang.
    died = ray_job["runs"][1]
    errors = {
        int(m.group(1)): (float(m.group(2)), line)
        for line in _lines(died["stdout"], "ERROR ")
        if (m := re.search(r"ERROR (\d+) ([\d.]+) ", line))
    }
    assert sorted(errors) == [0, 1], died["stdout"][-3000:]
    assert "ActorDiedError" in errors[1][1]
    assert errors[0][0] - errors[1][0] < 60  # JAX's heartbeat ended rank 0, not a timeout
    assert "stopped sending heartbeats" in died["output"]
    assert not ray_job["cluster left"]
