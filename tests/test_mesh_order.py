"""Device order of make_mesh, on fake device lists of any process/device count."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshkit import MeshkitError
from meshkit._src.sharding.mesh import order_devices


def fake_devices(processes: int, per_process: int, *, shuffle_seed: int | None = None):
    """Devices like a GPU/TPU cluster's: ids grouped by host, process_index per host."""
    devs = [
        SimpleNamespace(id=p * 1000 + i, process_index=p, platform="fake")
        for p in range(processes)
        for i in range(per_process)
    ]
    if shuffle_seed is not None:
        np.random.default_rng(shuffle_seed).shuffle(devs)
    return devs


@st.composite
def factorizations(draw, n: int, max_axes: int = 4):
    """Ordered factorizations of n into 1..max_axes factors (1s allowed)."""
    k = draw(st.integers(1, max_axes))
    sizes = []
    rest = n
    for _ in range(k - 1):
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divisors))
        sizes.append(d)
        rest //= d
    sizes.append(rest)
    return draw(st.permutations(sizes))


@st.composite
def layouts(draw):
    processes = draw(st.integers(1, 6))
    per_process = draw(st.integers(1, 8))
    sizes = draw(factorizations(processes * per_process))
    return processes, per_process, tuple(sizes)


def reference_order(processes: int, per_process: int, sizes: tuple[int, ...]):
    """Coordinate -> (process, local index), written directly from the documented rule."""
    p_factors, rest = [], processes
    for s in sizes:
        f = math.gcd(s, rest)
        p_factors.append(f)
        rest //= f
    l_factors = [s // f for s, f in zip(sizes, p_factors, strict=True)]
    out = {}
    for coord in np.ndindex(*sizes):
        proc = local = 0
        for c, pf, lf in zip(coord, p_factors, l_factors, strict=True):
            proc = proc * pf + c // lf
            local = local * lf + c % lf
        out[coord] = (proc, local)
    return out


@given(layouts())
def test_matches_reference(layout):
    processes, per_process, sizes = layout
    grid = order_devices(fake_devices(processes, per_process), sizes)
    ref = reference_order(processes, per_process, sizes)
    assert grid.shape == sizes
    for coord, (proc, local) in ref.items():
        d = grid[coord]
        assert (d.process_index, d.id % 1000) == (proc, local), coord


@given(layouts())
def test_every_device_once(layout):
    processes, per_process, sizes = layout
    devs = fake_devices(processes, per_process)
    grid = order_devices(devs, sizes)
    assert sorted(d.id for d in grid.flat) == sorted(d.id for d in devs)


@given(layouts())
def test_no_interleave_along_any_axis(layout):
    """Along every axis, with the other coordinates fixed, the owning process never decreases."""
    processes, per_process, sizes = layout
    grid = order_devices(fake_devices(processes, per_process), sizes)
    procs = np.vectorize(lambda d: d.process_index)(grid)
    for axis in range(len(sizes)):
        assert (np.diff(procs, axis=axis) >= 0).all(), axis


@given(layouts())
def test_inner_axes_inside_a_host_when_sizes_allow(layout):
    """The longest suffix of axes whose product divides the per-process count is process-local."""
    processes, per_process, sizes = layout
    grid = order_devices(fake_devices(processes, per_process), sizes)
    procs = np.vectorize(lambda d: d.process_index)(grid)
    j = next(j for j in range(len(sizes) + 1) if per_process % math.prod(sizes[j:]) == 0)
    for outer in np.ndindex(*sizes[:j]):
        block = procs[outer]
        assert np.all(block == block.flat[0]), (outer, block)


@given(layouts())
def test_aligned_case_is_row_major_reshape(layout):
    """When some axis boundary splits processes from devices, the order is a plain reshape."""
    processes, per_process, sizes = layout
    aligned = any(
        per_process % math.prod(sizes[j + 1 :]) == 0 and math.prod(sizes[j:]) % per_process == 0
        for j in range(len(sizes))
    )
    if not aligned:
        return
    devs = fake_devices(processes, per_process)
    grid = order_devices(devs, sizes)
    expected = np.array(devs, dtype=object).reshape(sizes)
    assert (grid == expected).all()


@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_input_order_of_processes_does_not_matter(processes, per_process, seed):
    sizes = (processes * per_process,)
    shuffled = fake_devices(processes, per_process, shuffle_seed=seed)
    grid = order_devices(shuffled, sizes)
    procs = [d.process_index for d in grid.flat]
    assert procs == sorted(procs)


def test_straddling_inner_axis_is_blocked_not_interleaved():
    # 2 hosts x 6 devices, mesh (a=3, b=4): b cannot fit in one host, so it straddles as
    # 2 processes x 2 devices while a stays inside the host.
    grid = order_devices(fake_devices(2, 6), (3, 4))
    procs = [[d.process_index for d in row] for row in grid]
    assert procs == [[0, 0, 1, 1]] * 3
    assert [d.id % 1000 for d in grid[:, 0]] == [0, 2, 4]


def test_gpu_like_and_tpu_like_device_lists():
    gpu = [SimpleNamespace(id=i, process_index=i // 8, platform="gpu") for i in range(16)]
    grid = order_devices(gpu, (2, 8))
    assert [[d.process_index for d in row] for row in grid] == [[0] * 8, [1] * 8]
    tpu = [SimpleNamespace(id=i, process_index=i % 4, platform="tpu") for i in range(16)]
    grid = order_devices(tpu, (4, 4))
    for p, row in enumerate(grid):
        assert {d.process_index for d in row} == {p}


def test_unequal_devices_per_process():
    devs = fake_devices(2, 4)[:6]
    with pytest.raises(
        MeshkitError, match=r"unequal numbers \(process: devices = \{0: 4, 1: 2\}\)"
    ):
        order_devices(devs, (6,))
