"""A program joined by someone else (by hand, Ray, an engine's runtime) gets meshkit's guards.

Two real processes call `jax.distributed.initialize` themselves, then `meshkit.init()`, which
adopts that join and installs what a join of its own installs: fail-fast (a process's uncaught
exception ends every process, named), preemption, the preflight and the compile-time
comparison. Started without a launcher, each with a time limit and killed past it.
"""

from __future__ import annotations

import time

import pytest
from test_engines_multiprocess import _run_two

from meshkit.testing import free_ports

pytestmark = pytest.mark.multiprocess

_PROGRAM = """
import os, warnings
import jax

jax.config.update("jax_num_cpu_devices", 2)
rank = int(os.environ["TEST_RANK"])
jax.distributed.initialize(f"127.0.0.1:{os.environ['TEST_PORT']}", 2, rank,
                           initialization_timeout=60)
import numpy as np
import meshkit

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    info = meshkit.init(heartbeat_timeout=int(os.environ.get("TEST_HEARTBEAT", "0")) or None)
for w in caught:
    print("WARNED", w.message, flush=True)
from meshkit._src.runtime import programs
print("JOINED", info.source, info.process_id, info.num_processes, programs.installed(), flush=True)
print("AGAIN", meshkit.init() is info, flush=True)  # init is idempotent on an adopted join too
mesh = meshkit.make_mesh({"data": -1})
x = meshkit.global_array_from_local(np.ones((2, 1), np.float32), mesh, "data")
step = jax.jit(lambda a: a.sum())
for i in range(10):
    if rank == 1 and i == int(os.environ.get("TEST_FAIL_AT", "99")):
        raise RuntimeError(f"rank 1 fails at step {i}")
    print("STEP", i, float(step(x)), flush=True)
print("DONE", flush=True)
"""


def _envs(port: int, **extra: str) -> list[dict[str, str]]:
    return [{"TEST_RANK": str(r), "TEST_PORT": str(port), **extra} for r in (0, 1)]


def test_a_join_made_by_hand_is_adopted_and_guarded(tmp_path):
    port = free_ports(1)
    runs = _run_two(tmp_path, _PROGRAM, _envs(port, TEST_HEARTBEAT="30"), timeout=120)
    for rank, run in enumerate(runs):
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"JOINED jax.distributed {rank} 2 True" in run.stdout
        assert "AGAIN True" in run.stdout
        assert "STEP 9 4.0" in run.stdout
        assert "DONE" in run.stdout
        # An option JAX takes only when joining cannot apply to a join made before: said once.
        assert "WARNED meshkit.init(): heartbeat_timeout_seconds not applied" in run.stdout
        assert "jax.distributed.initialize() call" in run.stdout


def test_an_exception_on_one_process_of_a_join_made_by_hand_ends_both_named(tmp_path):
    port = free_ports(1)
    start = time.monotonic()
    runs = _run_two(tmp_path, _PROGRAM, _envs(port, TEST_FAIL_AT="3"), timeout=90)
    elapsed = time.monotonic() - start
    assert elapsed < 60, elapsed  # within seconds, not JAX's 300 s timeouts
    failing, waiting = runs[1], runs[0]
    assert failing.returncode != 0
    assert "RuntimeError: rank 1 fails at step 3" in failing.stderr
    assert "STEP 2 4.0" in waiting.stdout
    assert "DONE" not in waiting.stdout
    assert waiting.returncode != 0
    assert "process 1" in waiting.stderr, waiting.stderr[-3000:]
    assert "rank 1 fails at step 3" in waiting.stderr, waiting.stderr[-3000:]
