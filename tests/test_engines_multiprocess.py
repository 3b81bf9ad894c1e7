"""Two real processes join through each engine's environment, set as that engine sets it.

No launcher: each process gets exactly the variables the engine gives a pod or node (Kubeflow
Trainer's JAX runtime, SkyPilot, a JobSet), started by conftest's `run_python` beside the other,
and `meshkit.init()` alone must join them. Each joined process gathers both ids across
processes and prints `meshkit info`'s table. Every process has a time limit and is killed past
it (its session, so nothing it started survives).
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest
from conftest import run_python, said

from meshkit.testing import free_ports

_PROGRAM = """
import jax
import meshkit

asked = {}
initialize = jax.distributed.initialize
def spy(*args, **kwargs):  # what meshkit.init passes to JAX's join
    asked.update(kwargs)
    return initialize(*args, **kwargs)
jax.distributed.initialize = spy

info = meshkit.init(timeout=60)
print("OPTIONS", asked.get("heartbeat_timeout_seconds"), asked.get("shutdown_timeout_seconds"))
import jax, numpy as np
from jax.experimental import multihost_utils
from meshkit.cli import main

ids = multihost_utils.process_allgather(np.array([info.process_id]))
# One write: gloo's thread prints on the same stdout, between the writes of a print of several
# arguments when it is unbuffered.
joined = (info.source, info.process_id, info.num_processes, jax.device_count(),
          sorted(int(i) for i in np.ravel(ids)))
print("JOINED " + " ".join(map(str, joined)), flush=True)
main(["info"])
"""

_PARTIAL = """
import meshkit
try:
    meshkit.init(timeout=20)
except meshkit.MeshkitError as e:
    print("REFUSED", e)
else:
    print("JOINED")
"""

_ENGINE_PREFIXES = ("MESHKIT_", "SLURM_", "OMPI_", "JAX_", "SKYPILOT_", "JOB")


def _run_two(tmp_path, program: str, envs: list[dict[str, str]], timeout: float = 150):
    """Run ``program`` in two processes at once, each with its own engine variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(_ENGINE_PREFIXES)}
    base.update({"JAX_PLATFORMS": "cpu", "MESHKIT_CPU_DEVICES": "2"})
    script = tmp_path / f"engine_{uuid.uuid4().hex[:8]}.py"
    script.write_text(program)
    results: list = [None, None]
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            results[rank] = run_python([str(script)], {**base, **envs[rank]}, tmp_path, timeout)
        except BaseException as e:  # reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 60)
    assert not errors, errors
    return results


def _assert_joined(results, source: str) -> None:
    for rank, out in enumerate(results):
        assert out.returncode == 0, (rank, out.stdout, out.stderr)
        # Gloo's pieces may stand before the line or after it (it ends its lines late).
        joined = said(out.stdout, "JOINED")
        lines = [line for line in out.stdout.splitlines() if "JOINED" in line]
        assert len(joined) == 1, (rank, lines)
        assert joined[0].startswith(f"JOINED {source} {rank} 2 4 [0, 1]"), (rank, lines)
        assert f"source           {source}" in out.stdout, out.stdout
        assert f"process          {rank} of 2" in out.stdout, out.stdout


@pytest.mark.multiprocess
def test_kubeflow_trainer_jax_runtime(tmp_path):
    port = free_ports(1)
    envs = [
        {
            # As Trainer's jax plugin sets them: the address names index 0's pod and the port,
            # the id is the Job completion index (which the pod carries too).
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_COORDINATOR_PORT": str(port),
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(rank),
            "JAX_DISTRIBUTED_BACKEND": "gloo",
            "JOB_COMPLETION_INDEX": str(rank),
            # JAX's join options, as `meshkit launch --heartbeat-timeout 30 ...` sets them.
            "MESHKIT_HEARTBEAT_TIMEOUT": "30",
            "MESHKIT_SHUTDOWN_TIMEOUT": "20",
        }
        for rank in (0, 1)
    ]
    results = _run_two(tmp_path, _PROGRAM, envs)
    _assert_joined(results, "JAX_* variables")
    assert all("OPTIONS 30 20" in out.stdout for out in results), results[0].stdout
    assert f"coordinator      127.0.0.1:{port}" in results[1].stdout


@pytest.mark.multiprocess
def test_skypilot_two_nodes(tmp_path):
    port = free_ports(1)
    envs = [
        {
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n",
            "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            "JAX_COORDINATOR_PORT": str(port),
        }
        for rank in (0, 1)
    ]
    results = _run_two(tmp_path, _PROGRAM, envs)
    _assert_joined(results, "SkyPilot")
    assert "OPTIONS None None" in results[0].stdout  # JAX's defaults kept
    assert "reason           SkyPilot found: SKYPILOT_NODE_RANK='1'" in results[1].stdout


@pytest.mark.multiprocess
def test_jobset_indexed_pods(tmp_path):
    port = free_ports(1)
    envs = [
        {
            "JOB_COMPLETION_INDEX": str(rank),
            "JOBSET_NAME": "train",
            "REPLICATED_JOB_NAME": "workers",
            "JOB_INDEX": "0",
            "HOSTNAME": f"train-workers-0-{rank}",
            "MESHKIT_NUM_PROCESSES": "2",
            # train-workers-0-0.train resolves only inside the cluster: name index 0's host.
            "MESHKIT_K8S_COORDINATOR_HOST": "127.0.0.1",
            "JAX_COORDINATOR_PORT": str(port),
        }
        for rank in (0, 1)
    ]
    results = _run_two(tmp_path, _PROGRAM, envs)
    _assert_joined(results, "JobSet")


@pytest.mark.multiprocess
def test_a_partial_kubeflow_environment_is_refused_in_every_process(tmp_path):
    port = free_ports(1)
    envs = [{"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_PROCESS_ID": str(r)}
            for r in (0, 1)]  # fmt: skip
    for rank, out in enumerate(_run_two(tmp_path, _PARTIAL, envs, timeout=90)):
        assert out.returncode == 0, (rank, out.stderr)
        assert out.stdout.startswith(
            f"REFUSED meshkit.init(): the environment sets JAX_COORDINATOR_ADDRESS='127.0.0.1:"
            f"{port}', JAX_PROCESS_ID='{rank}' but not JAX_NUM_PROCESSES"
        ), out.stdout
