"""A meshkit program run by Ray: as 2 plain actors, or through Ray Train's `JaxTrainer`.

Run as a script (Ray pickles the functions of ``__main__`` by value, so the workers need no
path to this file): ``python ray_job.py RUNS PORTS``. RUNS is a comma-separated list of runs
made in turn in one Ray cluster, each ``actors`` or ``trainer``, with ``:FAILING`` for a rank
that goes wrong at step 1 (``1``: rank 1 raises; ``die:1``: dies; ``stuck:1``: blocks); PORTS
a coordinator port for each run; ``trainer:1+stuck:1`` is one `JaxTrainer` run that may start
its workers twice (``max_failures=1``): rank 1 raises in the first attempt and blocks in the
second. It starts a local Ray cluster in this process (2 CPUs, a small object store, no
dashboard), prints ``RUN i spec`` (on stdout and stderr) before each run, runs 2 workers of 4
CPU devices each, prints one ``RESULT <json>`` line per worker (or ``FAILED <text>``), and shuts
Ray down. Each worker joins JAX by hand with `jax.distributed.initialize`, as Ray Train does on
GPUs and TPUs, then calls `meshkit.init()`: meshkit adopts that join and installs its guards.
Under `JaxTrainer` the training function runs in a worker thread, which becomes the program's
thread.

``RAY_JOB_HEARTBEAT``: JAX's heartbeat timeout of the actors' runs; ``RAY_JOB_STALL_TIMEOUT``:
``MESHKIT_STALL_TIMEOUT`` of the trainer's workers (given through ``worker_runtime_env``).
"""

import json
import os
import sys
import threading
import time

# A cluster of this machine alone, on the loopback: Ray's processes use 127.0.0.1, never the
# machine's other addresses (Ray's own switch for this, read when ray is imported).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray


def work(
    run: int, rank: int, world: int, coordinator: str, failing: str | None, heartbeat_s: str = ""
) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    heartbeat = {}
    if heartbeat_s:  # how soon JAX finds a process that is gone
        heartbeat["heartbeat_timeout_seconds"] = int(heartbeat_s)
    jax.distributed.initialize(coordinator, world, rank, initialization_timeout=60, **heartbeat)
    import numpy as np

    import meshkit

    info = meshkit.init()
    mesh = meshkit.make_mesh({"data": -1})
    local = np.full((jax.local_device_count(), 2), float(rank + 1), np.float32)
    x = meshkit.global_array_from_local(local, mesh, "data")

    @meshkit.spmd(mesh=mesh, in_specs="data", out_specs=jax.sharding.PartitionSpec())
    def total(block):
        return jax.lax.psum(block.sum(), "data")

    result = {
        "run": run,
        "rank": rank,
        "process": info.process_id,
        "processes": info.num_processes,
        "source": info.source,
        "devices": jax.device_count(),
        "thread": threading.current_thread() is threading.main_thread(),
        "total": float(total(x)),
    }
    print("TOTAL " + json.dumps(result), flush=True)
    for step in range(3):
        if step == 1 and failing == str(rank):
            raise RuntimeError(f"rank {rank} fails at step {step}")
        if step == 1 and failing == f"die:{rank}":
            os._exit(3)  # the worker's process dies, as a crash or the OOM killer ends it
        if step == 1 and failing == f"stuck:{rank}":
            threading.Event().wait()  # alive but stuck: the stall verdict ends the run
        result["step_total"] = float(total(x))
    return result


@ray.remote(num_cpus=1)
class Worker:
    def run(self, run, rank, world, coordinator, failing, heartbeat):
        return work(run, rank, world, coordinator, failing, heartbeat)


def actors(run: int, coordinator: str, failing: str | None) -> None:
    """Each worker's result or error as it comes (``ERROR rank seconds type text``)."""
    heartbeat = os.environ.get("RAY_JOB_HEARTBEAT", "")
    workers = [Worker.remote() for _ in range(2)]
    refs = [w.run.remote(run, r, 2, coordinator, failing, heartbeat) for r, w in enumerate(workers)]
    start, pending = time.monotonic(), list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=240)
        if not done:
            print("TIMEOUT", [refs.index(r) for r in pending], flush=True)
            break
        rank = refs.index(done[0])
        try:
            print("RESULT " + json.dumps(ray.get(done[0])), flush=True)
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[-3000:]}"
            print(f"ERROR {rank} {time.monotonic() - start:.1f} {error!r}", flush=True)


def trainer(run: int, coordinator: str, failing: str | None, out: str) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    stall = os.environ.get("RAY_JOB_STALL_TIMEOUT")  # MESHKIT_STALL_TIMEOUT for the workers
    stall = {"MESHKIT_STALL_TIMEOUT": stall} if stall else {}

    attempts = (failing or "").split("+")  # a failing rank's part in each attempt

    def train_fn(config):
        ctx = ray.train.get_context()
        rank = ctx.get_world_rank()
        # Which attempt: the first to fail leaves a mark for those after it.
        tried = os.path.join(config["out"], f"run{run}.attempts")
        attempt = len(os.listdir(tried)) if os.path.isdir(tried) else 0
        failing = config["attempts"][min(attempt, len(config["attempts"]) - 1)] or None
        try:
            value = work(run, rank, ctx.get_world_size(), config["coordinator"], failing)
        except BaseException as e:
            os.makedirs(tried, exist_ok=True)
            open(os.path.join(tried, str(attempt)), "w").close()
            value = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
            with open(os.path.join(config["out"], f"{rank}.json"), "w") as f:
                json.dump(value, f)
            raise
        with open(os.path.join(config["out"], f"{rank}.json"), "w") as f:
            json.dump(value, f)

    job = JaxTrainer(
        train_fn,
        train_loop_config={"coordinator": coordinator, "attempts": attempts, "out": out},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            failure_config=FailureConfig(max_failures=len(attempts) - 1),
            storage_path=out,
            name="meshkit-" + coordinator.rsplit(":", 1)[1],
            worker_runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", **stall}},
        ),
    )
    try:
        job.fit()
    except Exception as e:
        print(f"FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
    for rank in range(2):
        path = os.path.join(out, f"{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                print("RESULT " + f.read(), flush=True)
                os.remove(path)


def main() -> None:
    runs, ports = sys.argv[1].split(","), [int(p) for p in sys.argv[2].split(",")]
    ray.init(
        num_cpus=4,  # logical: 2 workers, and room for Ray Train's controller
        object_store_memory=80 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}},
    )
    start = time.monotonic()
    try:
        for i, spec in enumerate(runs):  # in turn
            mode, _, failing = spec.partition(":")
            # On both streams: Ray forwards the workers' output to each, and a test reads a
            # run's part of either.
            print(f"RUN {i} {spec}", flush=True)
            print(f"RUN {i} {spec}", file=sys.stderr, flush=True)
            coordinator = f"127.0.0.1:{ports[i]}"
            if mode == "actors":
                actors(i, coordinator, failing or None)
            else:
                trainer(i, coordinator, failing or None, os.environ["RAY_JOB_OUT"])
    finally:
        print(f"ELAPSED {time.monotonic() - start:.1f}", flush=True)
        ray.shutdown()


if __name__ == "__main__":
    main()
