"""Global arrays on 2 processes x 4 CPU devices: assembly, round trip, gather, errors, batches.

Functions starting with an underscore run in the module's warm cluster (its processes import
this file); what freshly launched processes run is in `ranks/global_multiprocess.py`. Every
process builds the same global reference with a shared seed and passes the part `process_slice`
names; the assembled array is compared shard by shard with the reference.
"""

from __future__ import annotations

import pytest
from ranks import global_multiprocess as ranks

from meshkit._src.coord.agreement import W
from meshkit.testing import launch_in_processes, run_in_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

_FAST_CHECK = {"MESHKIT_CHECK_TIMEOUT": "20"}


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _interleaved_mesh(names, shape):
    """A mesh whose leading axis alternates processes: p0, p1, p0, p1, ..."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    by = {}
    for d in jax.devices():
        by.setdefault(d.process_index, []).append(d)
    order = [d for pair in zip(*by.values(), strict=True) for d in pair]
    return Mesh(np.array(order, dtype=object).reshape(shape), names)


def _check_shards(g, reference):
    import numpy as np

    assert g.shape == reference.shape, (g.shape, reference.shape)
    for shard in g.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), reference[shard.index])


def _assemble_layouts():
    import jax
    import ml_dtypes
    import numpy as np

    import meshkit

    rng = np.random.default_rng(0)  # the same global references in every process
    meshes = {
        "data x model (data across processes)": meshkit.make_mesh({"data": -1, "model": 4}),
        "model across processes": meshkit.make_mesh({"model": 8}),
        "2 x 4, both split": meshkit.make_mesh({"a": 2, "b": 4}),
        "interleaved (non-contiguous)": _interleaved_mesh(("data", "model"), (4, 2)),
    }
    specs = ["_", "data", "model", "data model", "model data", "(data model)", "_ model",
             "a", "b", "a b", "b a", "(a b)", "_ a"]  # fmt: skip
    checked = []
    for mesh_name, mesh in meshes.items():
        for spec in specs:
            try:
                meshkit.spec(spec)
                axes = [a for a in spec.replace("(", " ").replace(")", " ").split() if a != "_"]
                if any(a not in mesh.shape for a in axes):
                    continue
            except meshkit.MeshkitError:
                continue
            for dtype in (np.float32, np.int32, ml_dtypes.bfloat16):
                ref = (rng.standard_normal((16, 8)) * 8).astype(dtype)
                part = meshkit.process_slice(mesh, spec, ref.shape)
                local = part.take(ref)
                assert local.shape == part.local_shape
                g = meshkit.global_array_from_local(local, mesh, spec)
                _check_shards(g, ref)
                back = meshkit.local_from_global(g)
                np.testing.assert_array_equal(back, local)
                np.testing.assert_array_equal(meshkit.gather(g), ref)
                at0 = meshkit.gather(g, to=0)
                if jax.process_index() == 0:
                    np.testing.assert_array_equal(at0, ref)
                else:
                    assert at0 is None
            checked.append(f"{mesh_name}: {spec} {part.ranges} {part.replicas}")
    # A pytree with a spec per leaf, and a jit output read back (not made by meshkit).
    mesh = meshes["data x model (data across processes)"]
    ref = {"x": rng.standard_normal((8, 4)).astype(np.float32), "y": np.arange(8, dtype=np.int32)}
    local = {
        "x": meshkit.process_slice(mesh, "data model", (8, 4)).take(ref["x"]),
        "y": meshkit.process_slice(mesh, "data", (8,)).take(ref["y"]),
    }
    g = meshkit.global_array_from_local(local, mesh, {"x": "data model", "y": "data"})
    doubled = jax.jit(lambda t: jax.tree_util.tree_map(lambda a: a * 2, t))(g)
    gathered = meshkit.gather(doubled)
    np.testing.assert_array_equal(gathered["x"], ref["x"] * 2)
    np.testing.assert_array_equal(gathered["y"], ref["y"] * 2)
    back = meshkit.local_from_global(doubled)
    np.testing.assert_array_equal(back["y"], local["y"] * 2)
    return checked


def test_every_layout_assembles_round_trips_and_gathers(warm_cluster):
    results = warm_cluster.run(_assemble_layouts, timeout=400)
    assert len(results[0]) == len(results[1]) >= 20
    first, second = "\n".join(results[0]), "\n".join(results[1])
    # The interleaved mesh gives each process non-contiguous rows.
    rows = "(((0, 2), (4, 6), (8, 10), (12, 14)), ((0, 8),)) (0,)"
    assert f"interleaved (non-contiguous): (data model) {rows}" in first
    rows = "(((2, 4), (6, 8), (10, 12), (14, 16)), ((0, 8),)) (1,)"
    assert f"interleaved (non-contiguous): (data model) {rows}" in second
    # A model axis across processes with a replicated spec: both processes form one group.
    assert "model across processes: _ (((0, 16),), ((0, 8),)) (0, 1)" in first
    assert "model across processes: model (((8, 16),), ((0, 8),)) (1,)" in second


def _mismatched_shapes():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    rows = 8 if jax.process_index() == 0 else 4
    batch = {"x": np.zeros((rows, 3), np.float32), "y": np.zeros((8,), np.int32)}
    try:
        meshkit.global_array_from_local(batch, mesh, "data")
    except meshkit.MeshkitError as e:
        return str(e)
    return "no error"


def test_mismatched_shapes_raise_on_every_process_naming_path_and_shapes(warm_cluster):
    results = warm_cluster.run(_mismatched_shapes, timeout=120, env=_FAST_CHECK)
    for message in results:
        assert "processes disagree on the global shape of ['x']" in message
        assert "process 0: float32[8, 3] (global [16, 3]" in message
        assert "process 1: float32[4, 3] (global [8, 3]" in message
        assert "pad=True" in message


def test_deferred_checks_share_round_trips_and_the_w_th_call_raises_naming_the_call():
    # Fresh processes: the message names the call by its number in the process's life.
    results = run_in_processes(ranks.deferred_checks, num_processes=2, timeout=180, env=_FAST_CHECK)
    for in_call, per_call, slow_per_call, raised_at, message, threads in results:
        # The default, agreed in the call: a steady call is one wait at the service's barrier.
        assert 0.9 <= in_call <= 1.1, results
        # Deferred: one agreement per `W` calls, fast or slow, made by the caller's thread.
        assert per_call < 0.1, results
        assert slow_per_call < 0.1, results
        assert threads == ["meshkit-service"], threads  # no thread for the deferred checks
        # Calls 201 to 264 are pending (the barrier at call 200 verified the earlier ones): the
        # W-th of them verifies and raises, in every process.
        assert raised_at == 200 + W, results
        assert "global_array_from_local (call #250, checked after it returned)" in message
        assert "processes disagree on the dtype of (the array)" in message, message


def _mismatched_structure_and_dtype(which):
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    if which == "tree":
        batch = {"x": np.zeros((8, 3), np.float32)}
        if me == 1:
            batch["extra"] = np.zeros((8,), np.float32)
    else:
        batch = {"x": np.zeros((8, 3), np.float32 if me == 0 else np.int32)}
    try:
        meshkit.global_array_from_local(batch, mesh, "data")
    except meshkit.MeshkitError as e:
        return str(e)
    return "no error"


def _tree_mismatch():
    return _mismatched_structure_and_dtype("tree")


def _dtype_mismatch():
    return _mismatched_structure_and_dtype("dtype")


def test_mismatched_structure_and_dtype_raise(warm_cluster):
    tree = warm_cluster.run(_tree_mismatch, timeout=120, env=_FAST_CHECK)
    for message in tree:
        assert "processes passed pytrees of different structure" in message
        assert "process 0: {'x': *}" in message
        assert "process 1: {'extra': *, 'x': *}" in message
    dtype = warm_cluster.run(_dtype_mismatch, timeout=120, env=_FAST_CHECK)
    for message in dtype:
        assert "processes disagree on the dtype of ['x']" in message
        assert "process 1: int32[8, 3]" in message


def _one_process_fails_locally(check=True):
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    rows = 8 if jax.process_index() == 0 else 7  # process 1: not divisible over its 4 devices
    try:
        meshkit.global_array_from_local(np.zeros((rows, 2), np.float32), mesh, "data", check=check)
    except meshkit.MeshkitError as e:
        return str(e)
    return "no error"


def _one_process_fails_locally_data_check():
    return _one_process_fails_locally(check="data")


@pytest.mark.parametrize(
    "target",
    [_one_process_fails_locally, _one_process_fails_locally_data_check],
    ids=["check=True", "check=data"],
)
def test_a_local_error_on_one_process_stops_the_other_at_once(target, warm_cluster):
    import time

    start = time.monotonic()
    results = warm_cluster.run(
        target,
        timeout=120,
        env={"MESHKIT_CHECK_TIMEOUT": "60"},
    )
    assert time.monotonic() - start < 50, "process 0 waited for the check timeout"
    assert "its dimension 0 has size 7" in results[1]
    assert "Consider pad=True" in results[1]
    assert "process 1 failed before the processes compared their data" in results[0]
    assert "MeshkitError: meshkit.global_array_from_local: the local array" in results[0]


def _replica_data_differs():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"model": 8})  # spans both processes; "_" replicates over it
    me = jax.process_index()
    x = np.full((4, 2), me, np.float32)
    meshkit.global_array_from_local(x, mesh, "_", check=False)  # not compared
    meshkit.barrier("unchecked")
    messages = []
    try:  # the default check compares a sampled digest of replicas, after the call returns
        meshkit.global_array_from_local(x, mesh, "_")
        meshkit.barrier("checked")  # a sync point: raises what the check found
    except meshkit.MeshkitError as e:
        messages.append(str(e))
    for pad in (False, True):
        try:
            meshkit.global_array_from_local(x, mesh, "_", check="data", pad=pad)
        except meshkit.MeshkitError as e:
            messages.append(str(e))
    # One element off the sampled positions: only check="data" (every byte) sees it.
    big = np.zeros((1 << 20,), np.float32)
    big[12345] = me
    meshkit.global_array_from_local(big, mesh, "_")
    meshkit.barrier("sampled")
    try:
        meshkit.global_array_from_local(big, mesh, "_", check="data")
    except meshkit.MeshkitError as e:
        messages.append(str(e))
    same = np.ones((3, 2), np.float32)
    _, mask = meshkit.global_array_from_local(same, mesh, "_", check="data", pad=True)
    messages.append(int(np.asarray(mask.addressable_shards[0].data).sum()))
    return messages


def test_replicas_that_differ_are_caught_by_default_and_by_the_data_check(warm_cluster):
    results = warm_cluster.run(_replica_data_differs, timeout=120, env=_FAST_CHECK)
    for *messages, real_rows in results:
        assert len(messages) == 4, messages
        for message in messages:
            assert "processes [0] vs [1] hold the same block of (the array)" in message
            assert "passed different data" in message
        assert real_rows == 3


def _uneven_last_batch():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1, "model": 4})
    me = jax.process_index()
    rows = 5 if me == 0 else 3
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 100 * me
    g, mask = meshkit.global_array_from_local({"x": x}, mesh, "data", pad=True)
    full = meshkit.gather({"x": g["x"], "mask": mask})
    return {"shape": list(g["x"].shape), "mask": full["mask"].tolist(), "x": full["x"].tolist()}


def test_uneven_last_batch_pads_to_an_agreed_size_with_a_mask(warm_cluster):
    results = warm_cluster.run(_uneven_last_batch, timeout=120, env=_FAST_CHECK)
    assert results[0] == results[1]
    r = results[0]
    assert r["shape"] == [10, 2]  # 5 rows per process, the larger share
    assert r["mask"] == [True] * 5 + [True] * 3 + [False] * 2
    assert r["x"][5:8] == [[100.0, 101.0], [102.0, 103.0], [104.0, 105.0]]
    assert r["x"][8:] == [[0.0, 0.0], [0.0, 0.0]]


def _batches_of_unequal_length(pad):
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    steps = 5 if me == 0 else 3  # process 1's loader ends first

    def loader():
        for step in range(steps):
            yield {"x": np.full((4, 2), 10 * step + me, np.float32)}

    out = []
    for item in meshkit.global_batches(loader(), mesh, "data", pad=pad, prefetch=2):
        batch, mask = item if pad else (item, None)
        full = meshkit.gather(batch["x"])
        out.append((full[:, 0].tolist(), None if mask is None else meshkit.gather(mask).tolist()))
    return out


def _batches_pad_to_the_end():
    return _batches_of_unequal_length(True)


def _loaders_of_different_lengths():
    import time

    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()

    def loader(steps):
        for step in range(steps):
            yield {"x": np.full((4, 2), 10 * step + me, np.float32)}

    out = []
    runs = [(4, 3, False, True), (4, 3, False, False), (2, 0, True, True), (2, 0, True, False)]
    for mine, theirs, pad, together in runs:
        batches = meshkit.global_batches(
            loader(mine if me == 0 else theirs), mesh, "data", pad=pad, stop_together=together
        )
        taken, start = 0, time.monotonic()
        try:
            for _ in batches:
                taken += 1
        except meshkit.MeshkitError as e:
            out.append({"taken": taken, "error": str(e), "seconds": time.monotonic() - start})
    meshkit.barrier("after the errors")  # every process goes on, in step
    return out


def test_loaders_of_different_lengths_are_an_error_on_every_process(warm_cluster):
    results = warm_cluster.run(
        _loaders_of_different_lengths,
        timeout=180,
        env={"MESHKIT_CHECK_TIMEOUT": "60"},
    )
    for run in results[0] + results[1]:
        assert run["seconds"] < 30, run  # found at the step, not after a timeout
    errors = [[(r["taken"], r["error"]) for r in result] for result in results]
    assert errors[0] == errors[1]
    pad_false, pad_false_unsynced, pad_true, pad_true_unsynced = errors[0]
    assert pad_false == pad_false_unsynced
    assert pad_false[0] == 3
    assert pad_false[1] == (
        "meshkit.global_batches: the processes' loaders yielded different numbers of batches: "
        "process 1's loader ended after 3 batches, while process 0's yielded a 4th.\n"
        "With pad=False every step needs a batch from every process, and the batches the longer "
        "loaders still hold would be dropped unseen.\n"
        "Consider pad=True (the processes whose loaders ended contribute padding, which the mask "
        "marks, until every loader has ended), or loaders that yield the same number of batches "
        "(drop the last, short batch everywhere, or stop after a fixed number of steps with "
        "itertools.islice)."
    )
    assert pad_true == pad_true_unsynced
    assert pad_true[0] == 0
    assert pad_true[1] == (
        "meshkit.global_batches: the processes' loaders yielded different numbers of batches: "
        "process 1's loader ended without a batch, while process 0's yielded one.\n"
        "With pad=True a process whose loader has ended contributes padding, shaped like its "
        "earlier batches; a loader that yielded no batch has none to copy.\n"
        "Consider giving every process at least one row, or a loader that yields a batch of 0 "
        "rows (same keys and dtypes) when its shard is empty."
    )


def test_global_batches_pad_until_every_loader_ends(warm_cluster):
    results = warm_cluster.run(_batches_pad_to_the_end, timeout=120, env=_FAST_CHECK)
    assert results[0] == results[1]
    assert len(results[0]) == 5
    values, mask = results[0][4]
    assert values == [40.0] * 4 + [0.0] * 4
    assert mask == [True] * 4 + [False] * 4


def _loader_raises():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})

    def loader():
        yield np.zeros((4, 2), np.float32)
        if jax.process_index() == 1:
            raise KeyError("shard-00017 is missing")
        yield np.zeros((4, 2), np.float32)

    got = []
    try:
        for batch in meshkit.global_batches(loader(), mesh, "data"):
            got.append(batch.shape)
    except Exception as e:
        import traceback

        return {"type": type(e).__name__, "message": str(e), "steps": len(got),
                "trace": "".join(traceback.format_exception(e))}  # fmt: skip
    return {"type": None}


def test_a_loader_error_reaches_its_caller_and_stops_the_others(warm_cluster):
    results = warm_cluster.run(_loader_raises, timeout=120, env=_FAST_CHECK)
    assert results[1]["type"] == "KeyError"
    assert "shard-00017 is missing" in results[1]["message"]
    assert "in loader" in results[1]["trace"]  # the loader's own frame
    assert results[0]["type"] == "MeshkitError"
    assert "process 1 failed" in results[0]["message"]
    assert "KeyError" in results[0]["message"]
    assert results[0]["steps"] == results[1]["steps"] == 1


@pytest.mark.parametrize(
    ("program", "timeout", "said"),
    [
        # Alive but never calling: named after the check timeout.
        ("one_process_never_calls", 3, "process 1 did not arrive within 3 s; the others did."),
        # Ended: its leave record names it at once, not after the 60 s timeout.
        ("one_process_ends_first", 60, "process 1 left the program without making this "
         "call (process 1 ended).\n"),
    ],
    ids=["alive", "ended"],
)  # fmt: skip
def test_a_process_that_never_calls_is_named(program, timeout, said):
    result = launch_in_processes(
        getattr(ranks, program),
        num_processes=2,
        timeout=120,
        env={"MESHKIT_CHECK_TIMEOUT": str(timeout)},
    )
    message = result.values[0]
    assert message.startswith(f"meshkit.global_array_from_local: {said}"), message
    assert result.elapsed < 45, result.report  # the ended one: well before its check timeout


def test_a_mismatch_in_the_last_call_of_a_program_ends_it_with_a_non_zero_status():
    # The deferred check fails at exit, where no meshkit call can raise it: found then, it ends
    # the process with status 1 instead of a traceback of a thread and 0. (The default check
    # raises in the call itself: tests/test_verified.py.)
    result = launch_in_processes(ranks.mismatch_then_end, num_processes=2, timeout=120)
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    assert "can't create new thread" not in text, text
    assert "processes disagree on the global shape of (the array)" in text, text
    assert (
        "meshkit: exiting with status 1: a cross-process check failed after this process's "
        "last meshkit call, so nothing raised it:" in text
    ), text


def _local_mesh_and_global_leaf():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import meshkit

    messages = []
    local_mesh = Mesh(np.array(jax.local_devices()), ("data",))
    try:
        meshkit.global_array_from_local(np.zeros((4,), np.float32), local_mesh, "data")
    except meshkit.MeshkitError as e:
        messages.append(str(e))
    mesh = meshkit.make_mesh({"data": -1})
    g = meshkit.global_array_from_local(np.zeros((4,), np.float32), mesh, "data")
    try:
        meshkit.global_array_from_local({"g": g}, mesh, "data")
    except meshkit.MeshkitError as e:
        messages.append(str(e))
    try:
        meshkit.gather(g, to=2)
    except meshkit.MeshkitError as e:
        messages.append(str(e))
    return messages


@pytest.mark.parametrize("debug", ["0", "1"], ids=["debug-off", "debug-on"])
def test_gather_to_different_places_is_named_instead_of_a_hang(debug):
    env = {**_FAST_CHECK, "MESHKIT_DEBUG": debug, "MESHKIT_DEBUG_TIMEOUT": "20"}
    results = run_in_processes(
        ranks.gather_to_different_places, num_processes=2, timeout=120, env=env
    )
    for first, _ in results:
        if debug == "0":
            assert first.startswith(
                "meshkit.gather: the processes called gather differently:\n"
                "  process 0: to=0\n  process 1: to=1\n"
            ), first
        else:  # debug mode compares every meshkit call first: to is a static argument
            assert "process 0 passed to static 0; process 1 passed static 1" in first, first
    assert [v for _, v in results] == [16.0, None]


def test_a_mesh_of_one_process_and_an_already_global_leaf_are_refused(warm_cluster):
    results = warm_cluster.run(_local_mesh_and_global_leaf, timeout=120, env=_FAST_CHECK)
    for pid, (local_mesh, global_leaf, bad_to) in enumerate(results):
        assert (
            f"the mesh {{'data': 4}} holds devices of processes [{pid}], but the program has 2 processes"
            in local_mesh
        )
        assert "not a mesh of jax.local_devices()" in local_mesh
        assert "the leaf at ['g'] is already a global jax.Array (shape (8,)" in global_leaf
        assert "to=2 is not a process; the program has 2 processes (0 to 1)" in bad_to


@pytest.mark.parametrize(
    "target", [ranks.stop_early_with, ranks.stop_early_no_close], ids=["with", "no-close"]
)
def test_breaking_out_of_global_batches_exits_cleanly(target):
    result = launch_in_processes(target, num_processes=2, timeout=120, env=_FAST_CHECK)
    assert result.returncode == 0, result.report
    assert result.values == [2, 2]


def test_an_exception_leaving_a_with_block_is_the_one_error_shown():
    # Rank 0's loop body raises at step 1, rank 1 goes on. Leaving the `with` block, rank 0
    # says how it left and does not wait for rank 1: its ValueError is the error shown, not a
    # second one from the close about steps that differ (nor after the 60 s check timeout).
    result = launch_in_processes(
        ranks.stop_early_raising, num_processes=2, timeout=120, env={"MESHKIT_CHECK_TIMEOUT": "60"}
    )
    rank0 = result.ranks[0]
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    assert rank0.returncode != 0, text
    assert "ValueError: boom at step 1" in rank0.stderr, text
    assert "left their loops at different steps" not in rank0.stderr, text
    assert "During handling of the above exception" not in rank0.stderr, text
    assert not result.timed_out, text


def test_a_process_that_went_on_past_a_close_is_ended_naming_it():
    import time

    start = time.monotonic()
    result = launch_in_processes(
        ranks.stop_early_one_closes,
        num_processes=2,
        timeout=120,
        env={"MESHKIT_CHECK_TIMEOUT": "60"},
    )
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    # Process 0 closes after step 2. Process 1's helper had assembled step 3 (agreed with
    # process 0's helper), so process 1 takes it and waits in its sum, which process 0 never
    # joins: the close watch finds the close, and the process ends with the error, not the
    # 60 s check timeout, nor for ever.
    assert result.returncode != 0, text
    assert time.monotonic() - start < 50, text
    # Process 0's close raises that process 1 went on, unless process 1's failure post, which
    # says the same from process 1's side, ended it first.
    rank0 = result.ranks[0].stderr
    assert (
        "meshkit.global_batches: the processes left their loops at different steps: this "
        "process (process 0) closed its iterator after step 2, but process 1 took step 3." in rank0
    ) or (
        "meshkit: process 1 failed: DivergenceError: meshkit.global_batches: the processes left "
        "their loops at different steps: process 0 after step 2 closed its iterator, but this "
        "process (process 1) took step 3 already" in rank0
    ), text
    # Process 1, waiting in step 3's sum, is ended at once by its close watch, with its own
    # error, or by process 0's failure post, naming process 0.
    rank1 = result.ranks[1].stderr
    assert (
        "meshkit: process 1 stops inside step 3 of meshkit.global_batches: the other processes "
        "will not join its collectives.\nDivergenceError: meshkit.global_batches: the processes "
        "left their loops at different steps" in rank1
    ) or (
        "meshkit: process 0 failed: DivergenceError: meshkit.global_batches" in rank1
        and "Process 0's output holds the cause." in rank1
    ), text


def test_a_loop_left_early_on_one_process_computes_nothing_after_it():
    # Rank 1 leaves its with block after step 3; rank 0 takes step 4 and waits in its psum.
    # Rank 1's close waits for rank 0 to confirm, learns that it went on, and raises: its
    # psum after the loop never meets rank 0's psum of step 4 (which would sum 10s with 4s).
    # Rank 0, in a psum that cannot complete, is ended at once by its close watch (or by rank
    # 1's failure post, naming rank 1). Rank 0's end may reach rank 1 first: then rank 1 ends
    # with rank 0's words, which name the same two steps.
    result = launch_in_processes(
        ranks.one_rank_leaves_the_loop_early,
        num_processes=2,
        timeout=120,
        env={"MESHKIT_CHECK_TIMEOUT": "60"},
    )
    text = result.report + "\n".join(r.stdout + r.stderr for r in result.ranks)
    assert "after the loop" not in text, text
    assert result.values == [None, None], text
    assert result.ranks[0].returncode != 0, text
    assert result.ranks[1].returncode != 0, text
    rank1 = result.ranks[1].stderr
    assert (
        "meshkit.global_batches: the processes left their loops at different steps: this "
        "process (process 1) closed its iterator after step 3, but process 0 took step 4." in rank1
    ) or (
        "meshkit: process 0 failed: DivergenceError: meshkit.global_batches: the processes left "
        "their loops at different steps: process 1 after step 3 closed its iterator, but this "
        "process (process 0) took step 4 already" in rank1
    ), text
    rank0 = result.ranks[0].stderr
    assert "meshkit: process 0 stops inside step 4 of meshkit.global_batches" in rank0 or (
        "cannot go on without process 1" in rank0 and "Process 1's output holds the cause." in rank0
    ), text


def _asks_past_a_close():
    import time

    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    loader = (np.full((4, 2), i, np.float32) for i in range(100))
    error = None
    with meshkit.global_batches(loader, mesh, "data", prefetch=3) as it:
        sums = [float(meshkit.gather(next(it)).sum()) for _ in range(2)]
        try:
            if me == 0:
                it.close()  # after step 2: it waits for process 1, which goes on
            else:
                time.sleep(2.5)  # the close watch reads the posts every second
                next(it)
        except meshkit.DivergenceError as e:
            error = (str(e), e.processes, e.field)
    meshkit.barrier("after the error")  # the processes go on, in step
    return sums, error


def _closed_after_different_steps():
    import time

    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    loader = (np.full((4, 2), i, np.float32) for i in range(100))
    it = meshkit.global_batches(loader, mesh, "data", prefetch=3)
    # No collective in the steps: process 1 takes a third step that process 0 never takes.
    for _ in range(3 if me == 1 else 2):
        next(it)
    meshkit.barrier("steps taken")
    if me == 0:
        time.sleep(1.0)  # process 1 closes first (else it is a process that took step 3)
    error = None
    try:
        it.close()  # after step 3 on process 1, after step 2 on process 0: both raise
    except meshkit.DivergenceError as e:
        error = (str(e), e.processes, e.field)
    meshkit.barrier("after the error")
    return it.steps, error


def test_leaving_the_loop_at_different_steps_is_named(warm_cluster):
    advice = (
        "Every process must take the same number of batches from its global_batches: a loop "
        "that stops early (break, close(), the end of a with block) must stop after the same "
        "step on every process.\nConsider deciding when to stop from a value every process "
        "has (the step number, a value computed on global arrays), not from one process's own "
        "data or clock."
    )
    asked = warm_cluster.run(_asks_past_a_close, timeout=120, env=_FAST_CHECK)
    assert asked[0] == (
        [0.0, 16.0],
        (
            "meshkit.global_batches: the processes left their loops at different steps: "
            "this process (process 0) closed its iterator after step 2, but process 1 asks "
            f"for step 3.\n{advice}",
            [1],
            "steps",
        ),
    )
    assert asked[1] == (
        [0.0, 16.0],
        (
            "meshkit.global_batches: the processes left their loops at different steps: "
            "process 0 after step 2 closed its iterator, but this process (process 1) asks "
            f"for step 3, which process 0 will not take.\n{advice}",
            [0],
            "steps",
        ),
    )
    closed = warm_cluster.run(_closed_after_different_steps, timeout=120, env=_FAST_CHECK)
    assert closed == [
        (
            2,
            (
                "meshkit.global_batches: the processes left their loops at different steps: "
                "process 1 after step 3, this process (process 0) after step 2.\n" + advice,
                [1],
                "steps",
            ),
        ),
        (
            3,
            (
                "meshkit.global_batches: the processes left their loops at different steps: "
                "process 0 after step 2, this process (process 1) after step 3.\n" + advice,
                [0],
                "steps",
            ),
        ),
    ]


def _windows_agree_and_fall_back():
    import jax
    import numpy as np

    import meshkit
    from meshkit._src.coord import agree

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    steps = 200
    # A steady loop: after its first step, the steps are agreed in windows of 2, 4, 8, ...
    agree.stats.reset()
    it = meshkit.global_batches(
        (np.full((4, 2), 10 * i + me, np.float32) for i in range(steps)), mesh, "data"
    )
    sums = [float(b.sum()) for b in it]
    steady = {
        "sums_right": sums == [160.0 * i + 8.0 for i in range(steps)],
        "rpcs_per_step": agree.stats.rpcs / steps,
    }
    # A difference inside a window is named at its own step, as the per-step agreement names
    # it: the window falls back to agreeing its steps one by one.
    named = {}
    for at in (2, 3, 6, 13, 40):

        def loader(at=at):
            for i in range(60):
                rows = 4 if (me == 1 and i + 1 == at) else 8
                yield np.full((rows, 2), i, np.float32)

        taken = 0
        try:
            for _ in meshkit.global_batches(loader(), mesh, "data"):
                taken += 1
        except meshkit.MeshkitError as e:
            named[at] = (taken, str(e).splitlines()[0])
    meshkit.barrier("after the errors")
    return steady, named


def test_steps_are_agreed_in_windows_and_differences_named_at_their_step(warm_cluster):
    results = warm_cluster.run(_windows_agree_and_fall_back, timeout=180, env=_FAST_CHECK)
    for steady, named in results:
        assert steady["sums_right"], steady
        # 199 steps after the first in windows of 2, 4, ..., 32, then 32 (the cap with 2
        # processes): 2 + 4 + 8 + 16 + 32 = 62 steps, then 4 windows of 32, then the 9 steps
        # left with the end of every loader (agreed in one window too). 2 round trips per
        # window of up to 32 steps (more while the window grows), against 2 per step agreed
        # alone
        assert steady["rpcs_per_step"] < 0.5, steady
        for at, (taken, message) in named.items():
            assert taken == at - 1, (at, taken, message)
            assert message == (
                f"meshkit.global_batches: at step {at}, the processes' batches differ in rows "
                "before the end of their data: process 0's batch has 8 rows; process 1's batch "
                "has 4 rows; the loader of process 1 has more batches after it."
            ), (at, message)
    assert results[0][1] == results[1][1]


def _deferred_and_invalid():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    try:
        meshkit.global_array_from_local(np.ones((8, 3)), mesh, "data", check="later")
    except meshkit.MeshkitError as e:
        invalid = str(e)
    returned = []
    with meshkit.channel("deferred"):  # its own sequence of calls, numbered from 1
        try:
            for step in range(1, 6):
                rows = 4 if (me, step) == (1, 2) else 8
                local = np.ones((rows, 3), np.float32)
                meshkit.global_array_from_local(local, mesh, "data", check="deferred")
                returned.append(step)
            meshkit.barrier("end deferred")
        except meshkit.MeshkitError as e:
            return invalid, returned, str(e)
    return invalid, returned, "no error"


def test_deferred_check_returns_first_and_raises_later(warm_cluster):
    # The default check raises in the call that changed: tests/test_verified.py.
    results = warm_cluster.run(_deferred_and_invalid, timeout=120, env=_FAST_CHECK)
    for invalid, returned, error in results:
        assert invalid == (
            "meshkit.global_array_from_local: check must be True, False, 'data' or "
            "'deferred'; got 'later'."
        )
        assert 2 in returned  # the mismatched call returned in both processes
        assert "global_array_from_local (call #2, checked after it returned)" in error, error


def _deferred_call_that_fails():
    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    good = np.ones((8, 3), np.float32)
    with meshkit.channel("deferred-fails"):
        meshkit.global_array_from_local(good, mesh, "data", check="deferred")
        local = [object()] if jax.process_index() == 1 else good  # process 1: a bad leaf
        try:
            meshkit.global_array_from_local(local, mesh, "data", check="deferred")
            meshkit.barrier("after the failed call")  # verifies the pending calls first
        except Exception as e:  # what each process raised, to the test
            return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_deferred_call_that_fails_is_named_by_the_others_next_verification(warm_cluster):
    first, second = warm_cluster.run(_deferred_call_that_fails, timeout=120, env=_FAST_CHECK)
    assert "failed before the processes compared their data" in first, first
    assert "process 1: " in first, first
    assert "(call #2, checked after it returned)" in first, first
    assert second != "no error"  # process 1 raised its own error in the call


def _short_batches():
    import time

    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()

    def loader(sizes):
        for step, rows in enumerate(sizes):
            yield {"x": np.full((rows, 2), 10 * step + me, np.float32)}

    # (pad, process 0's batch sizes, process 1's): process 1 loses rows mid-stream or at its end.
    cases = {
        "pad, short mid-stream": (True, [8, 8, 8, 8], [8, 4, 8, 8]),
        "pad, short last": (True, [8, 8, 8], [8, 8, 4]),
        # One row: the same rows per device block (2) as 8 rows, told by the rows compared.
        "pad, one row short mid-stream": (True, [8, 8, 8], [8, 7, 8]),
        "ragged, short mid-stream": ("ragged", [8, 8, 8, 8], [8, 4, 8, 8]),
        "no pad, short last": (False, [8, 8, 8], [8, 8, 4]),
        "no pad, short mid-stream": (False, [8, 8, 8, 8], [8, 4, 8, 8]),
    }
    out = {}
    for name, (pad, mine, theirs) in cases.items():
        taken, real, error = 0, 0, None
        began = time.monotonic()
        try:
            for item in meshkit.global_batches(
                loader(mine if me == 0 else theirs), mesh, "data", pad=pad
            ):
                taken += 1
                if pad:
                    real += int(meshkit.gather(item[1]).sum())
        except meshkit.MeshkitError as e:
            error = str(e)
        out[name] = (taken, real, error)
        out[name + " s"] = time.monotonic() - began
    meshkit.barrier("after the short batches")  # every process goes on, in step
    return out


def test_only_a_loaders_last_batch_may_be_short(warm_cluster):
    results = warm_cluster.run(_short_batches, timeout=180, env=_FAST_CHECK)
    took = [{k: r.pop(k) for k in list(r) if k.endswith(" s")} for r in results]
    assert results[0] == results[1]
    out = results[0]
    midstream = (
        "meshkit.global_batches: at step 2, the processes' batches differ in rows before the end "
        "of their data: process 0's batch has 8 rows; process 1's batch has 4 rows; the loader "
        "of process 1 has more batches after it.\n"
    )
    taken, real, error = out["pad, short mid-stream"]
    assert (taken, real) == (1, 16)
    assert error.startswith(midstream), error
    # Two processes: no culprit named, and no padding offered (it would hide the lost rows).
    assert "the batches alone do not tell which process's loader is wrong" in error, error
    assert "Consider checking that the loaders make batches of one size" in error, error
    assert "ragged" not in error, error
    # The short last batch is padded: 8 + 8 + (8 + 4) real rows in 3 steps of 16. Its rows are
    # exchanged at once, not after barriers that only the service's timeout ends (2 + 4 s).
    assert out["pad, short last"] == (3, 44, None)
    assert max(t["pad, short last s"] for t in took) < 3.0, took
    assert out["pad, one row short mid-stream"][:2] == (1, 16)
    assert out["pad, one row short mid-stream"][2].startswith(
        "meshkit.global_batches: at step 2, the processes' batches differ in rows before the end "
        "of their data: process 0's batch has 8 rows; process 1's batch has 7 rows; the loader "
        "of process 1 has more batches after it."
    )
    assert out["ragged, short mid-stream"] == (4, 60, None)
    assert out["no pad, short last"] == (
        2,
        0,
        "meshkit.global_batches: at step 3, process 1's batch has 4 rows where process 0's batch "
        "has 8 rows; it is the loader's last batch.\nWith pad=False every step needs batches of "
        "one size from every process.\nConsider pad=True (the last step is padded; the mask "
        "marks the real rows), or dropping the short last batch on every process "
        "(drop_remainder).",
    )
    assert out["no pad, short mid-stream"][:2] == (1, 0)
    assert out["no pad, short mid-stream"][2] == error
