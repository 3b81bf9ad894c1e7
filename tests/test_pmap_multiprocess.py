"""pmap_compat on 2 processes x 4 CPU devices, against jax.pmap and a numpy reference.

Functions starting with an underscore run inside the launched processes. Each process passes
its own per-device entries (leading axis = its 4 local devices), as pmap code does.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiprocess


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _collectives_and_layouts():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import meshkit

    me, local = jax.process_index(), jax.local_device_count()
    # The global reference: entry i belongs to device i; this process holds its 4 entries.
    full = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    mine = full[me * local : (me + 1) * local]

    def step(x):
        return x - jax.lax.pmean(x, "i"), jax.lax.psum(x, "i"), jax.lax.axis_index("i")

    # global_outputs=True: arrays over every device of every process.
    ours = meshkit.pmap_compat(step, "i", out_axes=(0, None, 0), global_outputs=True)(mine)
    theirs = jax.pmap(step, "i", out_axes=(0, None, 0))(mine)
    centred, total, index = ours
    out = {
        "shapes": [tuple(a.shape) for a in ours],
        "global": centred.is_fully_addressable,
        # JAX's own pmap gives process-local arrays: compare this process's entries.
        "matches_jax_pmap": bool(
            np.allclose(meshkit.local_from_global(centred), np.asarray(theirs[0]))
            and np.allclose(np.asarray(total), np.asarray(theirs[1]))
            and np.array_equal(meshkit.local_from_global(index), np.asarray(theirs[2]))
        ),
        "centred_ok": bool(np.allclose(meshkit.gather(centred), full - full.mean(0))),
        "total_ok": bool(np.allclose(np.asarray(total), full.sum(0))),
        "index": meshkit.local_from_global(index).tolist(),
        # A downstream jit sees the global value, not this process's part.
        "downstream_sum": float(jax.jit(jnp.sum)(centred + 1.0)),
    }
    # Global outputs feed the next call without leaving the devices.
    again = meshkit.pmap_compat(lambda x: x * 2, "i", global_outputs=True)(centred)
    out["again_ok"] = bool(np.allclose(meshkit.gather(again), 2 * (full - full.mean(0))))
    # The default: jax.pmap's process-local outputs, which feed the next call too.
    local_fn = meshkit.pmap_compat(lambda x: x + 1, "i")
    local_out = local_fn(mine)
    out["local_shape"] = tuple(local_out.shape)
    out["local_ok"] = bool(np.allclose(np.asarray(local_out), mine + 1))
    out["local_again_ok"] = bool(np.allclose(np.asarray(local_fn(local_out)), mine + 2))
    out["from_jax_pmap"] = bool(
        np.allclose(
            meshkit.gather(meshkit.pmap_compat(lambda x: x, "i", global_outputs=True)(theirs[0])),
            full - full.mean(0),
        )
    )
    try:
        meshkit.pmap_compat(lambda x: x, "i")(np.ones((5, 3), np.float32))
    except meshkit.MeshkitError as e:
        out["too_many"] = str(e)
    return out


def test_collectives_span_processes_and_outputs_are_global(warm_cluster):
    results = warm_cluster.run(_collectives_and_layouts, timeout=180)
    for me, r in enumerate(results):
        assert r["shapes"] == [(8, 3), (3,), (8,)]
        assert r["global"] is False
        assert r["matches_jax_pmap"]
        assert r["centred_ok"]
        assert r["total_ok"]
        assert r["index"] == list(range(me * 4, me * 4 + 4))
        assert r["downstream_sum"] == pytest.approx(24.0, abs=1e-3)
        assert r["again_ok"]
        assert r["local_shape"] == (4, 3)
        assert r["local_ok"]
        assert r["local_again_ok"]
        assert r["from_jax_pmap"]
        assert r["too_many"].startswith(
            "meshkit.pmap_compat(<lambda>): the mapped axis has size 5, which requires 5 "
            "devices, but only 4 are available on this process (jax.local_devices(): 4)."
        )


def _nested():
    import jax
    import numpy as np

    import meshkit

    me = jax.process_index()
    full = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)  # 2 outer entries per process
    mine = full[me * 2 : me * 2 + 2]

    def inner_fn(v):
        return v + jax.lax.psum(v, "inner") + 100 * jax.lax.psum(v, "outer")

    step = meshkit.pmap_compat(meshkit.pmap_compat(inner_fn, "inner"), "outer", global_outputs=True)
    out = step(mine)
    ref = jax.vmap(jax.vmap(inner_fn, axis_name="inner"), axis_name="outer")(full)
    return {
        "shape": tuple(out.shape),
        "mesh": dict(out.sharding.mesh.shape),
        "local": out.is_fully_addressable,
        "ok": bool(np.allclose(meshkit.gather(out), np.asarray(ref))),
    }


def test_nested_pmap_compat_across_processes(warm_cluster):
    for r in warm_cluster.run(_nested, timeout=180):
        assert r == {"shape": (4, 2, 3), "mesh": {"outer": 4}, "local": False, "ok": True}


def _property_against_vmap():
    """Hypothesis inside each process: derandomized, so both draw the same cases in order."""
    import jax
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st

    import meshkit
    from meshkit.testing import strategies as mks

    me, local, total = jax.process_index(), jax.local_device_count(), jax.device_count()
    ops = {
        "psum": lambda x: jax.lax.psum(x, "i"),
        "centre": lambda x: x - jax.lax.pmean(x.astype(np.float32), "i").astype(x.dtype),
        "index": lambda x: x * jax.lax.axis_index("i").astype(x.dtype),
        "pmax": lambda x: jax.lax.pmax(x, "i"),
    }
    checked = []

    @settings(max_examples=15, derandomize=True, database=None, deadline=None)
    @given(
        shape=st.lists(st.integers(1, 3), max_size=2),
        axis=st.integers(-3, 2),
        dtype=st.sampled_from(mks.DTYPES),
        op=st.sampled_from(sorted(ops)),
        scale=st.integers(1, 3),
    )
    def check(shape, axis, dtype, op, scale):
        axis = axis % (len(shape) + 1)
        full_shape = list(shape)
        full_shape.insert(axis, total)
        rng = np.random.default_rng(len(checked))  # the same global value in both processes
        full = (rng.integers(-5, 5, full_shape) * 1).astype(dtype)
        mine = np.take(full, np.arange(me * local, (me + 1) * local), axis=axis)
        fn = lambda x, s: ops[op](x) * s  # noqa: E731
        out = meshkit.pmap_compat(
            fn, "i", in_axes=(axis, None), static_broadcasted_argnums=1, global_outputs=True
        )(mine, scale)
        ref = jax.vmap(lambda x: fn(x, scale), in_axes=axis, axis_name="i")(full)
        got = meshkit.gather(out)
        np.testing.assert_allclose(
            np.asarray(got, np.float64), np.asarray(ref, np.float64), rtol=1e-2
        )
        checked.append(op)

    check()
    return len(checked)


def test_pmap_compat_matches_vmap_across_processes(warm_cluster):
    counts = warm_cluster.run(_property_against_vmap, timeout=240)
    assert counts[0] == counts[1] >= 10


def _differential():
    """Every case of tests/pmap_cases.py with jax.pmap and pmap_compat, default arguments."""
    import os
    import sys

    sys.path.insert(0, os.environ["MESHKIT_TEST_DIR"])
    import pmap_cases

    return pmap_cases.compare_all()


def test_legacy_code_sees_what_jax_pmap_gives_in_each_process(warm_cluster):
    """Host reads, transformations, local devices, float0, methods, compile, carries, layouts."""
    import os

    env = {"MESHKIT_TEST_DIR": os.path.dirname(__file__)}
    results = warm_cluster.run(_differential, timeout=240, env=env)
    for me, r in enumerate(results):
        differing = {case: diff for case, diff in r.items() if diff is not None}
        assert not differing, f"process {me}: {differing}"
        assert len(r) == 13


def _random_programs_against_jax_pmap():
    """Hypothesis in each process (derandomized: both draw the same programs in order)."""
    import os
    import sys

    import jax
    from hypothesis import given, settings

    sys.path.insert(0, os.environ["MESHKIT_TEST_DIR"])
    import pmap_cases

    import meshkit

    checked = []

    @settings(max_examples=20, derandomize=True, database=None, deadline=None)
    @given(program=pmap_cases.programs())
    def check(program):
        ours = pmap_cases.run_program(meshkit.pmap_compat, program)
        assert ours == pmap_cases.run_program(jax.pmap, program), program
        checked.append(program["seed"])

    check()
    return len(checked)


def test_random_programs_match_jax_pmap_in_each_process(warm_cluster):
    import os

    env = {"MESHKIT_TEST_DIR": os.path.dirname(__file__)}
    counts = warm_cluster.run(_random_programs_against_jax_pmap, timeout=240, env=env)
    assert counts[0] == counts[1] == 20


def _host_mismatch():
    """Process 1 passes host data that does not fit process 0's: each case, then an agreeing call."""
    import jax
    import numpy as np

    import meshkit

    me = jax.process_index()
    f = meshkit.pmap_compat(lambda x: jax.lax.psum(x, "i"), "i")
    cases = {
        "shape": lambda: [np.ones((4, 2 + me), np.float32)],
        "dtype": lambda: [np.ones((4, 2), np.float32 if me == 0 else np.int32)],
        "leaves": lambda: [np.ones((4, 2), np.float32)] * (1 + me),
    }
    messages = {}
    for name, make in cases.items():
        try:
            f(make())
        except meshkit.MeshkitError as e:
            messages[name] = str(e)
    ok = f([np.ones((4, 2), np.float32)])
    return messages, np.asarray(ok[0]).tolist()


