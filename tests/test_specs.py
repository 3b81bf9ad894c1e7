"""Readable spec strings: what they mean, and errors that underline the bad token."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import MeshkitError
from meshkit._src.sharding.specs import parse_spec
from meshkit.testing import strategies as mks


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", P()),
        ("data", P("data")),
        ("data _ model", P("data", None, "model")),
        ("(data fsdp) _", P(("data", "fsdp"), None)),
        ("  data   _ ", P("data", None)),
        ("batch seq embed -> data _ model", P("data", None, "model")),
        ("batch -> (data fsdp)", P(("data", "fsdp"))),
        ("a _ -> _ _", P(None, None)),
    ],
)
def test_spec_strings_mean_partition_specs(text, expected):
    assert meshkit.spec(text) == expected


def test_named_dimensions_are_kept():
    parsed = parse_spec("batch seq embed -> data _ model")
    assert parsed.dims == ("batch", "seq", "embed")
    assert parse_spec("data _").dims is None


def test_parsing_is_cached():
    assert parse_spec("x _ y") is parse_spec("x _ y")


@given(st.data())
def test_partition_spec_round_trips_through_its_string(data):
    mesh = data.draw(mks.meshes(max_axes=3))
    ndim = data.draw(st.integers(0, 4))
    spec = data.draw(mks.specs(mesh, ndim))
    parts = []
    for entry in spec:
        if entry is None:
            parts.append("_")
        elif isinstance(entry, tuple):
            parts.append("(" + " ".join(entry) + ")")
        else:
            parts.append(entry)
    text = " ".join(parts)
    assert meshkit.spec(text) == spec
    named = " ".join(f"d{i}" for i in range(ndim)) + " -> " + text
    assert meshkit.spec(named) == spec


@pytest.mark.parametrize(
    ("text", "problem", "pointer"),
    [
        ("data _ mod-el", "'mod-el' is not a name", "       ^^^^^^"),
        ("(data (model)) _", "parentheses cannot be nested", "      ^"),
        ("(data model", "'(' is never closed", "^"),
        ("data )", "')' without a matching '('", "     ^"),
        ("data ...", "'...' is not supported", "     ^^^"),
        ("data data", "the mesh axis 'data' appears twice", "     ^^^^"),
        ("a -> x -> y", "'->' may appear only once", "       ^^"),
        ("() data", "empty parentheses; write '_' instead", "^^"),
        ("( )", "empty parentheses; write '_' instead", "^^^"),
        ("data ( ) ()", "empty parentheses; write '_' instead", "     ^^^"),
        ("x 1", "'1' is a number", "  ^"),
        ("_x", "'_x': names cannot start or end with '_'", "^^"),
        ("(batch) seq -> data _", "dimension names cannot be grouped", "^"),
        ("b b -> x y", "the dimension 'b' appears twice", "  ^"),
        ("for x", "'for' is not a name", "^^^"),
        ("(x _)", "'_' cannot appear inside parentheses", "   ^"),
        (
            "batch seq -> data _ model",
            "2 dimensions are named on the left of '->' but the right gives 3 entries",
            "             ^^^^^^^^^^^^",
        ),
    ],
)
def test_bad_spec_strings_point_at_the_token(text, problem, pointer):
    with pytest.raises(MeshkitError) as e:
        meshkit.spec(text)
    message = str(e.value)
    assert message.startswith(f"meshkit: bad spec string {text!r}: {problem}")
    lines = message.splitlines()
    assert lines[1] == f"    {text}"
    assert lines[2] == f"    {pointer}"


def test_spec_rejects_non_strings():
    with pytest.raises(MeshkitError, match=r"meshkit.spec: expected a string; got P\('x',?\)"):
        meshkit.spec(P("x"))  # type: ignore[arg-type]


def test_unknown_mesh_axis_is_underlined_with_the_axes_available():
    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    with pytest.raises(MeshkitError) as e:
        meshkit.spmd(lambda a: a, mesh=mesh, in_specs="batch embed -> data modle", out_specs="_")
    lines = str(e.value).splitlines()
    assert lines[0] == (
        "meshkit.spmd(<lambda>): in_specs: the mesh has no axis 'modle' (in the spec string "
        "'batch embed -> data modle')"
    )
    assert lines[1] == "    batch embed -> data modle"
    assert lines[2] == "                        ^^^^^"
    assert lines[3] == "The mesh has the axes 'data' (size 2), 'model' (size 4)."


def test_partition_spec_with_unknown_axis_or_axis_used_twice():
    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    with pytest.raises(MeshkitError, match=r"out_specs: P\('data', 'x'\) names the axis 'x'"):
        meshkit.spmd(lambda a: a, mesh=mesh, in_specs=P(), out_specs=P("data", "x"))
    with pytest.raises(MeshkitError, match=r"uses the mesh axis 'data' twice"):
        meshkit.spmd(lambda a: a, mesh=mesh, in_specs=P("data", "data"), out_specs=P())


def test_named_dimensions_fix_the_rank():
    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    f = meshkit.spmd(lambda a: a, mesh=mesh, in_specs="batch seq -> data _", out_specs="data")
    with pytest.raises(
        MeshkitError,
        match=r"args\[0\] has shape \(4,\) \(rank 1\) but its spec 'batch seq -> data _' names 2",
    ):
        f(np.ones(4))
    g = meshkit.spmd(lambda a: a[0], mesh=mesh, in_specs="data", out_specs="b s -> _ _")
    with pytest.raises(
        MeshkitError, match=r"output out has rank 1 but its spec 'b s -> _ _' names 2"
    ):
        g(np.ones((4, 4)))


def test_indivisible_dimension_is_named():
    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    f = meshkit.spmd(lambda a: a, mesh=mesh, in_specs="batch embed -> data model", out_specs="_")
    with pytest.raises(MeshkitError) as e:
        f(np.ones((4, 6), np.float32))
    message = str(e.value)
    assert "args[0] has shape (4, 6); its dimension 1 ('embed') of size 6" in message
    assert (
        "split over the mesh axes ('model',) of total size 4, which does not divide it" in message
    )
    assert "Consider padding that dimension to a multiple of 4." in message
