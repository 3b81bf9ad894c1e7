"""make_mesh and describe on this process's 8 CPU devices (single process)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh

import meshkit
from meshkit import MeshkitError


def test_returns_jax_mesh_over_all_devices():
    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    assert isinstance(mesh, Mesh)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()]
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


@given(st.sampled_from([1, 2, 4, 8]), st.booleans(), st.booleans())
def test_fill_axis(fixed, fill_outer, pairs):
    axes = [("a", -1), ("b", fixed)] if fill_outer else [("a", fixed), ("b", -1)]
    mesh = meshkit.make_mesh(axes if pairs else dict(axes))
    expected = {"a": 8 // fixed, "b": fixed} if fill_outer else {"a": fixed, "b": 8 // fixed}
    assert dict(mesh.shape) == expected
    assert list(mesh.axis_names) == ["a", "b"]


@st.composite
def axes_for(draw, n: int):
    """An axis dict whose sizes multiply to n, with an optional -1 at any position."""
    sizes, rest = [], n
    for _ in range(draw(st.integers(0, 3))):
        d = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        sizes.append(d)
        rest //= d
    sizes.append(rest)
    sizes = draw(st.permutations(sizes))
    fill = draw(st.none() | st.integers(0, len(sizes) - 1))
    written = [-1 if i == fill else s for i, s in enumerate(sizes)]
    names = [f"ax{i}" for i in range(len(sizes))]
    return dict(zip(names, written, strict=True)), tuple(sizes)


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), axes_for(n))))
def test_device_counts_1_to_8_match_reference(case):
    n, (axes, sizes) = case
    devs = jax.devices()[:n]
    mesh = meshkit.make_mesh(axes, devices=devs)
    assert tuple(mesh.devices.shape) == sizes
    assert list(mesh.axis_names) == list(axes)
    # One process: the intended order is the row-major reshape of the devices given.
    expected = np.array(devs, dtype=object).reshape(sizes)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in expected.flat]


@pytest.mark.parametrize(
    ("axis_types", "expected"),
    [
        (None, (AxisType.Auto, AxisType.Auto)),
        (AxisType.Explicit, (AxisType.Explicit, AxisType.Explicit)),
        ("explicit", (AxisType.Explicit, AxisType.Explicit)),
        ({"model": "Explicit"}, (AxisType.Auto, AxisType.Explicit)),
        (["manual", AxisType.Auto], (AxisType.Manual, AxisType.Auto)),
    ],
)
def test_axis_types(axis_types, expected):
    mesh = meshkit.make_mesh({"data": 2, "model": 4}, axis_types=axis_types)
    assert tuple(mesh.axis_types) == expected


def test_devices_subset_and_numpy_array():
    devs = jax.devices()[:4]
    mesh = meshkit.make_mesh({"x": -1}, devices=np.array(devs).reshape(2, 2))
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devs]


def test_mesh_is_usable_by_jax():
    mesh = meshkit.make_mesh({"data": -1, "model": 2})
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.device_put(np.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("data", "model")))
    assert float(jax.jit(lambda v: v.sum())(x)) == 120.0


# ---- errors: each names the argument, the rule and a fix ------------------------------------


def test_product_not_device_count():
    with pytest.raises(MeshkitError) as e:
        meshkit.make_mesh({"data": 3})
    msg = str(e.value)
    assert "axes={'data': 3} multiply to 3, but the program has 8 devices" in msg
    assert "a mesh must use exactly the devices it is given (no silent subset)" in msg
    assert "Consider using -1 for one axis to fill the remaining devices (e.g. {'data': -1})" in msg
    assert "or pass devices= with the 3 devices you mean to use" in msg


def test_product_larger_than_device_count():
    with pytest.raises(MeshkitError) as e:
        meshkit.make_mesh({"data": 4, "model": 4})
    msg = str(e.value)
    assert "multiply to 16, but the program has 8 devices" in msg
    assert (
        "Consider sizes whose product is 8, or -1 for one axis (e.g. {'data': -1, 'model': 4})"
        in msg
    )
    assert "devices=" not in msg


def test_product_not_devices_given():
    with pytest.raises(MeshkitError, match=r"multiply to 8, but devices= holds 4 devices"):
        meshkit.make_mesh({"a": 2, "b": 4}, devices=jax.devices()[:4])


def test_fill_not_divisible():
    with pytest.raises(
        MeshkitError,
        match=r"cannot fill the -1 axis .*8 devices, which the other axes' product 3 does not divide",
    ):
        meshkit.make_mesh({"data": -1, "model": 3})


def test_two_fill_axes():
    with pytest.raises(
        MeshkitError, match=r"axes \['a', 'b'\] are all -1 .* at most one axis may be -1"
    ):
        meshkit.make_mesh({"a": -1, "b": -1})


@pytest.mark.parametrize("size", [0, -2])
def test_non_positive_size(size):
    with pytest.raises(
        MeshkitError, match=rf"the size of axis 'model' is {size}; sizes must be positive, or -1"
    ):
        meshkit.make_mesh({"data": -1, "model": size})


@pytest.mark.parametrize("size", [2.0, "2", True, None])
def test_non_int_size(size):
    with pytest.raises(
        MeshkitError, match=r"the size of axis 'model' must be an int \(or -1 to fill\); got"
    ):
        meshkit.make_mesh({"data": -1, "model": size})


def test_numpy_int_size_is_accepted():
    assert dict(meshkit.make_mesh({"d": np.int64(8)}).shape) == {"d": 8}


def test_duplicate_names():
    with pytest.raises(
        MeshkitError, match=r"axis name 'x' appears twice in axes=\{'x': 2, 'x': 4\}"
    ):
        meshkit.make_mesh([("x", 2), ("x", 4)])


@pytest.mark.parametrize("name", [1, ("a",), None])
def test_non_string_name(name):
    with pytest.raises(MeshkitError, match=r"axis names must be strings; got"):
        meshkit.make_mesh({name: 8})


@pytest.mark.parametrize("name", ["", "two words", "1st", "_"])
def test_name_not_identifier(name):
    with pytest.raises(MeshkitError, match=r"is not a Python identifier"):
        meshkit.make_mesh({name: 8})


@pytest.mark.parametrize("axes", [{}, []])
def test_empty_axes(axes):
    with pytest.raises(
        MeshkitError, match=r"axes is empty; a mesh needs at least one axis.*\{'data': -1\}"
    ):
        meshkit.make_mesh(axes)


@pytest.mark.parametrize("axes", ["data", 8, [("a",)]])
def test_axes_wrong_type(axes):
    with pytest.raises(MeshkitError, match=r"axes must be a mapping name -> size"):
        meshkit.make_mesh(axes)


def test_bad_axis_types():
    with pytest.raises(
        MeshkitError,
        match=r"axis_types\['b'\] must be a jax.sharding.AxisType or one of 'auto', 'explicit', 'manual'; got 'fast'",
    ):
        meshkit.make_mesh({"a": 2, "b": 4}, axis_types={"b": "fast"})
    with pytest.raises(MeshkitError, match=r"axis_types names \['c'\], which are not mesh axes"):
        meshkit.make_mesh({"a": 2, "b": 4}, axis_types={"c": "auto"})
    with pytest.raises(MeshkitError, match=r"axis_types has 1 entry for 2 axes"):
        meshkit.make_mesh({"a": 2, "b": 4}, axis_types=["auto"])


def test_duplicate_devices():
    d = jax.devices()
    with pytest.raises(MeshkitError, match=r"devices= lists devices \[0\] more than once"):
        meshkit.make_mesh({"x": 2}, devices=[d[0], d[0]])


def test_error_is_value_error():
    assert issubclass(MeshkitError, ValueError)


# ---- describe --------------------------------------------------------------------------------


def test_describe_two_axes():
    text = meshkit.describe(meshkit.make_mesh({"data": 2, "model": 4}))
    lines = text.splitlines()
    assert lines[0] == "Mesh {'data': 2, 'model': 4}: 8 devices on 1 process"
    assert lines[1] == "axis types: data=Auto, model=Auto"
    assert lines[2] == "devices: 8 x cpu"
    assert lines[4].split() == ["model=0", "model=1", "model=2", "model=3"]
    assert lines[5].split() == ["data=0", "p0/d0", "p0/d1", "p0/d2", "p0/d3"]
    assert lines[6].split() == ["data=1", "p0/d4", "p0/d5", "p0/d6", "p0/d7"]
    assert lines[-1] == "process 0: devices 0-7; data=0-1, model=0-3"


def test_describe_one_and_three_axes():
    one = meshkit.describe(meshkit.make_mesh({"x": 8})).splitlines()
    assert one[4].split() == [f"x={i}" for i in range(8)]
    assert one[5].split() == [f"p0/d{i}" for i in range(8)]
    three = meshkit.describe(meshkit.make_mesh({"a": 2, "b": 2, "c": 2})).splitlines()
    assert three[5].split() == ["a=0", "b=0", "p0/d0", "p0/d1"]
    assert three[8].split() == ["a=1", "b=1", "p0/d6", "p0/d7"]


def test_describe_one_device():
    text = meshkit.describe(meshkit.make_mesh({"x": 1}, devices=jax.devices()[:1]))
    assert text.splitlines()[0] == "Mesh {'x': 1}: 1 device on 1 process"


def test_describe_accepts_plain_jax_mesh():
    mesh = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("i", "j"))
    text = meshkit.describe(mesh)
    assert "p0/d7" in text.splitlines()[5]
    assert text.splitlines()[-1] == "process 0: devices 0-7; i=0-3, j=0-1"
