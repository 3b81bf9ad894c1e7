"""global_array_from_local, local_from_global, gather and global_batches in one process.

Property tests draw meshes over the 8 CPU devices, specs, shapes and dtypes (bfloat16 and int32
included) and pytrees of arrays, and compare with numpy: with one process the local data is the
whole array, so the global value must equal it. The multi-process behaviour (several
processes' parts, mismatches across processes) is in test_global_multiprocess.py.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import warnings
from typing import NamedTuple
from unittest import mock

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import MeshkitError
from meshkit._src.arrays import blocks as _blocks
from meshkit._src.core import caches as _caches
from meshkit._src.runtime import dispatch as _dispatch
from meshkit._src.sharding.specs import dim_axes
from meshkit.testing import strategies as mks


@st.composite
def trees(draw, mesh):
    """A dict of 1 to 3 arrays, each with its own spec, shape and dtype."""
    tree, specs = {}, {}
    for i in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(0, 3))
        spec = draw(mks.specs(mesh, ndim))
        shape = draw(mks.shapes_for(mesh, spec, ndim))
        tree[f"a{i}"] = draw(mks.arrays(shape, draw(st.sampled_from(mks.DTYPES))))
        specs[f"a{i}"] = spec
    return tree, specs


@given(data=st.data())
def test_global_value_round_trip_and_gather_match_numpy(data):
    mesh = data.draw(mks.meshes())
    tree, specs = data.draw(trees(mesh))
    g = meshkit.global_array_from_local(tree, mesh, specs)
    back = meshkit.local_from_global(g)
    gathered = meshkit.gather(g)
    at0 = meshkit.gather(g, to=0)
    for key, x in tree.items():
        assert g[key].dtype == x.dtype
        assert g[key].shape == x.shape
        assert dim_axes(g[key].sharding.spec, x.ndim) == dim_axes(specs[key], x.ndim)
        for shard in g[key].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])
        np.testing.assert_array_equal(back[key], x)
        assert back[key].dtype == x.dtype
        np.testing.assert_array_equal(gathered[key], x)
        np.testing.assert_array_equal(at0[key], x)


@given(data=st.data())
def test_pad_rounds_up_and_the_mask_marks_real_rows(data):
    mesh = data.draw(mks.meshes(axis_types=("auto",)))
    lead = data.draw(mks.axis_groups(mesh))
    spec = P(lead)
    n = NamedSharding(mesh, spec).num_devices // NamedSharding(mesh, P()).num_devices
    n = int(np.prod([mesh.shape[a] for a in dim_axes(spec, 1)[0]]))
    rows = data.draw(st.integers(0, 3 * n))
    x = np.arange(rows * 2, dtype=np.int32).reshape(rows, 2) + 1
    (g, mask) = meshkit.global_array_from_local({"x": x}, mesh, spec, pad=True)
    padded = -(-rows // n) * n
    assert g["x"].shape == (padded, 2)
    assert mask.shape == (padded,)
    assert dim_axes(mask.sharding.spec, 1) == dim_axes(spec, 1)
    np.testing.assert_array_equal(np.asarray(mask), np.arange(padded) < rows)
    expected = np.zeros((padded, 2), np.int32)
    expected[:rows] = x
    np.testing.assert_array_equal(np.asarray(g["x"]), expected)


def test_a_jit_output_reads_back_in_the_planned_layout():
    mesh = meshkit.make_mesh({"data": 4, "model": 2})
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    out = jax.jit(lambda a: a.T * 2, out_shardings=NamedSharding(mesh, P("model", "data")))(x)
    np.testing.assert_array_equal(meshkit.local_from_global(out), x.T * 2)
    np.testing.assert_array_equal(meshkit.gather({"y": out})["y"], x.T * 2)


@pytest.mark.parametrize("spec", ["data model", "model data", "_ data", ""])
def test_a_mesh_whose_devices_are_not_in_id_order_round_trips(spec):
    # The plan's placements are in JAX's device order (the mesh's), not by device id.
    devices = np.array(jax.devices())[[3, 1, 7, 0, 5, 2, 6, 4]].reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    g = meshkit.global_array_from_local(x, mesh, spec)
    np.testing.assert_array_equal(np.asarray(g), x)
    np.testing.assert_array_equal(meshkit.local_from_global(g), x)


class Batch(NamedTuple):
    image: np.ndarray
    label: np.ndarray


def test_namedtuple_python_scalars_and_jax_arrays_as_leaves():
    mesh = meshkit.make_mesh({"data": 8})
    local = Batch(image=jax.numpy.ones((8, 2)), label=np.arange(8, dtype=np.int32))
    g = meshkit.global_array_from_local(local, mesh, Batch("data", "data"))
    assert isinstance(g, Batch)
    assert g.image.sharding.spec == P("data")
    scalars = meshkit.global_array_from_local({"step": 3, "lr": 0.5, "on": True}, mesh, "")
    assert {k: v.dtype.name for k, v in scalars.items()} == {
        "step": "int32",
        "lr": "float32",
        "on": "bool",
    }


def test_a_spec_string_with_dimension_names_is_checked_against_the_rank():
    mesh = meshkit.make_mesh({"data": 8})
    g = meshkit.global_array_from_local(np.zeros((8, 2), np.float32), mesh, "batch feat -> data _")
    assert g.sharding.spec == P("data", None)
    with pytest.raises(
        MeshkitError, match=r"names 1 dimension, but the array at \(the array\) has shape \(8, 2\)"
    ):
        meshkit.global_array_from_local(np.zeros((8, 2), np.float32), mesh, "b -> data")


def test_not_divisible_names_the_dimension_and_suggests_pad():
    mesh = meshkit.make_mesh({"data": 4, "model": 2})
    with pytest.raises(MeshkitError) as info:
        meshkit.global_array_from_local(
            {"x": np.zeros((6, 3), np.float32)}, mesh, "batch f -> data _"
        )
    message = str(info.value)
    assert (
        "the local array at ['x'] has shape (6, 3); its dimension 0 ('batch') has size 6" in message
    )
    assert "process 0's devices hold 4 of those blocks" in message
    assert "Consider pad=True" in message
    with pytest.raises(
        MeshkitError, match=r"its dimension 1 has size 3,.*\n.*\n.*\nConsider a size divisible by 2"
    ):
        meshkit.global_array_from_local(np.zeros((4, 3), np.float32), mesh, "_ model")


@pytest.mark.parametrize(
    ("local", "spec", "kwargs", "message"),
    [
        (
            np.zeros((8,)),
            "nope",
            {},
            r"spec: the mesh has no axis 'nope' \(in the spec string 'nope'\)",
        ),
        (
            np.zeros((8,)),
            P("data", None),
            {},
            r"the spec P\('data', None\) for \(the array\) has 2 entries, but the array has shape \(8,\) \(1 dimensions\)",
        ),
        (
            {"s": "hello"},
            "",
            {},
            r"the leaf at \['s'\] is of type str \('hello'\), not an array; global arrays hold numbers",
        ),
        ({"o": object()}, "", {}, r"the leaf at \['o'\] is of type object \(<object object at"),
        (
            np.array(["a", "b"]),
            "",
            {},
            r"an array of dtype <U1; global arrays hold numbers or booleans",
        ),
        (
            np.zeros((8, 2), np.float32),
            "data",
            {"global_shape": (16, 2)},
            r"global_shape \(16, 2\) for \(the array\) does not match the local data: the local array has shape \(8, 2\), and process 0 holds 8 of the 8 blocks of dimension 0, so that dimension's global size is 8 / 8 \* 8 = 8, not 16",
        ),
        (
            np.zeros((8, 2), np.float32),
            "data",
            {"global_shape": (8,)},
            r"global_shape \(8,\) for \(the array\) has 1 dimensions, but the local array has shape \(8, 2\)",
        ),
        (
            {"a": np.zeros(8), "b": np.zeros(8)},
            "data",
            {"global_shape": (8,)},
            r"global_shape=\(8,\) is one shape, but local holds 2 arrays",
        ),
        (
            np.zeros((12, 2), np.float32),
            "data",
            {"pad": True, "global_shape": (8, 2)},
            r"global_shape \(8, 2\) for \(the array\) leaves process 0 room for 8 rows of its 12 \(it holds 8 of the 8 blocks of dimension 0\).\nConsider a leading size that is a multiple of 8 and at least 16",
        ),
        (
            np.zeros((12, 2), np.float32),
            "data",
            {"pad": True, "global_shape": (20, 2)},
            r"room for \(not a whole number of\) rows",
        ),
        (
            {"a": np.zeros((8, 2)), "b": np.zeros((4,))},
            "data",
            {"pad": True, "dtype": np.float32},
            r"pad=True needs every array to share the leading \(batch\) dimension",
        ),
        ({}, "data", {}, r"local holds no arrays"),
    ],
)
def test_bad_input_is_named(local, spec, kwargs, message):
    mesh = meshkit.make_mesh({"data": 8})
    with pytest.raises(MeshkitError, match=message):
        meshkit.global_array_from_local(local, mesh, spec, **kwargs)


def test_mesh_sharding_and_spec_arguments_are_checked():
    mesh = meshkit.make_mesh({"data": 8})
    x = np.zeros((8,), np.float32)
    with pytest.raises(
        MeshkitError, match=r"with a Mesh, spec= says how the global array is split"
    ):
        meshkit.global_array_from_local(x, mesh)
    with pytest.raises(
        MeshkitError, match=r"spec= was given with a NamedSharding, which already holds its spec"
    ):
        meshkit.global_array_from_local(x, NamedSharding(mesh, P("data")), "data")
    with pytest.raises(
        MeshkitError,
        match=r"mesh_or_sharding must be a jax.sharding.Mesh \(with spec=\) or a NamedSharding; got list",
    ):
        meshkit.global_array_from_local(x, [mesh], "data")
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit\.global_array_from_local: spec: the spec is a dict with keys \{'b'\} "
        r"but local is a dict with keys \{'a'\}: missing 'a'; extra 'b'$",
    ):
        meshkit.global_array_from_local({"a": x}, mesh, {"b": "data"})
    g = meshkit.global_array_from_local(x, NamedSharding(mesh, P("data")))
    assert g.sharding == NamedSharding(mesh, P("data"))


def test_a_given_global_shape_that_fits_is_accepted():
    mesh = meshkit.make_mesh({"data": 4, "model": 2})
    g = meshkit.global_array_from_local(
        {"a": np.ones((8, 2), np.float32)}, mesh, "data", global_shape={"a": (8, 2)}
    )
    assert g["a"].shape == (8, 2)
    (g, mask) = meshkit.global_array_from_local(
        np.ones((5, 2), np.float32), mesh, "data", pad=True, global_shape=(12, 2)
    )
    assert g.shape == (12, 2)
    assert int(mask.sum()) == 5


def test_64_bit_data_warns_once_and_dtype_casts_silently(monkeypatch):
    monkeypatch.setattr(_blocks, "_warned_dtypes", set())
    mesh = meshkit.make_mesh({"data": 8})
    x = np.arange(8, dtype=np.float64)
    with pytest.warns(
        meshkit.DtypeWarning,
        match=r"the data at \(the array\) is float64, but JAX's 64-bit mode is off, so the global array is float32",
    ) as caught:
        g = meshkit.global_array_from_local(x, mesh, "data")
    assert caught[0].filename == __file__  # points at the caller's line
    assert g.dtype == np.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meshkit.global_array_from_local(x, mesh, "data")  # shown once per dtype
        g = meshkit.global_array_from_local(x, mesh, "data", dtype=np.int32)
        assert g.dtype == np.int32
        assert (
            meshkit.global_array_from_local(x, mesh, "data", dtype="bfloat16").dtype.name
            == "bfloat16"
        )


def test_a_dtype_warning_of_a_call_that_fails_is_given_by_the_next_call(monkeypatch):
    monkeypatch.setattr(_blocks, "_warned_dtypes", set())
    mesh = meshkit.make_mesh({"data": 8})
    x = np.arange(8, dtype=np.float64)
    bad = {"x": x, "y": np.ones(7, np.float32)}  # 7 rows do not split over 8 devices
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(meshkit.MeshkitError, match="does not split"):
            meshkit.global_array_from_local(bad, mesh, "data")
    with pytest.warns(meshkit.DtypeWarning, match=r"is float64, but JAX's 64-bit mode is off"):
        meshkit.global_array_from_local({"x": x}, mesh, "data")


def test_a_layout_seen_before_reuses_its_template_and_any_change_makes_a_new_one(monkeypatch):
    monkeypatch.setattr(_blocks, "_templates", _caches.Cache(maxsize=64))
    monkeypatch.setattr(_blocks, "_warned_dtypes", set())
    mesh = meshkit.make_mesh({"data": 4, "model": 2})
    rng = np.random.default_rng(0)

    def assemble(x, spec="data", **kwargs):
        g = meshkit.global_array_from_local(x, mesh, spec, **kwargs)
        for leaf, ref in zip(jax.tree.leaves(g), jax.tree.leaves(x), strict=True):
            want = np.asarray(ref).astype(leaf.dtype)
            for shard in leaf.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
            np.testing.assert_array_equal(np.asarray(leaf), want)
        return g

    x = rng.standard_normal((16, 4)).astype(np.float32)
    assemble(x)
    assert len(_blocks._templates) == 1
    (template,) = _blocks._templates._data.values()
    with mock.patch.object(_blocks, "prepare_leaves", side_effect=AssertionError("planned")):
        g = assemble(x + 1)  # new values, same layout: the template, and this call's values
    assert g.sharding.spec == P("data")
    assert list(_blocks._templates._data.values()) == [template]
    # Each input the plan depends on makes another template.
    assemble(x[:8])  # shape
    assemble(x.astype(np.int32))  # dtype
    assemble(x, "data model")  # spec
    assemble(x, P(None, None))  # spec
    assemble(x, global_shape=(16, 4))  # a given global shape
    assemble(x, dtype="bfloat16")  # a cast
    assemble({"a": x, "b": x[:, 0]})  # structure
    assert len(_blocks._templates) == 8
    # Not cached: a spec tree, jax arrays, pad=True, a global shape as a list.
    assemble({"a": x, "b": x[:, 0]}, {"a": "data", "b": "data"})
    assemble(jax.numpy.asarray(x))
    meshkit.global_array_from_local(x[:13], mesh, "data", pad=True)
    assemble(x, global_shape=[16, 4])
    assert len(_blocks._templates) == 8
    # 64-bit data: narrowed (warned once per dtype, from a template too), or kept under x64.
    wide = rng.standard_normal(16)
    with pytest.warns(meshkit.DtypeWarning, match="is float64, but JAX's 64-bit mode is off"):
        assert assemble(wide).dtype == np.float32
    monkeypatch.setattr(_blocks, "_warned_dtypes", set())  # as if this process never warned
    with pytest.warns(meshkit.DtypeWarning, match="is float64, but JAX's 64-bit mode is off"):
        assert assemble(wide).dtype == np.float32  # from the template
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert assemble(wide).dtype == np.float32  # shown once
        with jax.enable_x64(True):
            assert assemble(wide).dtype == np.float64


def test_the_dispatch_choke_point_sees_every_call():
    mesh = meshkit.make_mesh({"data": 8})
    seen = []
    with _dispatch.observing(lambda site, args: seen.append(site.kind)):
        meshkit.global_array_from_local(np.zeros(8, np.float32), mesh, "data")
    assert seen == ["global_array_from_local"]


def test_gather_rejects_a_process_that_does_not_exist():
    mesh = meshkit.make_mesh({"data": 8})
    g = meshkit.global_array_from_local(np.zeros(8, np.float32), mesh, "data")
    for bad in (1, -1, True, "0"):
        with pytest.raises(
            MeshkitError, match=r"to=.* is not a process; the program has 1 process \(0 to 0\)"
        ):
            meshkit.gather(g, to=bad)
    with pytest.raises(
        MeshkitError, match=r"the leaf at \['x'\] is of type ndarray, not a jax.Array"
    ):
        meshkit.gather({"x": np.zeros(3)})
    # numpy is this process's data already: local_from_global gives it back (a legacy
    # ``tohost`` is called on pmap outputs and on numpy batches alike).
    back = meshkit.local_from_global({"x": np.arange(3), "g": g, "s": np.float32(2)})
    assert back["x"].tolist() == [0, 1, 2]
    assert back["g"].shape == (8,)
    assert back["s"] == np.float32(2)
    with pytest.raises(MeshkitError, match=r"the leaf at \['t'\] is of type str, not a jax.Array"):
        meshkit.local_from_global({"t": "text"})


def test_global_batches_yield_in_order_and_count():
    mesh = meshkit.make_mesh({"data": 4, "model": 2})
    loader = ({"x": np.full((8, 2), i, np.float32)} for i in range(5))
    it = meshkit.global_batches(loader, mesh, "data")
    values = [float(b["x"][0, 0]) for b in it]
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert (it.steps, it.rows) == (5, 40)
    assert it.rows_per_second > 0
    with pytest.raises(StopIteration):
        next(it)


def test_global_batches_assemble_at_most_prefetch_ahead():
    mesh = meshkit.make_mesh({"data": 8})
    pulled = []

    def loader():
        for i in range(20):
            pulled.append(i)
            yield np.full((8,), i, np.float32)

    with meshkit.global_batches(loader(), mesh, "data", prefetch=3) as it:
        first = next(it)
        time.sleep(0.5)  # ample time for the helper to run ahead if it were unbounded
        # One handed out, 3 assembled and waiting, and the helper blocked before pulling more.
        assert len(pulled) == 4
        assert float(first[0]) == 0.0
    time.sleep(0.3)
    assert not any(
        t.name == "meshkit-global-batches" and t.is_alive() for t in threading.enumerate()
    )


def test_global_batches_pad_uneven_batches():
    mesh = meshkit.make_mesh({"data": 8})
    loader = (np.ones((rows, 2), np.float32) for rows in (8, 8, 5))
    out = [
        (b.shape, int(m.sum())) for b, m in meshkit.global_batches(loader, mesh, "data", pad=True)
    ]
    assert out == [((8, 2), 8), ((8, 2), 8), ((8, 2), 5)]


def test_a_loader_error_reaches_the_caller_with_its_traceback():
    mesh = meshkit.make_mesh({"data": 8})

    def broken_loader():
        yield np.zeros(8, np.float32)
        raise OSError("disk went away")

    it = meshkit.global_batches(broken_loader(), mesh, "data")
    next(it)
    with pytest.raises(OSError, match="disk went away") as info:
        next(it)
    assert any(frame.name == "broken_loader" for frame in info.traceback)


def test_stop_together_must_be_a_bool():
    mesh = meshkit.make_mesh({"data": 8})
    with pytest.raises(MeshkitError, match="stop_together must be True or False; got 'yes'"):
        meshkit.global_batches(iter([]), mesh, "data", stop_together="yes")


def test_a_bad_batch_raises_in_the_caller_naming_global_batches():
    mesh = meshkit.make_mesh({"data": 8})
    it = meshkit.global_batches(iter([np.zeros(8), np.zeros(7)]), mesh, "data", dtype=np.float32)
    next(it)
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.global_batches: the local array at \(the array\) has shape \(7,\); its dimension 0 has size 7",
    ):
        next(it)


def test_a_dtype_warning_from_global_batches_points_at_the_loop(monkeypatch):
    monkeypatch.setattr(_blocks, "_warned_dtypes", set())
    mesh = meshkit.make_mesh({"data": 8})
    dtypes = []
    # The warning must come from the `for` statement itself (the iterator's __next__).
    with pytest.warns(  # noqa: PT031
        meshkit.DtypeWarning, match=r"^meshkit.global_batches: the data at \(the array\) is float64"
    ) as caught:
        for batch in meshkit.global_batches([np.zeros(8)], mesh, "data"):
            dtypes.append(batch.dtype)
    assert dtypes == [np.float32]
    assert [w.filename for w in caught] == [__file__]


def test_global_batches_arguments_are_checked():
    mesh = meshkit.make_mesh({"data": 8})
    with pytest.raises(
        MeshkitError, match=r"prefetch must be a positive int \(batches assembled ahead\); got 0"
    ):
        meshkit.global_batches([], mesh, "data", prefetch=0)
    with pytest.raises(
        MeshkitError, match=r"progress must be None or a positive number of seconds"
    ):
        meshkit.global_batches([], mesh, "data", progress=0)
    with pytest.raises(MeshkitError, match=r"expected an iterable of per-process batches; got int"):
        meshkit.global_batches(3, mesh, "data")


def test_progress_reports_steps_and_rate(caplog):
    caplog.set_level(logging.INFO, logger="meshkit")
    mesh = meshkit.make_mesh({"data": 8})
    list(
        meshkit.global_batches(
            (np.zeros(8, np.float32) for _ in range(3)), mesh, "data", progress=1e-6
        )
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "meshkit.arrays"]
    assert lines[-1].startswith("meshkit.global_batches: done, step 3, 24 rows, ")
    assert re.search(r"running, step 1, 8 rows, [\d,]+ rows/s", lines[0])
