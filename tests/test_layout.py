"""The layout planner: which blocks each process provides, against numpy and JAX's own answer.

Multi-process layouts are checked without processes: test doubles for devices carry a
``process_index``, arranged either as `meshkit.make_mesh` arranges real ones or in any order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import MeshkitError
from meshkit._src.sharding import layout as _layout
from meshkit._src.sharding.mesh import order_devices
from meshkit._src.sharding.specs import dim_axes
from meshkit.testing import strategies as mks


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def named_blocks(mesh, partition, shape):
    """Each device's block under NamedSharding(mesh, partition), from the device grid.

    JAX's ``devices_indices_map`` for meshes of test doubles (devices carrying a
    ``process_index``), which JAX cannot build a sharding over; checked against JAX's below.
    """
    names = list(mesh.axis_names)
    grid = np.asarray(mesh.devices, dtype=object)
    sizes = dict(zip(names, grid.shape, strict=True))
    per_dim = dim_axes(partition, len(shape))
    counts = [math.prod(sizes[a] for a in axes) for axes in per_dim]
    out = {}
    for coord in np.ndindex(*grid.shape):
        at = dict(zip(names, coord, strict=True))
        block = []
        for d, axes in enumerate(per_dim):
            k = 0
            for a in axes:
                k = k * sizes[a] + at[a]
            size = shape[d] // counts[d]
            block.append((k * size, (k + 1) * size))
        out[grid[coord]] = tuple(block)
    return out


@given(data=st.data())
def test_the_test_doubles_blocks_agree_with_jax(data):
    mesh = data.draw(mks.meshes())
    ndim = data.draw(st.integers(0, 3))
    spec = data.draw(mks.specs(mesh, ndim))
    shape = data.draw(mks.shapes_for(mesh, spec, ndim))
    ours = named_blocks(mesh, spec, shape)
    theirs = NamedSharding(mesh, spec).devices_indices_map(shape)
    for device, index in theirs.items():
        expected = tuple(
            (s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(index)
        )
        assert ours[device] == expected


@st.composite
def fake_meshes(draw):
    """(fake mesh, processes, in meshkit's order?) over 8 fake devices split among processes."""
    processes = draw(st.sampled_from([1, 2, 4, 8]))
    devices = [FakeDevice(i, i // (8 // processes)) for i in range(8)]
    sizes = draw(mks.mesh_shapes(8))
    names = draw(mks.axis_names(len(sizes)))
    ordered = draw(st.booleans())
    if ordered:
        grid = order_devices(devices, sizes)  # as meshkit.make_mesh arranges real devices
    else:
        grid = np.array(draw(st.permutations(devices)), dtype=object).reshape(sizes)
    mesh = SimpleNamespace(
        devices=grid, axis_names=names, shape=dict(zip(names, sizes, strict=True))
    )
    return mesh, processes, ordered


@st.composite
def fake_layouts(draw):
    """(fake mesh, spec, shape, processes, in meshkit's order?) over 8 fake devices."""
    mesh, processes, ordered = draw(fake_meshes())
    ndim = draw(st.integers(1, 3))
    spec = draw(mks.specs(mesh, ndim))
    shape = draw(mks.shapes_for(mesh, spec, ndim))
    return mesh, spec, shape, processes, ordered


@given(fake_layouts())
def test_every_process_provides_its_blocks_in_global_order(layout):
    mesh, spec, shape, processes, ordered = layout
    reference = np.arange(math.prod(shape)).reshape(shape)
    blocks = named_blocks(mesh, spec, shape)
    covered = np.zeros(shape, bool)
    slices = {}
    for p in range(processes):
        plan = _layout.plan_from_blocks(blocks, shape, p)
        if ordered:
            # meshkit.make_mesh keeps each process's devices together: always a grid.
            assert plan.rectangular
        if not plan.rectangular:
            continue
        part = _layout.describe_plan(plan)
        slices[p] = part
        local = part.take(reference)
        assert local.shape == plan.local_shape
        for placement in plan.placements:
            np.testing.assert_array_equal(
                local[placement.local_index], reference[placement.global_index]
            )
            covered[placement.global_index] = True
        # Local order is global order: each dimension's ranges increase.
        for ranges in part.ranges:
            assert list(ranges) == sorted(ranges)
    if ordered:
        assert covered.all()
    # Processes with the same rows share a loader shard; different rows, different shards.
    rows = {p: s.ranges[0] for p, s in slices.items()}
    for p, s in slices.items():
        assert 0 <= s.shard_index < s.shard_count
        for q, t in slices.items():
            assert (rows[p] == rows[q]) == (s.shard_index == t.shard_index)
            assert (q in s.replicas) == (q == p or s.ranges == t.ranges)


def _fake_mesh(order, sizes, names):
    devices = {(i, p): FakeDevice(i, p) for i, p in order}
    grid = np.array([devices[k] for k in order], dtype=object).reshape(sizes)
    return SimpleNamespace(
        devices=grid, axis_names=names, shape=dict(zip(names, sizes, strict=True))
    )


def test_interleaved_processes_provide_non_contiguous_rows():
    mesh = _fake_mesh([(i, i % 2) for i in range(8)], (8,), ("data",))
    blocks = named_blocks(mesh, P("data"), (16, 3))
    part = _layout.describe_plan(_layout.plan_from_blocks(blocks, (16, 3), 1))
    assert part.ranges == (((2, 4), (6, 8), (10, 12), (14, 16)), ((0, 3),))
    assert part.local_shape == (8, 3)
    assert (part.shard_index, part.shard_count) == (1, 2)
    with pytest.raises(MeshkitError, match=r"process 1 provides non-contiguous ranges"):
        _ = part.index
    np.testing.assert_array_equal(
        part.take(np.arange(16)[:, None] * np.ones(3, int)),
        np.repeat([2, 3, 6, 7, 10, 11, 14, 15], 3).reshape(8, 3),
    )


def test_a_layout_that_is_not_a_grid_is_reported():
    # Process 0 owns the diagonal of a 2 x 2 mesh: blocks (0, 0) and (1, 1), not a grid.
    mesh = _fake_mesh([(0, 0), (1, 1), (2, 1), (3, 0)], (2, 2), ("a", "b"))
    blocks = named_blocks(mesh, P("a", "b"), (4, 4))
    assert not _layout.plan_from_blocks(blocks, (4, 4), 0).rectangular


def test_replicas_across_processes_share_a_shard():
    # 'model' spans the two processes; a spec without it makes them one replica group.
    mesh = _fake_mesh([(i, i // 4) for i in range(8)], (2, 4), ("model", "data"))
    blocks = named_blocks(mesh, P("data"), (8, 2))
    for p in (0, 1):
        part = _layout.describe_plan(_layout.plan_from_blocks(blocks, (8, 2), p))
        assert part.replicas == (0, 1)
        assert (part.shard_index, part.shard_count) == (0, 1)
        assert part.index == (slice(0, 8), slice(0, 2))


def test_process_slice_on_a_real_mesh():
    mesh = meshkit.make_mesh({"data": 4, "model": 2})
    part = meshkit.process_slice(mesh, "batch feat -> data model", (8, 6))
    assert part.process == 0
    assert part.ranges == (((0, 8),), ((0, 6),))
    assert part.local_shape == (8, 6)
    assert part.index == (slice(0, 8), slice(0, 6))
    assert part.replicas == (0,)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (
            (P("nope"), (8,)),
            {},
            r"names the axis 'nope', which the mesh does not have. The mesh has the axes 'data' \(size 4\)",
        ),
        (("nope", (8,)), {}, r"the mesh has no axis 'nope' \(in the spec string 'nope'\)"),
        (
            ("data _ _", (8, 2)),
            {},
            r"spec P\('data', None, None\), global shape \(8, 2\): the spec has 3 entries but the "
            r"array has 2 dimensions",
        ),
        (
            ("data", (6,)),
            {},
            r"global shape \(6,\): dimension 0 \(size 6\) is split over the mesh axis 'data' "
            r"\(size 4\), and 6 is not a multiple of 4",
        ),
        (
            ("data", (8,)),
            {"process": 3},
            r"process=3 holds no device of the mesh; its processes are \[0\]",
        ),
        (("data", "eight"), {}, r"global_shape must be a tuple of ints"),
        (("data", (-8,)), {}, r"has a negative size"),
    ],
)
def test_process_slice_errors(args, kwargs, message):
    mesh = meshkit.make_mesh({"data": 4, "model": 2})
    with pytest.raises(MeshkitError, match=message):
        meshkit.process_slice(mesh, *args, **kwargs)


def test_take_checks_the_global_shape():
    mesh = meshkit.make_mesh({"data": 8})
    part = meshkit.process_slice(mesh, "data", (8,))
    with pytest.raises(
        MeshkitError,
        match=r"the value has shape \(9,\), but this slice is of a global array of shape \(8,\)",
    ):
        part.take(np.zeros(9))


def test_merged_joins_touching_ranges():
    assert _layout.merged([(0, 4), (4, 8), (12, 16)]) == ((0, 8), (12, 16))
    assert _layout.merged([]) == ()
