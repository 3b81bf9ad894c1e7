"""2 processes x 4 CPU devices through the launcher: meshes, psum, cross-process checks.

The functions starting with an underscore run in the module's warm cluster, whose processes
import this file; what freshly launched processes run is in `ranks/processes.py`.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from ranks import processes as ranks

from meshkit.testing import launch_in_processes, run_in_processes

pytestmark = pytest.mark.multiprocess


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    """Every launched process inherits the marker; the fixture fails if one outlives its test."""
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _mesh_and_psum():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = meshkit.make_mesh({"data": -1, "model": 4})
    procs = [[d.process_index for d in row] for row in mesh.devices]
    n = mesh.devices.size
    x = jax.make_array_from_callback(
        (n, 3),
        NamedSharding(mesh, P(("data", "model"))),
        lambda idx: np.arange(n * 3, dtype=np.float32).reshape(n, 3)[idx],
    )
    f = jax.jit(
        jax.shard_map(
            lambda b: (
                jax.lax.psum(b, ("data", "model")),
                jax.lax.psum(b, "model"),  # stays inside a host
            ),
            mesh=mesh,
            in_specs=P(("data", "model")),
            out_specs=(P(), P("data")),
        )
    )
    total, per_host = f(x)
    return {
        "process": jax.process_index(),
        "device_count": jax.device_count(),
        "local": jax.local_device_count(),
        "shape": dict(mesh.shape),
        "procs": procs,
        "total": np.asarray(total.addressable_data(0)),
        "per_host": np.asarray(per_host.addressable_data(0)),
        "describe": meshkit.describe(mesh),
    }


def test_mesh_spans_processes_and_psum_crosses_them(warm_cluster):
    results = warm_cluster.run(_mesh_and_psum)  # 2 processes x 4 devices
    data = np.arange(24, dtype=np.float32).reshape(8, 3)
    for rank, r in enumerate(results):
        assert r["process"] == rank
        assert (r["device_count"], r["local"]) == (8, 4)
        assert r["shape"] == {"data": 2, "model": 4}
        assert r["procs"] == [[0, 0, 0, 0], [1, 1, 1, 1]]  # the model axis inside one process
        np.testing.assert_array_equal(r["total"], data.sum(0, keepdims=True))
        host_rows = data[4 * rank : 4 * rank + 4]
        np.testing.assert_array_equal(r["per_host"], host_rows.sum(0, keepdims=True))
    assert results[0]["describe"] == results[1]["describe"]
    owners = results[0]["describe"].splitlines()[-2:]
    assert re.fullmatch(r"process 0: devices \S+; data=0, model=0-3", owners[0])
    assert re.fullmatch(r"process 1: devices \S+; data=1, model=0-3", owners[1])


def _disagreeing_meshes():
    import jax

    import meshkit

    axes = {"data": 8} if jax.process_index() == 0 else {"data": 2, "model": 4}
    try:
        meshkit.make_mesh(axes)
    except meshkit.MeshkitError as e:
        return str(e)
    return None


def test_processes_disagreeing_on_the_mesh_all_get_an_error(warm_cluster):
    messages = warm_cluster.run(_disagreeing_meshes)
    for msg in messages:
        assert msg is not None
        assert msg.startswith("meshkit.make_mesh: processes disagree on the mesh:")
        assert "  process 0: {'data': 8} devices [" in msg
        assert "  process 1: {'data': 2, 'model': 4} devices [" in msg
        assert "Consider computing axes from values every process shares" in msg
    assert messages[0] == messages[1]


def _one_process_skips_make_mesh():
    import jax

    import meshkit

    if jax.process_index() == 1:
        return "skipped"
    try:
        meshkit.make_mesh({"data": -1})
    except meshkit.MeshkitError as e:
        return str(e)
    return None


def test_missing_process_is_named(warm_cluster):
    messages = warm_cluster.run(
        _one_process_skips_make_mesh, env={"MESHKIT_CHECK_TIMEOUT": "3"}, timeout=90
    )
    assert messages[1] == "skipped"
    assert messages[0].startswith("meshkit.make_mesh: process 1 did not reach make_mesh within 3 s")
    assert "MESHKIT_CHECK_TIMEOUT sets the wait" in messages[0]


def test_agreements_are_numbered_per_call():
    results = run_in_processes(ranks.many_agreements, devices_per_process=1)
    for me, seen in enumerate(results):
        assert seen == [
            (True, [(me, f"{me}:0")], ()),
            (True, [(me, f"{me}:1")], ()),
            (False, [(0, "0:2"), (1, "1:2")], ()),
            (True, [(me, f"{me}:3")], ()),
            (True, [(me, f"{me}:4")], ()),
        ], (me, seen)


def test_checks_agree_in_a_few_round_trips_and_fail_fast():
    results = run_in_processes(ranks.checks, devices_per_process=1, timeout=120)
    for me, seen in enumerate(results):
        steady = seen[:6]
        for summary, agreed, records, missing, gave_up, _, _ in steady:
            assert agreed, (me, seen)
            assert records == [(me, f"{me}:{summary}")], (me, seen)
            assert (missing, gave_up) == ((), ()), (me, seen)
        # One round trip per call whatever the summaries: a summary that is not the one the
        # sequence predicts (none here: no pattern repeats) meets the others' at the barrier
        # it names.
        for call in steady:
            assert call[5] == 1, (me, seen)
        different = seen[6]
        assert different[:5] == (f"c{me}", False, [(0, "0:c0"), (1, "1:c1")], (), ()), (me, seen)
        assert different[6] < 10.0, (me, seen)  # fast: the timeout is 60 s
        assert seen[7][:3] == ("a", True, [(me, f"{me}:a")]), (me, seen)
        late = seen[8]
        assert late[1] is False, (me, seen)
        if me == 0:
            assert (late[3], late[4]) == ((1,), ()), (me, seen)  # missing, named
        else:
            assert (late[3], late[4]) == ((), (0,)), (me, seen)  # arrived after 0 gave up
            assert late[6] < 1.0, (me, seen)  # refused at once
        assert seen[9][:2] == ("a", True), (me, seen)
    left = results[0][10]
    assert left[1] is False, left
    assert (1, "1:left") in left[2], left
    assert left[6] < 10.0, left


def test_run_in_processes_reports_a_failing_rank():
    from meshkit import LaunchError

    # Rank 1 fails; rank 0, told at once, may exit first: the report then names rank 1 as the
    # root cause, with its error.
    with pytest.raises(LaunchError, match=r"rank 1 failed first|--- root cause: rank 1 ---") as e:
        run_in_processes(ranks.fails_on_rank_1, devices_per_process=1, timeout=60)
    assert "ZeroDivisionError" in str(e.value)


def test_local_function_is_refused():
    from meshkit import LaunchError

    def local():
        return 1

    with pytest.raises(LaunchError, match=r"must be a module-level function"):
        launch_in_processes(local)
