"""meshkit.spmd: inputs of every kind, mesh axis types, set_mesh, jit, decorator, lower, dispatch."""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import MeshkitError, ReshardWarning
from meshkit import collectives as C
from meshkit._src.runtime import dispatch as _dispatch
from meshkit.testing import assert_spmd_matches_reference, reference_spmd
from meshkit.testing import strategies as mks

AXIS_TYPES = ["auto", "explicit"]


def _mesh(kind: str) -> jax.sharding.Mesh:
    return meshkit.make_mesh({"data": 2, "model": 4}, axis_types=kind)


def _row_sums(block):
    return C.psum(block.sum(axis=1, keepdims=True), "model")


def _expected(x):
    return np.asarray(x, np.float32).sum(axis=1, keepdims=True)


@pytest.fixture(params=AXIS_TYPES)
def mesh(request):
    return _mesh(request.param)


def _f(mesh):
    return meshkit.spmd(
        _row_sums, mesh=mesh, in_specs="batch feat -> data model", out_specs="data _"
    )


def test_host_data_is_placed(mesh):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    out = _f(mesh)(x)
    np.testing.assert_array_equal(np.asarray(out), _expected(x))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


def test_python_scalars_are_host_data(mesh):
    f = meshkit.spmd(lambda a, s: a * s, mesh=mesh, in_specs=("data", P()), out_specs="data")
    np.testing.assert_array_equal(np.asarray(f(np.ones(4, np.float32), 3.0)), [3.0] * 4)


def test_single_device_arrays_are_placed_without_warning(mesh):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    for value in (jnp.asarray(x), jax.device_put(x, jax.devices()[3])):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = _f(mesh)(value)
        np.testing.assert_array_equal(np.asarray(out), _expected(x))


def test_arrays_laid_out_right_pass_without_a_copy(mesh, monkeypatch):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    placed = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    f = _f(mesh)
    f(placed)  # compile

    def no_device_put(*a, **k):
        raise AssertionError("spmd moved an input that was already laid out right")

    monkeypatch.setattr(jax, "device_put", no_device_put)
    monkeypatch.setattr(jax, "make_array_from_callback", no_device_put)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = f(placed)
    np.testing.assert_array_equal(np.asarray(out), _expected(x))


def _placements(monkeypatch) -> list[int]:
    """The calls that go through placement from now on: their number of arguments, in order."""
    placing: list[int] = []
    slow = meshkit.SpmdFunction._enter
    monkeypatch.setattr(
        meshkit.SpmdFunction,
        "_enter",
        lambda self, a, k: placing.append(len(a)) or slow(self, a, k),
    )
    return placing


def test_placed_calls_go_straight_to_jit_and_any_other_call_is_placed(mesh, monkeypatch):
    f = meshkit.spmd(lambda a: a * 2, mesh=mesh, in_specs="data model", out_specs="data model")
    host = np.arange(32, dtype=np.float32).reshape(8, 4)
    placed = f(host)  # host data: placed, and the structure's shardings remembered
    placing = _placements(monkeypatch)
    np.testing.assert_array_equal(np.asarray(f(placed)), host * 4)  # straight to jit
    assert placing == []
    np.testing.assert_array_equal(np.asarray(f(host)), host * 2)  # host data again: placed
    single = jax.device_put(host, jax.devices()[0])
    np.testing.assert_array_equal(np.asarray(f(single)), host * 2)  # one device: placed
    g = meshkit.spmd(lambda a, b: a + b, mesh=mesh, in_specs="data model", out_specs="data model")
    g(placed, placed)
    for a, b, times in ((placed, host, 3), (host, placed, 3), (placed, placed, 4)):
        np.testing.assert_array_equal(np.asarray(g(a, b)), host * times)  # a leaf changed: placed
    assert placing == [1, 1, 2, 2, 2]  # the first call and the two with host data
    assert f.calls == 4
    assert g.calls == 4


