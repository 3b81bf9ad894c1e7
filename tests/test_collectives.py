"""Every collective against its numpy reference, on 1-, 2- and 3-axis meshes of 8 CPU devices.

Each example draws a mesh (Auto or Explicit axes), a group of axes (one name or a tuple, in any
order), a dtype, a per-device block shape that the collective accepts, and whether to run under
jit (`meshkit.spmd`) or eagerly (`jax.shard_map`); `assert_spmd_matches_reference` runs it both
ways and compares.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import MeshkitError
from meshkit import collectives as C
from meshkit._src.sharding.specs import dim_axes
from meshkit.testing import assert_spmd_matches_reference
from meshkit.testing import strategies as mks

# Each example compiles a program; 15 draws per collective still reach meshes of 1, 2 and 3
# axes, blocks of rank 1, 2 and 3, jit and eager, and 2 or 3 dtypes (checked for every
# collective, derandomized as in CI: the same draws each run). The dev profile
# (MESHKIT_HYPOTHESIS_PROFILE=dev) runs ten times as many.
EXAMPLES = 15 * (10 if os.environ.get("MESHKIT_HYPOTHESIS_PROFILE") == "dev" else 1)


def _entries(spec: P, ndim: int) -> list[tuple[str, ...]]:
    return list(dim_axes(spec, ndim))


def _spec(entries: list[tuple[str, ...]]) -> P:
    return P(*[None if not e else e[0] if len(e) == 1 else e for e in entries])


def _mention(entries: list[tuple[str, ...]], axes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Entries that also mention ``axes`` (on dim 0 when not already used)."""
    used = {a for e in entries for a in e}
    missing = tuple(a for a in axes if a not in used)
    if missing:
        entries = [entries[0] + missing, *entries[1:]]
    return entries


def _drop(entries: list[tuple[str, ...]], axes: tuple[str, ...]) -> list[tuple[str, ...]]:
    return [tuple(a for a in e if a not in axes) for e in entries]


@st.composite
def cases(draw, op: str):
    mesh = draw(mks.meshes())
    group = draw(mks.axis_groups(mesh))
    names = (group,) if isinstance(group, str) else group
    n = math.prod(mesh.shape[a] for a in names)
    dtype = draw(st.sampled_from(mks.DTYPES))
    eager = draw(st.booleans())
    ndim = draw(st.integers(1, 3))
    in_spec = draw(mks.specs(mesh, ndim))
    block = list(draw(st.tuples(*[st.integers(1, 3)] * ndim)))
    entries = _entries(in_spec, ndim)
    kwargs: dict = {}
    if op in ("psum", "pmean", "pmax", "pmin"):
        out = entries if draw(st.booleans()) else _drop(entries, names)
        f = lambda a: getattr(C, op)(a, group)  # noqa: E731
    elif op == "axis_size":
        out = entries
        f = lambda a: a * 0 + C.axis_size(group)  # noqa: E731
    elif op == "all_gather":
        tiled = draw(st.booleans())
        axis = draw(st.integers(0, ndim - 1 if tiled else ndim))
        out = entries if draw(st.booleans()) else _drop(entries, names)
        if not tiled:
            out = [*out[:axis], (), *out[axis:]]
        kwargs = {"axis": axis, "tiled": tiled}
        f = lambda a: C.all_gather(a, group, **kwargs)  # noqa: E731
    elif op == "psum_scatter":
        tiled = draw(st.booleans()) if ndim > 1 else True
        dim = draw(st.integers(0, ndim - 1))
        block[dim] = n * draw(st.integers(1, 2)) if tiled else n
        out = list(entries)
        if not tiled:
            moved = out.pop(dim)
            out[0] = out[0] + moved
        out = _mention(out, names)
        kwargs = {"scatter_dimension": dim, "tiled": tiled}
        f = lambda a: C.psum_scatter(a, group, **kwargs)  # noqa: E731
    elif op == "all_to_all":
        tiled = draw(st.booleans())
        split = draw(st.integers(0, ndim - 1))
        concat = draw(st.integers(0, ndim - 1))
        block[split] = n * draw(st.integers(1, 2)) if tiled else n
        out = _mention(entries, names)
        f = lambda a: C.all_to_all(a, group, split, concat, tiled=tiled)  # noqa: E731
    elif op == "ppermute":
        perm_size = draw(st.integers(0, n))
        sources = draw(st.permutations(range(n)))[:perm_size]
        dests = draw(st.permutations(range(n)))[:perm_size]
        perm = list(zip(sources, dests, strict=True))
        out = _mention(entries, names)
        f = lambda a: C.ppermute(a, group, perm)  # noqa: E731
    elif op == "shift":
        offset = draw(st.integers(-9, 9))
        out = _mention(entries, names)
        f = lambda a: C.shift(a, group, offset)  # noqa: E731
    elif op == "axis_index":
        out = _mention(entries, names)
        f = lambda a: a * 0 + C.axis_index(group).astype(a.dtype)  # noqa: E731
    else:
        raise AssertionError(op)
    splits = [math.prod(mesh.shape[a] for a in e) for e in entries]
    shape = [b * s for b, s in zip(block, splits, strict=True)]
    x = draw(mks.arrays(shape, dtype))
    return mesh, f, in_spec, _spec(out), x, eager


OPS = [
    "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute",
    "shift", "axis_index", "axis_size",
]  # fmt: skip


