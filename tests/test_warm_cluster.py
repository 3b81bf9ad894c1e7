"""`meshkit.testing.WarmCluster` and its pytest fixture: bodies, failures, timeouts, restarts.

Functions starting with an underscore run inside the cluster's processes.
"""

from __future__ import annotations

import pytest

from meshkit import LaunchError

pytestmark = [pytest.mark.multiprocess, pytest.mark.warm_cluster(num_processes=2, timeout=60)]


def _who(scale):
    import os

    import jax

    print(f"hello from {jax.process_index()}")
    return jax.process_index() * scale, jax.device_count(), os.getpid()


def _raise_on_rank_1():
    import jax

    if jax.process_index() == 1:
        raise ValueError("rank 1 refuses")
    return "fine"


def _hang_on_rank_0():
    import time

    import jax

    if jax.process_index() == 0:
        time.sleep(3600)
    return "fine"


def _env_value():
    import os

    return os.environ.get("MESHKIT_WARM_TEST_VALUE")


def _sum_across_processes():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    local = np.full((4,), jax.process_index() + 1, np.float32)
    g = meshkit.global_array_from_local(local, mesh, "data")
    return float(jax.jit(lambda a: a.sum())(g))


def test_bodies_run_in_every_rank_and_return_values_and_output(warm_cluster):
    replies = warm_cluster.call(_who, 10)
    assert [r.value[:2] for r in replies] == [(0, 8), (10, 8)]
    assert [r.stdout for r in replies] == ["hello from 0\n", "hello from 1\n"]
    assert all(r.error is None for r in replies)
    assert warm_cluster.run(_sum_across_processes) == [12.0, 12.0]
    pids = [v[2] for v in warm_cluster.run(_who, 1)]
    assert pids == [r.value[2] for r in replies]  # the same processes: started once


def test_a_body_that_raises_fails_its_call_only(warm_cluster):
    starts = warm_cluster.starts
    replies = warm_cluster.call(_raise_on_rank_1)
    assert replies[0].value == "fine"
    assert replies[0].error is None
    assert "ValueError: rank 1 refuses" in replies[1].error
    with pytest.raises(LaunchError, match=r"_raise_on_rank_1 failed on rank\(s\) 1") as info:
        warm_cluster.run(_raise_on_rank_1)
    assert "ValueError: rank 1 refuses" in str(info.value)
    assert warm_cluster.run(_sum_across_processes) == [12.0, 12.0]
    assert warm_cluster.starts == starts  # the processes went on


def test_environment_for_one_call(warm_cluster):
    assert warm_cluster.run(_env_value, env={"MESHKIT_WARM_TEST_VALUE": "x"}) == ["x", "x"]
    assert warm_cluster.run(_env_value) == [None, None]


def test_a_body_that_hangs_is_timed_out_and_the_cluster_restarts(warm_cluster):
    starts = warm_cluster.starts
    replies = warm_cluster.call(_hang_on_rank_0, timeout=3)
    assert "_hang_on_rank_0 did not finish within 3 s" in replies[0].error
    assert replies[1].value == "fine"
    assert not warm_cluster.running
    assert warm_cluster.run(_sum_across_processes) == [12.0, 12.0]
    assert warm_cluster.starts == starts + 1


def test_a_nested_function_is_refused(warm_cluster):
    def nested():
        return 1

    with pytest.raises(LaunchError, match="must be a module-level function"):
        warm_cluster.run(nested)