def test_placed_trees_and_static_arguments_go_straight_to_jit_too(mesh, monkeypatch):
    f = meshkit.spmd(lambda d, k: d["a"] * k + d["b"], mesh=mesh, in_specs=("data model", None),
                     out_specs="data model", static_argnums=1)  # fmt: skip
    host = np.arange(32, dtype=np.float32).reshape(8, 4)
    placed = f({"a": host, "b": host}, 1)  # placed: host data
    placing = _placements(monkeypatch)
    tree = {"a": placed, "b": placed}
    np.testing.assert_array_equal(np.asarray(f(tree, 3)), host * 8)  # straight to jit
    assert placing == []
    for other in ({"a": placed, "b": host}, {"a": placed}, [placed, placed]):
        with contextlib.suppress(Exception):  # a structure spmd refuses, or placed
            f(other, 3)
    assert len(placing) == 3
    f(tree, 2)  # the tree again after another structure: placed, then remembered
    np.testing.assert_array_equal(np.asarray(f(tree, 2)), host * 6)  # straight to jit
    assert len(placing) == 4


def test_donated_input_that_is_laid_out_right_is_the_buffer_reused(mesh):
    placed = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("data", "model")))
    f = meshkit.spmd(lambda a: a * 2, mesh=mesh, in_specs="data model", out_specs="data model",
                     donate_argnums=0)  # fmt: skip
    out = f(placed)
    assert placed.is_deleted()
    np.testing.assert_array_equal(np.asarray(out), np.full((8, 4), 2.0))


def test_differently_laid_out_array_is_resharded_with_one_warning(mesh):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    other = jax.device_put(x, NamedSharding(mesh, P("model", "data")))
    f = _f(mesh)
    with pytest.warns(ReshardWarning) as record:
        out = f(other)
    np.testing.assert_array_equal(np.asarray(out), _expected(x))
    message = str(record[0].message)
    assert "meshkit.spmd(_row_sums): args[0] arrived with " in message
    assert "but in_specs asks for P('data', 'model')" in message
    assert "resharded on every call (this warning is shown once)" in message
    assert "jax.device_put(x, NamedSharding(mesh, P('data', 'model')))" in message
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = f(other)  # moved again, not warned again
    np.testing.assert_array_equal(np.asarray(out), _expected(x))


def test_inside_set_mesh_with_and_without_mesh_argument(mesh):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    ctx = meshkit.spmd(_row_sums, in_specs="data model", out_specs="data _")
    with jax.set_mesh(mesh):
        np.testing.assert_array_equal(np.asarray(_f(mesh)(x)), _expected(x))
        np.testing.assert_array_equal(np.asarray(ctx(x)), _expected(x))
    with pytest.raises(MeshkitError, match=r"has no mesh: it was made with mesh=None"):
        ctx(x)


def test_inside_another_jit(mesh):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    f = _f(mesh)
    out = jax.jit(lambda a: f(a * 2) + 1)(x)
    np.testing.assert_array_equal(np.asarray(out), 2 * _expected(x) + 1)
    ctx = meshkit.spmd(_row_sums, in_specs="data model", out_specs="data _")
    with jax.set_mesh(mesh):
        out = jax.jit(lambda a: ctx(a))(x)
    np.testing.assert_array_equal(np.asarray(out), _expected(x))


def test_decorator_and_lower(mesh):
    @meshkit.spmd(mesh=mesh, in_specs="data", out_specs="_")
    def total(a):
        return C.psum(a.sum(keepdims=True), "data")

    assert total.__name__ == "total"
    assert float(total(np.arange(8.0))[0]) == 28.0
    text = total.lower(np.arange(8.0)).as_text()
    assert "all-reduce" in text or "all_reduce" in text
    assert total.calls == 1  # lower does not count as a call


def test_static_argnums_with_and_without_a_none_entry(mesh):
    def scaled(a, k):
        return a * k

    for in_specs in (("data",), ("data", None)):
        f = meshkit.spmd(scaled, mesh=mesh, in_specs=in_specs, out_specs="data", static_argnums=1)
        assert np.asarray(f(np.ones(4), 5)).tolist() == [5.0] * 4


