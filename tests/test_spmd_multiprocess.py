"""meshkit.spmd and collectives on 2 processes x 4 CPU devices, against the reference.

The functions starting with an underscore run inside the launched processes; each process
imports this file again.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiprocess


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _check_one_mesh(axes, kind, x):
    import warnings

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit
    from meshkit import collectives as C
    from meshkit.testing import assert_spmd_matches_reference

    mesh = meshkit.make_mesh(axes, axis_types=kind)
    names = tuple(mesh.axis_names)
    outer, inner = names[0], names[-1]
    spec = P(names[:-1], inner)
    cases = {
        "psum outer": (lambda a: C.psum(a, outer), P(None, inner)),
        "psum all": (lambda a: C.psum(a, names), P()),
        "all_gather outer tiled": (lambda a: C.all_gather(a, outer, tiled=True), P(None, inner)),
        "all_gather tuple": (lambda a: C.all_gather(a, (inner, outer)), P(None, None, inner)),
        "ppermute outer": (lambda a: C.ppermute(a, outer, [(0, 1), (1, 0)]), spec),
        "shift across all": (lambda a: C.shift(a, names, 3), spec),
    }
    checked = []
    for name, (f, out_spec) in cases.items():
        assert_spmd_matches_reference(f, mesh, spec, out_spec, x)
        checked.append(f"{kind}:{name}")
    # A global array laid out differently: one reshard across processes, warned once.
    other = jax.make_array_from_callback(
        x.shape, NamedSharding(mesh, P(inner, names[:-1])), lambda idx: x[idx]
    )
    f = meshkit.spmd(lambda a: C.psum(a, outer), mesh=mesh, in_specs=spec, out_specs=P(None, inner))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(other)
    assert [w.category for w in caught] == [meshkit.ReshardWarning], caught
    expected = x.reshape(mesh.shape[outer], -1, x.shape[1]).sum(0)
    assert out.shape == expected.shape
    assert out.addressable_shards, "this process holds no shard"
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
    checked.append(f"{kind}:reshard")
    return checked


def _collectives_across_processes():
    import jax
    import numpy as np

    rng = np.random.default_rng(0)  # the same host data in every process
    checked = []
    for axes, kind in (({"data": -1, "model": 4}, "auto"), ({"rows": 4, "cols": 2}, "explicit")):
        x = rng.integers(-8, 8, size=(8, 4)).astype(np.float32)
        checked += _check_one_mesh(axes, kind, x)
    return {"process": jax.process_index(), "checked": checked}


def test_collectives_match_the_reference_across_processes(warm_cluster):
    results = warm_cluster.run(_collectives_across_processes, timeout=240)
    assert [r["process"] for r in results] == [0, 1]
    assert results[0]["checked"] == results[1]["checked"]
    assert len(results[0]["checked"]) == 14


# ---- host data is this process's part -----------------------------------------------------

_FAST_CHECK = {"MESHKIT_CHECK_TIMEOUT": "20"}


def _local_rows(rows_of):
    """The process's rows of a global array, as its devices hold them, in global order."""
    import numpy as np

    shards = sorted(rows_of.addressable_shards, key=lambda s: s.index[0].start or 0)
    seen, parts = set(), []
    for shard in shards:
        start = shard.index[0].start or 0
        if start not in seen:
            seen.add(start)
            parts.append(np.asarray(shard.data))
    return np.concatenate(parts)


def _own_rows():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import meshkit
    from meshkit import collectives as C

    me = jax.process_index()
    # Process 0: 0..7; process 1: 100..107. All rows sum to 28 + 828 = 856; had each process's
    # batch been taken for the whole value, the sum would be 56 (or 1656) and differ between them.
    mine = np.arange(8, dtype=np.float32).reshape(4, 2) + 100 * me
    results = {}
    for axes, spec in (({"data": -1}, P("data")), ({"data": 2, "model": 4}, P("data"))):
        mesh = meshkit.make_mesh(axes)

        def step(batch):
            return C.psum(batch.sum(), "data"), batch * 2 + 1

        f = meshkit.spmd(step, mesh=mesh, in_specs=spec, out_specs=(P(), P("data")))
        for kind, arg in (("numpy", mine), ("device array", jnp.asarray(mine))):
            total, rows = f(arg)
            key = f"{dict(mesh.shape)} {kind}"
            results[key] = (
                float(np.asarray(total.addressable_shards[0].data)),
                rows.shape,
                bool(np.array_equal(_local_rows(rows), mine * 2 + 1)),
            )
    # A global array and a host argument in one call: the global one is taken as it is.
    mesh = meshkit.make_mesh({"data": -1})
    weights = meshkit.global_array_from_local(np.full((4, 2), 2.0, np.float32), mesh, "data")
    g = meshkit.spmd(
        lambda w, b: C.psum((w * b).sum(), "data"), mesh=mesh, in_specs="data", out_specs=""
    )
    results["global and host"] = float(np.asarray(g(weights, mine).addressable_shards[0].data))
    return results


