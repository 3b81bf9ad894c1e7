"""meshkit.checkpoint in one process (8 CPU devices): round trips onto other meshes, bad inputs.

The classification of an array against a target mesh (`meshkit._src.checkpoint.restore_plan`) is checked
against JAX itself: a layout meshkit accepts is one `jax.device_put` accepts, and the other way
round. Saving from 2 processes, restoring onto other meshes and process counts, process-local
arrays and a rank killed mid-save are in test_checkpoint_multiprocess.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import require
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import MeshkitError
from meshkit._src.checkpoint.restore_plan import describe_mesh, plan_targets
from meshkit._src.sharding.specs import layout_problem
from meshkit.testing import strategies as mks


@pytest.fixture(autouse=True)
def _orbax():
    require("orbax.checkpoint", "orbax")


def _reference(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((16, 8)).astype(np.float32),
        "b": np.arange(8, dtype=np.int32),
        "host": rng.standard_normal(5),
        "step": 7,
    }


def _saved(tmp_path, name="c"):
    """The reference saved from a 2 x 4 mesh: w split over both axes, b over 'model'."""
    ref = _reference()
    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    tree = {
        "w": meshkit.global_array_from_local(ref["w"], mesh, "data model"),
        "b": meshkit.global_array_from_local(ref["b"], mesh, "model"),
        "host": ref["host"],
        "step": ref["step"],
    }
    path = tmp_path / name
    meshkit.checkpoint.save(path, tree)
    return path, ref


def _assert_shards(x, reference):
    assert x.shape == reference.shape
    for shard in x.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), reference[shard.index])


@pytest.mark.parametrize(
    ("axes", "specs", "expected"),
    [
        ({"data": 2, "model": 4}, None, {"w": P("data", "model"), "b": P("model")}),
        ({"data": 1, "model": 8}, None, {"w": P("data", "model"), "b": P("model")}),
        ({"data": 8, "model": 1}, None, {"w": P("data", "model"), "b": P("model")}),
        ({"x": 8}, {"w": "_ x", "b": "x"}, {"w": P(None, "x"), "b": P("x")}),
        ({"x": 4, "y": 2}, {"w": "(x y)", "b": ""}, {"w": P(("x", "y")), "b": P()}),
    ],
    ids=["as-saved", "1x8", "8x1", "other-axes", "combined-axes"],
)
def test_restore_onto_other_meshes_gives_the_saved_values(tmp_path, axes, specs, expected):
    path, ref = _saved(tmp_path)
    mesh = meshkit.make_mesh(axes)
    if specs is not None:
        specs = {**specs, "host": None, "step": None}
    out = meshkit.checkpoint.restore(path, mesh, specs)
    for key in ("w", "b"):
        assert out[key].sharding == NamedSharding(mesh, expected[key])
        _assert_shards(out[key], ref[key])
    np.testing.assert_array_equal(out["host"], ref["host"])  # host values come back as saved
    assert isinstance(out["host"], np.ndarray)
    assert out["step"] == 7
    assert isinstance(out["step"], int)


def test_one_spec_for_every_array_and_host_values_placed_on_request(tmp_path):
    path, ref = _saved(tmp_path)
    mesh = meshkit.make_mesh({"x": 8})
    out = meshkit.checkpoint.restore(path, mesh, {"w": "x", "b": "x", "host": "", "step": None})
    _assert_shards(out["w"], ref["w"])
    assert out["w"].sharding.spec == P("x")
    assert isinstance(out["host"], jax.Array)
    assert out["host"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(out["host"]), ref["host"].astype(out["host"].dtype))
    every = meshkit.checkpoint.targets(path, mesh, "")  # one spec: every leaf, replicated
    assert {k: v.sharding.spec for k, v in every.items()} == dict.fromkeys(every, P())


def test_an_array_saved_from_one_device_is_replicated_unless_a_spec_is_given(tmp_path):
    x = jax.device_put(np.arange(16, dtype=np.float32), jax.devices()[3])
    meshkit.checkpoint.save(tmp_path / "c", {"x": x})
    mesh = meshkit.make_mesh({"x": 8})
    out = meshkit.checkpoint.restore(tmp_path / "c", mesh)
    assert out["x"].sharding == NamedSharding(mesh, P())
    _assert_shards(out["x"], np.arange(16, dtype=np.float32))
    split = meshkit.checkpoint.restore(tmp_path / "c", mesh, "x")
    assert split["x"].sharding == NamedSharding(mesh, P("x"))
    _assert_shards(split["x"], np.arange(16, dtype=np.float32))


def test_targets_accepts_metadata_and_abstract_trees(tmp_path):
    ocp = require("orbax.checkpoint", "orbax")
    path, _ = _saved(tmp_path)
    mesh = meshkit.make_mesh({"data": 1, "model": 8})
    checkpointer = ocp.StandardCheckpointer()
    try:
        from_metadata = meshkit.checkpoint.targets(checkpointer.metadata(path), mesh)
    finally:
        checkpointer.close()
    from_path = meshkit.checkpoint.targets(path, mesh)
    assert jax.tree_util.tree_structure(from_metadata) == jax.tree_util.tree_structure(from_path)
    assert from_metadata["w"] == from_path["w"]
    abstract = {"w": jax.ShapeDtypeStruct((16, 8), np.float32), "n": np.zeros(3)}
    made = meshkit.checkpoint.targets(abstract, mesh, {"w": "_ model", "n": None})
    assert made["w"].sharding == NamedSharding(mesh, P(None, "model"))
    assert isinstance(made["n"], np.ndarray)


def test_with_orbax_checkpoint_manager(tmp_path):
    ocp = require("orbax.checkpoint", "orbax")
    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    ref = _reference()
    state = {"w": meshkit.global_array_from_local(ref["w"], mesh, "data model"), "step": 3}
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
        meshkit.checkpoint.check_savable(state)
        manager.save(3, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        other = meshkit.make_mesh({"data": 8, "model": 1})
        abstract = meshkit.checkpoint.targets(manager.item_metadata(3), other)
        back = manager.restore(3, args=ocp.args.StandardRestore(abstract))
    _assert_shards(back["w"], ref["w"])
    assert back["w"].sharding.mesh.shape == other.shape
    assert back["step"] == 3
    # The step's item directory reads with restore too; the step directory says where it is.
    np.testing.assert_array_equal(
        np.asarray(meshkit.checkpoint.restore(tmp_path / "run" / "3" / "default", other)["w"]),
        ref["w"],
    )
    with pytest.raises(MeshkitError, match=r"has no _METADATA file\).\nConsider '.*/3/default'"):
        meshkit.checkpoint.restore(tmp_path / "run" / "3", other)


# ---- bad inputs --------------------------------------------------------------------------------


def test_a_dimension_the_mesh_does_not_divide_names_array_shape_spec_mesh_and_rule(tmp_path):
    path, _ = _saved(tmp_path)
    devices = np.array(jax.devices()[:6]).reshape(3, 2)
    mesh = Mesh(devices, ("data", "model"))  # 6 devices: 16 rows do not split 3 ways
    with pytest.raises(MeshkitError) as info:
        meshkit.checkpoint.restore(path, mesh)
    text = str(info.value)
    assert text.startswith(
        "meshkit.checkpoint.restore: the checkpoint's array ['w'] (saved shape (16, 8), float32) "
        "cannot be restored with "
    ), text
    assert "(the spec it was saved with) on the mesh {'data': 3, 'model': 2} (6 devices)" in text
    assert (
        "dimension 0 (size 16) is split over the mesh axis 'data' (size 3), and 16 is not a "
        "multiple of 3: every device must hold an equal block." in text
    )
    assert "Consider a mesh whose axes splitting dimension 0 have sizes multiplying to " in text
    assert "1, 2, 4, 8 or 16, or a spec that leaves dimension 0 whole" in text
    assert "restore(..., specs=...)" in text
    # the same from targets (what orbax's CheckpointManager users call)
    with pytest.raises(MeshkitError, match=r"^meshkit.checkpoint.targets: the checkpoint's array"):
        meshkit.checkpoint.targets(path, mesh)


def test_combined_axes_and_a_given_spec_in_the_message(tmp_path):
    path, _ = _saved(tmp_path)
    mesh = meshkit.make_mesh({"x": 4, "y": 2})
    specs = {"w": "_ (x y)", "b": "(x y)", "host": "(y x)", "step": None}
    with pytest.raises(MeshkitError) as info:
        meshkit.checkpoint.restore(path, mesh, specs)
    text = str(info.value)
    assert "the checkpoint's array ['host'] (saved shape (5,), float64)" in text, text
    assert "(the spec string '(y x)') on the mesh {'x': 4, 'y': 2} (8 devices)" in text
    assert "dimension 0 (size 5) is split over the mesh axes ('y', 'x') (2 x 4 = 8), and 5 " in text
    assert (
        "Consider a mesh whose axes splitting dimension 0 have sizes multiplying to 1 or 5" in text
    )
    assert "specs=..." not in text  # the spec was the user's own


def test_saved_axes_the_mesh_lacks_and_specs_that_do_not_fit(tmp_path):
    path, _ = _saved(tmp_path)
    mesh = meshkit.make_mesh({"x": 8})
    with pytest.raises(MeshkitError) as info:
        meshkit.checkpoint.restore(path, mesh)
    text = str(info.value)
    assert "array ['b'] (saved shape (8,), int32)" in text  # leaves in orbax's (sorted) order
    assert "the spec names the mesh axis 'model', which the mesh does not have (its axes: 'x')" in (
        text
    )
    assert "Consider a spec over the mesh's axes, or a mesh with an axis 'model'." in text
    with pytest.raises(MeshkitError, match=r"array \['b'\] .* the spec has 2 entries but the array "
                       r"has 1 dimension\.\nConsider a spec with at most one entry"):  # fmt: skip
        meshkit.checkpoint.restore(path, mesh, {"w": "x", "b": "x _", "host": None, "step": None})
    with pytest.raises(MeshkitError, match=r"uses the mesh axis 'x' twice"):
        meshkit.checkpoint.restore(path, mesh, {"w": P("x", "x"), "b": "x", "host": None,
                                                "step": None})  # fmt: skip
    with pytest.raises(MeshkitError, match=r"bad spec string 'x\)'"):
        meshkit.checkpoint.restore(path, mesh, "x)")
    with pytest.raises(MeshkitError) as info:
        meshkit.checkpoint.restore(path, mesh, {"w": "x"})
    assert str(info.value).startswith(
        "meshkit.checkpoint.restore: specs is not a prefix of the checkpoint's tree: at the top "
        "specs has a dict with keys {'w'}, the checkpoint a dict with keys {'b', 'host', 'step', "
        "'w'}.\nConsider one spec for every array"
    ), str(info.value)
    with pytest.raises(MeshkitError, match=r"mesh must be a jax.sharding.Mesh; got dict"):
        meshkit.checkpoint.restore(path, {"x": 8})


def test_no_checkpoint_an_unfinished_one_and_a_path_of_the_wrong_type(tmp_path):
    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    with pytest.raises(MeshkitError, match=r"there is no checkpoint at .*/nothing\.\nConsider"):
        meshkit.checkpoint.restore(tmp_path / "nothing", mesh)
    # What a process killed mid-save leaves: orbax's temporary directory, never renamed.
    unfinished = tmp_path / ("step_2" + ".orbax-checkpoint-tmp")
    unfinished.mkdir()
    with pytest.raises(MeshkitError) as info:
        meshkit.checkpoint.restore(unfinished, mesh)
    assert "is a checkpoint that was never completed (orbax's temporary directory" in str(
        info.value
    )
    with pytest.raises(MeshkitError) as info:
        meshkit.checkpoint.restore(tmp_path / "step_2", mesh)
    assert re.search(
        r"no checkpoint at .*/step_2; only 'step_2.orbax-checkpoint-tmp' is there, a save of it "
        "that never completed",
        str(info.value),
    ), str(info.value)
    with pytest.raises(MeshkitError, match=r"only 'step_2.orbax-checkpoint-tmp' is there"):
        meshkit.checkpoint.restore(tmp_path / "step_2" / "default", mesh)
    with pytest.raises(MeshkitError, match=r"path must be a str or os.PathLike; got int"):
        meshkit.checkpoint.restore(3, mesh)


def test_save_refuses_an_existing_directory_and_what_is_not_an_array(tmp_path):
    path, _ = _saved(tmp_path)
    before = sorted(p.name for p in path.rglob("*"))
    with pytest.raises(MeshkitError) as info:
        meshkit.checkpoint.save(path, {"x": np.zeros(3)})
    assert f"meshkit.checkpoint.save: {path} exists already" in str(info.value)
    assert "Consider one directory per step" in str(info.value)
    assert sorted(p.name for p in path.rglob("*")) == before  # untouched
    with pytest.raises(MeshkitError, match=r"the leaf \['name'\] is a str; a checkpoint holds"):
        meshkit.checkpoint.save(tmp_path / "s", {"x": np.zeros(3), "name": "run 1"})
    with pytest.raises(MeshkitError, match=r"the leaf \['t'\] is an array of dtype <U1"):
        meshkit.checkpoint.save(tmp_path / "s", {"t": np.array(["a"])})
    with pytest.raises(MeshkitError, match=r"a single ndarray.\nConsider saving \{'x': x\}"):
        meshkit.checkpoint.save(tmp_path / "s", np.zeros(3))
    assert not (tmp_path / "s").exists()
    with pytest.raises(MeshkitError, match=r"the leaf \['name'\] is a str"):
        meshkit.checkpoint.check_savable({"name": "run 1"})


# ---- the classification against JAX ------------------------------------------------------------


@st.composite
def any_specs(draw, mesh, ndim):
    """Specs that may break a rule: too long, an unknown axis, an axis twice."""
    names = [*mesh.axis_names, "nope"]
    entries = []
    for _ in range(draw(st.integers(0, ndim + 1))):
        group = draw(st.lists(st.sampled_from(names), max_size=2))
        entries.append(None if not group else group[0] if len(group) == 1 else tuple(group))
    return P(*entries)


def _jax_accepts(shape, mesh, spec):
    try:
        jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))
    except Exception:  # the reference: any refusal of JAX's, whatever its class
        return False
    return True


@given(data=st.data())
def test_layout_rules_are_jaxs(data):
    mesh = data.draw(mks.meshes())
    ndim = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim)))
    spec = data.draw(any_specs(mesh, ndim))
    found = layout_problem(shape, spec, dict(mesh.shape))
    assert (found is None) == _jax_accepts(shape, mesh, spec), (shape, spec, mesh.shape, found)
    # A leaf of orbax's metadata: its sharding's partition_spec (here one JAX would refuse).
    saved = SimpleNamespace(partition_spec=tuple(spec))
    tree = {"a": {"b": SimpleNamespace(shape=shape, dtype=np.float32, sharding=saved)}}
    if found is None:
        assert plan_targets(tree, mesh, None, "f")[0]["a"]["b"].sharding.spec == spec
        return
    rule, fix = found
    assert fix.startswith("Consider ")
    with pytest.raises(MeshkitError) as info:
        plan_targets(tree, mesh, None, "f")
    text = str(info.value)
    assert f"array ['a']['b'] (saved shape {shape}, float32)" in text
    assert describe_mesh(dict(mesh.shape)) in text
    assert rule in text
    assert fix in text


@settings(max_examples=6)
@given(data=st.data())
def test_round_trip_between_random_meshes_and_specs(tmp_path_factory, data):
    mesh, spec, x = data.draw(mks.sharded_arrays(dtypes=("float32", "int32")))
    target = data.draw(mks.meshes())
    new_spec = data.draw(mks.specs(target, x.ndim))
    fits = layout_problem(x.shape, new_spec, dict(target.shape)) is None
    path = tmp_path_factory.mktemp("round") / "c"
    meshkit.checkpoint.save(path, {"x": meshkit.global_array_from_local(x, mesh, spec)})
    if not fits:
        with pytest.raises(MeshkitError, match="cannot be restored with"):
            meshkit.checkpoint.restore(path, target, {"x": new_spec})
        return
    out = meshkit.checkpoint.restore(path, target, {"x": new_spec})["x"]
    assert out.sharding == NamedSharding(target, new_spec)
    _assert_shards(out, x)


def test_the_first_entry_that_differs_is_named_with_a_process_on_each_side():
    from meshkit._src.checkpoint.orbax import _difference

    a, b = ["the leaf ['w']", "array", "shape (8,)"], ["the leaf ['w']", "array", "shape (4,)"]
    path = ["the directory", "path", "/c"]
    records = {p: {"entries": [path, a]} for p in (0, 1)} | {2: {"entries": [path, b]}}
    said = _difference("meshkit.checkpoint.save", records, "save the same tree")
    assert said.startswith(
        "meshkit.checkpoint.save: processes 0 and 2 differ at the leaf ['w']: shape (8,) on "
        "process 0, shape (4,) on process 2.\nEvery process must save the same tree.\n"
        "Consider computing what differs"
    ), said
    records[2] = {"entries": [path, a, b]}  # one more leaf
    said = _difference("meshkit.checkpoint.save", records, "save the same tree")
    assert said == (
        "meshkit.checkpoint.save: process 0 has 1 leaves, process 2 has 2.\n"
        "Every process must save the same tree."
    )