def test_pytree_arguments_and_outputs(mesh):
    def step(params, batch):
        return {"y": batch["x"] @ params["w"], "n": C.psum(jnp.ones(()), ("data", "model"))}

    params = {"w": np.eye(3, dtype=np.float32)}
    batch = {"x": np.arange(24, dtype=np.float32).reshape(8, 3)}
    out = assert_spmd_matches_reference(
        step, mesh, (P(), {"x": "batch feat -> data _"}), {"y": "data", "n": P()}, params, batch
    )
    assert float(out["n"]) == 8.0


def test_dispatch_counts_and_observers(mesh):
    f = _f(mesh)
    x = np.ones((8, 4), np.float32)
    seen = []
    with _dispatch.observing(lambda site, args: seen.append((site.kind, site.name, len(args)))):
        f(x)
        f(x)
    f(x)
    assert f.calls == 3
    assert seen == [("spmd", "_row_sums", 1)] * 2


def test_an_observer_can_stop_a_call(mesh):
    f = _f(mesh)

    def refuse(site, args):
        raise MeshkitError("stopped by observer")

    with _dispatch.observing(refuse), pytest.raises(MeshkitError, match="stopped by observer"):
        f(np.ones((8, 4), np.float32))


# ---- errors ------------------------------------------------------------------------------------


def test_keyword_arguments_are_refused(mesh):
    with pytest.raises(
        MeshkitError, match=r"takes positional arguments only .* got keywords \['block'\]"
    ):
        _f(mesh)(block=np.ones((8, 4)))


def test_in_specs_count_must_match_arguments(mesh):
    f = meshkit.spmd(lambda a, b: a + b, mesh=mesh, in_specs=("data",), out_specs="data")
    with pytest.raises(
        MeshkitError, match=r"in_specs has 1 entries but the function was called with 2"
    ):
        f(np.ones(4), np.ones(4))


def test_in_specs_structure_must_match_the_argument(mesh):
    f = meshkit.spmd(
        lambda t: t["a"], mesh=mesh, in_specs=({"a": "data", "b": "_"},), out_specs="data"
    )
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit\.spmd\(<lambda>\): in_specs\[0\]: the spec is a dict with keys "
        r"\{'a', 'b'\} but the argument is a dict with keys \{'a'\}: extra 'b'$",
    ):
        f({"a": np.ones(4)})


def test_none_spec_and_bad_mesh_and_bad_spec_type():
    mesh = _mesh("auto")
    with pytest.raises(MeshkitError, match=r"in_specs\[0\] is None. Consider P\(\) or ''"):
        meshkit.spmd(lambda a: a, mesh=mesh, in_specs=(None,), out_specs="_")
    with pytest.raises(MeshkitError, match=r"mesh must be a jax\.sharding\.Mesh"):
        meshkit.spmd(lambda a: a, mesh={"data": 2}, in_specs="_", out_specs="_")  # type: ignore[arg-type]
    with pytest.raises(
        MeshkitError, match=r"must be a PartitionSpec or a spec string .* got 3 of type int"
    ):
        meshkit.spmd(lambda a: a, mesh=mesh, in_specs=3, out_specs="_")
    with pytest.raises(MeshkitError, match="static_argnums must be non-negative ints"):
        meshkit.spmd(lambda a: a, mesh=mesh, in_specs="_", out_specs="_", static_argnums=-1)


def test_dict_in_specs_is_refused_with_the_fix(mesh):
    with pytest.raises(
        MeshkitError, match=r"got a dict with keys \{'w'\}.\nConsider in_specs=\(specs,\)"
    ):
        meshkit.spmd(lambda t: t["w"], mesh=mesh, in_specs={"w": "data"}, out_specs="data")


@pytest.mark.parametrize("make", [np.ones, jnp.ones], ids=["host", "single-device"])
def test_indivisible_input_of_any_kind_gets_the_same_message(mesh, make):
    f = meshkit.spmd(lambda a: a, mesh=mesh, in_specs="batch feat -> data model", out_specs="_")
    with pytest.raises(
        MeshkitError,
        match=r"dimension 1 \('feat'\) of size 6 is split over the mesh axes \('model',\)",
    ):
        f(make((4, 6)))