def test_host_data_is_each_process_own_rows(warm_cluster):
    results = warm_cluster.run(_own_rows, timeout=240, env=_FAST_CHECK)
    for result in results:
        for key in ("{'data': 8}", "{'data': 2, 'model': 4}"):
            for kind in ("numpy", "device array"):
                # The psum sees both processes' rows; the output's local rows are this
                # process's own rows, computed on.
                assert result[f"{key} {kind}"] == (856.0, (8, 2), True), (key, kind, result)
        assert result["global and host"] == 2 * 856.0
    assert results[0] == results[1]


def _replicated_argument():
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import meshkit
    from meshkit import collectives as C

    me = jax.process_index()
    mesh = meshkit.make_mesh({"data": -1})
    batch = np.full((4, 2), me + 1, np.float32)  # rows of 1s (process 0) and 2s (process 1)

    @meshkit.spmd(mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
    def scaled_total(b, scale):
        return C.psum((b * scale).sum(), "data")

    out = {}
    same = np.array([3.0, 5.0], np.float32)  # equal in every process: works
    out["same"] = float(np.asarray(scaled_total(batch, same).addressable_shards[0].data))
    out["python scalar"] = float(np.asarray(scaled_total(batch, 2.0).addressable_shards[0].data))
    differs = np.full(2, me, np.float32)
    # The default check compares a sampled digest of replicated parts (as
    # global_array_from_local's does), before the computation starts; debug mode every byte.
    try:
        scaled_total(batch, differs)
        out["default"] = "no error"
    except meshkit.MeshkitError as e:
        out["default"] = str(e)
    meshkit.debug.enable(timeout=20, watchdog=None)
    try:
        scaled_total(batch, differs)
        out["debug"] = "no error"
    except meshkit.MeshkitError as e:
        out["debug"] = str(e)
    out["after"] = float(np.asarray(scaled_total(batch, same).addressable_shards[0].data))
    meshkit.debug.disable()
    return out


def test_replicated_argument_equal_works_and_a_difference_is_caught(warm_cluster):
    results = warm_cluster.run(_replicated_argument, timeout=180, env=_FAST_CHECK)
    for r in results:
        # Rows: 4 x (1, 1) and 4 x (2, 2), times (3, 5): 4 * 8 + 4 * 16 = 96.
        assert r["same"] == 96.0, r
        assert r["python scalar"] == 2 * (4 * 2 + 4 * 4), r
        assert r["after"] == 96.0, r
        for message in (r["default"], r["debug"]):
            assert message.startswith(
                "meshkit.spmd(scaled_total): processes [0] vs [1] hold the same block of args[1] "
                "(starting at (0,)) as replicas, but passed different data for it."
            ), message
            assert "consider seeding their loaders by shard_index" in message, message


def _mismatch(which):
    import jax
    import numpy as np

    import meshkit
    from meshkit import collectives as C

    me = jax.process_index()
    mesh = meshkit.make_mesh({"data": -1})

    def step(batch):
        return C.psum(sum(b.sum() for b in jax.tree_util.tree_leaves(batch)), "data")

    f = meshkit.spmd(step, mesh=mesh, in_specs="data", out_specs="")
    batch = {
        "rows": [np.zeros((4, 2), np.float32), np.zeros((8, 2), np.float32)],
        "width": [np.zeros((4, 2), np.float32), np.zeros((4, 3), np.float32)],
        "dtype": [np.zeros((4, 2), np.float32), np.zeros((4, 2), np.int32)],
        "leaves": [[np.zeros((4, 2), np.float32)] * 2, [np.zeros((4, 2), np.float32)] * 3],
        "local": [np.zeros((4, 2), np.float32), np.zeros((7, 2), np.float32)],
    }[which][me]
    try:
        f(batch)
        message = "no error"
    except meshkit.MeshkitError as e:
        message = str(e)
    # The processes stay in step: the next call (agreeing) works.
    ok = f(np.ones((4, 2), np.float32))
    return message, float(np.asarray(ok.addressable_shards[0].data))


def _rows_differ():
    return _mismatch("rows")


def _width_differs():
    return _mismatch("width")


def _dtype_differs():
    return _mismatch("dtype")


def _leaf_count_differs():
    return _mismatch("leaves")


def _local_failure():
    return _mismatch("local")


def test_processes_passing_different_shapes_dtypes_or_leaves_get_an_error_naming_them(warm_cluster):
    import time

    cases = {
        _rows_differ: [
            "meshkit.spmd(step): processes disagree on the global shape of args[0]:",
            "process 0: float32[4, 2] (global [8, 2], split over [('data',), ()])",
            "process 1: float32[8, 2] (global [16, 2], split over [('data',), ()])",
            "Consider the same batch size on every process; for an uneven last batch (the end "
            "of the data), pad it first with meshkit.global_array_from_local(..., pad=True).",
        ],
        _width_differs: [
            "meshkit.spmd(step): processes disagree on the global shape of args[0]:",
            "process 0: float32[4, 2] (global [8, 2]",
            "process 1: float32[4, 3] (global [8, 3]",
        ],
        _dtype_differs: [
            "meshkit.spmd(step): processes disagree on the dtype of args[0]:",
            "process 0: float32[4, 2]",
            "process 1: int32[4, 2]",
        ],
        _leaf_count_differs: [
            "meshkit.spmd(step): processes passed pytrees of different structure:",
            "process 0: ([*, *],)",
            "process 1: ([*, *, *],)",
        ],
    }
    for target, parts in cases.items():
        start = time.monotonic()
        results = warm_cluster.run(target, timeout=120, env=_FAST_CHECK)
        assert time.monotonic() - start < 100, f"{target.__name__} waited for a timeout"
        for message, after in results:
            for part in parts:
                assert part in message, (target.__name__, part, message)
            assert after == 8.0 * 2, (target.__name__, after)


def test_a_local_error_on_one_process_stops_the_other_at_once(warm_cluster):
    import time

    start = time.monotonic()
    results = warm_cluster.run(_local_failure, timeout=120, env={"MESHKIT_CHECK_TIMEOUT": "60"})
    assert time.monotonic() - start < 50, "process 0 waited for the check timeout"
    (first, _), (second, _) = results
    assert second.startswith(
        "meshkit.spmd(step): the local array at args[0] has shape (7, 2); its dimension 0 has "
        "size 7,"
    ), second
    assert (
        "Consider a local batch divisible by 4, or padding the last, smaller batch first: "
        "meshkit.global_array_from_local(..., pad=True) returns it padded with a mask."
    ) in second, second
    assert "meshkit.spmd(step): process 1 failed before the processes compared their data" in (
        first
    ), first
    assert [after for _, after in results] == [16.0, 16.0]


def _property_against_numpy():
    """Hypothesis inside each process: derandomized, so both draw the same cases in order."""
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from jax.sharding import PartitionSpec as P

    import meshkit
    from meshkit import collectives as C
    from meshkit._src.sharding.specs import dim_axes

    meshes = {
        "data8": meshkit.make_mesh({"data": -1}),
        "x2y4": meshkit.make_mesh({"x": 2, "y": 4}),  # x across processes, y inside each
    }
    specs = {
        "data8": [P("data"), P(None, "data"), P()],
        "x2y4": [P("x"), P("y"), P(None, "x"), P(("x", "y")), P("y", "x"), P("x", "y"), P()],
    }
    functions = {}
    checked = []

    def spmd_for(mesh_name, spec, op):
        key = (mesh_name, spec, op)
        if key not in functions:
            mesh = meshes[mesh_name]
            axes = tuple(a for dim in dim_axes(spec, 2) for a in dim)
            if op == "affine":
                fn, out = (lambda a: a * 3 - 1), spec
            else:
                fn = (lambda a: C.psum(a.sum(), axes)) if axes else (lambda a: a.sum())
                out = P()
            functions[key] = meshkit.spmd(fn, mesh=mesh, in_specs=spec, out_specs=out)
        return functions[key]

    @settings(max_examples=20, derandomize=True, database=None, deadline=None)
    @given(
        mesh_name=st.sampled_from(sorted(meshes)),
        pick=st.integers(0, 6),
        blocks=st.tuples(st.integers(1, 3), st.integers(1, 2)),
        dtype=st.sampled_from(["float32", "int32"]),
        op=st.sampled_from(["affine", "total"]),
    )
    def check(mesh_name, pick, blocks, dtype, op):
        mesh = meshes[mesh_name]
        spec = specs[mesh_name][pick % len(specs[mesh_name])]
        counts = [int(np.prod([mesh.shape[a] for a in dim])) for dim in dim_axes(spec, 2)]
        shape = (blocks[0] * counts[0], blocks[1] * counts[1])
        rng = np.random.default_rng(len(checked))  # the same global value in both processes
        full = rng.integers(-9, 9, shape).astype(dtype)
        mine = meshkit.process_slice(mesh, spec, shape).take(full)
        out = spmd_for(mesh_name, spec, op)(mine)
        if op == "affine":
            expected = full * 3 - 1
            assert out.shape == shape
            for shard in out.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
        else:
            got = np.asarray(out.addressable_shards[0].data)
            np.testing.assert_array_equal(got, full.sum(dtype=dtype))
        checked.append((mesh_name, str(spec), op))

    check()
    return checked


def test_spmd_on_process_local_host_data_matches_numpy_on_the_global_value(warm_cluster):
    results = warm_cluster.run(_property_against_numpy, timeout=400)
    assert results[0] == results[1]
    assert len(results[0]) >= 15
    assert len({spec for _, spec, _ in results[0]}) >= 4, results[0]