@pytest.mark.parametrize("op", OPS)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_collective_matches_reference(op, data):
    mesh, f, in_spec, out_spec, x, eager = data.draw(cases(op))
    assert_spmd_matches_reference(f, mesh, in_spec, out_spec, x, eager=eager)


def test_pytrees_go_through_collectives():
    mesh = meshkit.make_mesh({"x": 2, "y": 4})
    tree = {"a": np.arange(8.0), "b": [np.ones((8, 2), np.int32)]}
    out = assert_spmd_matches_reference(
        lambda t: C.psum(t, "x"),
        mesh,
        ({"a": P("x"), "b": [P(("x", "y"))]},),
        {"a": P(), "b": [P("y")]},
        tree,
    )
    assert out["a"].shape == (4,)


# ---- errors ------------------------------------------------------------------------------------


def test_unbound_axis_outside_spmd_names_function_and_fix():
    with pytest.raises(
        MeshkitError, match=r"collectives\.psum: the axis name 'data' is not bound"
    ) as e:
        C.psum(np.ones(2), "data")
    assert "called outside per-device code" in str(e.value)
    assert "No axis is bound here" in str(e.value)
    assert "Consider calling it inside per-device code" in str(e.value)


@pytest.mark.parametrize(
    "call",
    [
        lambda a: C.psum(a, "modle"),
        lambda a: C.all_gather(a, ("data", "modle")),
        lambda a: C.shift(a, "modle"),
        lambda a: a + C.axis_index("modle"),
    ],
)
def test_typo_axis_inside_spmd_lists_available_axes(call):
    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    f = meshkit.spmd(call, mesh=mesh, in_specs="data model", out_specs="data model")
    with pytest.raises(MeshkitError, match="the axis name 'modle' is not bound here") as e:
        f(np.ones((4, 8), np.float32))
    assert "Bound axes: 'data' (size 2), 'model' (size 4)." in str(e.value)


def test_axis_name_must_be_a_string_and_not_repeated():
    mesh = meshkit.make_mesh({"x": 8})
    f = meshkit.spmd(lambda a: C.psum(a, 0), mesh=mesh, in_specs="x", out_specs="_")
    with pytest.raises(MeshkitError, match="axis names must be strings; got 0 of type int"):
        f(np.ones(8))
    f = meshkit.spmd(lambda a: C.psum(a, ("x", "x")), mesh=mesh, in_specs="x", out_specs="_")
    with pytest.raises(MeshkitError, match=r"names an axis twice"):
        f(np.ones(8))


def test_psum_scatter_non_divisible_names_sizes():
    mesh = meshkit.make_mesh({"x": 2, "y": 4})
    f = meshkit.spmd(
        lambda a: C.psum_scatter(a, "y", tiled=True), mesh=mesh, in_specs="x", out_specs="x y"
    )
    with pytest.raises(
        MeshkitError,
        match=r"psum_scatter: scatter_dimension 0 of an operand of shape \(3, 2\) has size 3, which is not divisible by the size 4 of the axis group \('y',\)",
    ) as e:
        f(np.ones((6, 2), np.float32))
    assert "Consider padding that dimension to a multiple of 4" in str(e.value)
    f = meshkit.spmd(lambda a: C.psum_scatter(a, "y"), mesh=mesh, in_specs="x", out_specs="x")
    with pytest.raises(
        MeshkitError, match=r"size 3, which is not equal to \(tiled=False\) the size 4"
    ):
        f(np.ones((6, 2), np.float32))


def test_all_to_all_non_divisible_names_sizes():
    mesh = meshkit.make_mesh({"x": 8})
    f = meshkit.spmd(
        lambda a: C.all_to_all(a, "x", 1, 0, tiled=True), mesh=mesh, in_specs="x", out_specs="x"
    )
    with pytest.raises(
        MeshkitError,
        match=r"all_to_all: split_axis 1 of an operand of shape \(1, 6\) has size 6, which is not divisible by the size 8",
    ):
        f(np.ones((8, 6), np.float32))


def test_ppermute_rejects_pairs_outside_the_group_and_repeats():
    mesh = meshkit.make_mesh({"x": 8})
    f = meshkit.spmd(lambda a: C.ppermute(a, "x", [(0, 8)]), mesh=mesh, in_specs="x", out_specs="x")
    with pytest.raises(
        MeshkitError, match=r"perm entry \(0, 8\) is not a pair of device indices in \[0, 8\)"
    ):
        f(np.ones(8))
    f = meshkit.spmd(
        lambda a: C.ppermute(a, "x", [(0, 1), (2, 1)]), mesh=mesh, in_specs="x", out_specs="x"
    )
    with pytest.raises(MeshkitError, match="repeats a destination"):
        f(np.ones(8))


def test_all_gather_axis_out_of_range():
    mesh = meshkit.make_mesh({"x": 8})
    f = meshkit.spmd(lambda a: C.all_gather(a, "x", axis=3), mesh=mesh, in_specs="x", out_specs="_")
    with pytest.raises(
        MeshkitError,
        match=r"all_gather: axis=3 is out of range for an operand of rank 1 \(valid: -2 to 1\)",
    ):
        f(np.ones(8))


def test_collectives_work_inside_plain_shard_map():
    mesh = meshkit.make_mesh({"x": 8})
    out = jax.jit(jax.shard_map(lambda a: C.shift(a, "x", 2), mesh=mesh, in_specs=P("x"),
                                out_specs=P("x")))(np.arange(8))  # fmt: skip
    assert out.tolist() == [6, 7, 0, 1, 2, 3, 4, 5]