def test_compiled_program_is_named_after_the_function(mesh):
    def my_layer(a):
        return a + 1

    f = meshkit.spmd(my_layer, mesh=mesh, in_specs="data", out_specs="data")
    assert "my_layer" in f.lower(np.ones(8, np.float32)).as_text().splitlines()[0]


def test_spec_longer_than_the_argument_rank(mesh):
    f = meshkit.spmd(lambda a: a, mesh=mesh, in_specs=P("data", "model"), out_specs="data")
    with pytest.raises(
        MeshkitError,
        match=r"args\[0\] has shape \(8,\) \(rank 1\) but its spec P\('data', 'model'\) has 2 entries",
    ):
        f(np.ones(8))


def test_output_rank_error_names_the_output_by_its_full_path():
    mesh = _mesh("auto")
    out_specs = {"p": "b -> data", "q": ["b -> _"]}
    f = meshkit.spmd(
        lambda a: {"p": a, "q": [a.sum()]}, mesh=mesh, in_specs="data", out_specs=out_specs
    )
    with pytest.raises(
        MeshkitError, match=r"output out\['q'\]\[0\] has rank 0 but its spec 'b -> _' names 1"
    ):
        f(np.ones(8))


# ---- properties --------------------------------------------------------------------------------


def _other_layout(mesh, x):
    """A sharding of x unlike any spec the strategy draws first: axes reversed over dims."""
    names = tuple(reversed(mesh.axis_names))[: x.ndim]
    if all(x.shape[d] % mesh.shape[a] == 0 for d, a in enumerate(names)):
        return NamedSharding(mesh, P(*names))
    return jax.devices()[0]  # fall back to a single-device array


@settings(max_examples=20)
@given(case=mks.sharded_arrays(), how=st.sampled_from(["host", "single", "right", "other"]))
def test_spmd_moves_any_input_to_the_spec(case, how):
    """Whatever layout the input arrives in, each device computes on its spec block."""
    mesh, spec, x = case
    target = {
        "host": None,
        "single": jax.devices()[-1],
        "right": NamedSharding(mesh, spec),
        "other": _other_layout(mesh, x),
    }[how]
    value = x if target is None else jax.device_put(x, target)

    def tag(a):  # the block plus its device's index: a block on the wrong device shows up
        return a + C.axis_index(tuple(mesh.axis_names)).astype(a.dtype)

    # Every mesh axis must appear in out_specs (the output varies along all of them).
    entries = [() if e is None else e if isinstance(e, tuple) else (e,) for e in spec]
    entries += [()] * (x.ndim - len(entries))
    used = {a for e in entries for a in e}
    entries[0] = entries[0] + tuple(a for a in mesh.axis_names if a not in used)
    out_spec = P(*[e or None for e in entries])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReshardWarning)
        actual = meshkit.spmd(tag, mesh=mesh, in_specs=spec, out_specs=out_spec)(value)
    expected = reference_spmd(tag, mesh, spec, out_spec, x)
    np.testing.assert_array_equal(np.asarray(actual, np.float64), expected.astype(np.float64))


def test_each_signature_is_traced_once_and_user_errors_propagate():
    traced = []
    mesh = meshkit.make_mesh({"data": 8})

    def double(x):
        traced.append(x.shape)
        return x * 2

    f = meshkit.spmd(double, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    x = np.ones((8, 2), np.float32)
    y = f(x)  # host data, placed in one batched put
    f(y)  # already placed: straight to jit
    f(x)
    f(jax.device_put(x, jax.devices()[3]))  # moved first, then the same signature
    assert traced == [(1, 2)]

    def broken(x):
        traced.append("broken")
        raise ValueError("the user's own error")

    g = meshkit.spmd(broken, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(ValueError, match=r"^the user.s own error") as e:
        g(x)
    assert type(e.value) is ValueError  # as jax.jit raises it (JAX may add its traceback note)
    assert traced.count("broken") == 1