def test_host_arguments_that_differ_across_processes_are_named(warm_cluster):
    import time

    start = time.monotonic()
    results = warm_cluster.run(_host_mismatch, timeout=120, env={"MESHKIT_CHECK_TIMEOUT": "20"})
    assert time.monotonic() - start < 100  # named at once, not after a timeout
    for messages, ok in results:
        assert ok == [[8.0, 8.0]] * 4  # the processes are still in step
        assert messages["shape"].startswith(
            "meshkit.pmap_compat(<lambda>): processes disagree on the global shape of args[0][0]:"
        )
        assert "process 0: float32[4, 2] (global [8, 2]" in messages["shape"]
        assert "process 1: float32[4, 3] (global [8, 3]" in messages["shape"]
        assert "processes disagree on the dtype of args[0][0]:" in messages["dtype"]
        assert "process 1: int32[4, 2]" in messages["dtype"]
        assert "processes passed pytrees of different structure:" in messages["leaves"]
        assert "process 0: (([*],), {})" in messages["leaves"]
        assert "process 1: (([*, *],), {})" in messages["leaves"]


def _messages_per_call():
    """How many cross-process assemblies each kind of input costs (host data: one per call)."""
    import jax
    import numpy as np

    import meshkit
    from meshkit._src.spmd import placement as _placement

    n = jax.local_device_count()
    assemblies = []
    original = _placement.assemble

    def counted(*args, **kwargs):
        assemblies.append(1)
        return original(*args, **kwargs)

    _placement.assemble = counted
    step = meshkit.pmap_compat(lambda x: x + jax.lax.psum(x, "i"), "i")
    counts = {}
    for name, make in {
        "numpy": lambda out: np.ones((n, 3), np.float32),
        "fed back": lambda out: out,
        "prefetched": None,
    }.items():
        before = len(assemblies)
        out = step(np.ones((n, 3), np.float32))
        if make is None:
            batches = iter([np.ones((n, 3), np.float32)] * 3)
            for batch in meshkit.prefetch_to_device(batches, 2):
                out = step(batch)
        else:
            for _ in range(3):
                out = step(make(out))
        jax.block_until_ready(out)
        counts[name] = len(assemblies) - before - 1  # the first call's numpy input
    return counts


def test_only_host_data_sends_a_message(warm_cluster):
    for counts in warm_cluster.run(_messages_per_call, timeout=120):
        assert counts == {"numpy": 3, "fed back": 0, "prefetched": 0}
