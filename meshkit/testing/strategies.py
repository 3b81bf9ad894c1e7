"""Hypothesis strategies for meshes, axis names, specs and arrays that split evenly (public).

Needs ``hypothesis`` (``pip install meshkit[testing]``). Meshes are built over this process's
devices with `meshkit.make_mesh`, so a test that wants 8 CPU devices sets
``jax.config.update("jax_num_cpu_devices", 8)`` before JAX starts.

Examples:
    >>> import numpy as np
    >>> from hypothesis import given
    >>> from meshkit.testing import strategies as mks
    >>> @given(mks.sharded_arrays())
    ... def test_split_evenly(case):
    ...     mesh, spec, x = case
    ...     assert x.ndim >= len(spec)
    >>> test_split_evenly()
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from hypothesis import strategies as st
from jax.sharding import Mesh, PartitionSpec

from .._src.arrays.meshes import make_mesh
from .._src.sharding.specs import dim_axes

__all__ = [
    "DTYPES",
    "arrays",
    "axis_groups",
    "axis_names",
    "mesh_shapes",
    "meshes",
    "shapes_for",
    "sharded_arrays",
    "specs",
]

DTYPES = ("float32", "bfloat16", "int32")
"""The dtypes property tests cover by default."""

_NAMES = st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s)
)


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out += [(d, *rest) for rest in _factorizations(n // d, parts - 1)]
    return out


def mesh_shapes(
    num_devices: int | None = None, *, min_axes: int = 1, max_axes: int = 3
) -> st.SearchStrategy[tuple[int, ...]]:
    """Ordered factorizations of the device count into ``min_axes..max_axes`` sizes."""
    n = jax.device_count() if num_devices is None else num_devices
    options = [f for k in range(min_axes, max_axes + 1) for f in _factorizations(n, k)]
    return st.sampled_from(options)


def axis_names(count: int) -> st.SearchStrategy[tuple[str, ...]]:
    """``count`` distinct axis names, valid in spec strings (identifiers, not keywords)."""
    return st.lists(_NAMES, min_size=count, max_size=count, unique=True).map(tuple)


@st.composite
def meshes(
    draw: st.DrawFn,
    num_devices: int | None = None,
    *,
    min_axes: int = 1,
    max_axes: int = 3,
    axis_types: Sequence[str] = ("auto", "explicit"),
) -> Mesh:
    """Meshes over all of this process's devices with 1 to 3 named axes and either axis type."""
    shape = draw(mesh_shapes(num_devices, min_axes=min_axes, max_axes=max_axes))
    names = draw(axis_names(len(shape)))
    kind = draw(st.sampled_from(list(axis_types)))
    return make_mesh(dict(zip(names, shape, strict=True)), axis_types=kind)


@st.composite
def axis_groups(draw: st.DrawFn, mesh: Mesh, *, allow_tuple: bool = True) -> str | tuple[str, ...]:
    """A mesh axis name, or (with ``allow_tuple``) a tuple of distinct axis names in any order."""
    names = list(mesh.axis_names)
    if not allow_tuple or len(names) == 1 or draw(st.booleans()):
        return str(draw(st.sampled_from(names)))
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    return tuple(str(n) for n in chosen)


@st.composite
def specs(draw: st.DrawFn, mesh: Mesh, ndim: int) -> PartitionSpec:
    """PartitionSpecs for an array of rank ``ndim``: each mesh axis splits at most one dim."""
    free = list(mesh.axis_names)
    entries: list[Any] = []
    for _ in range(ndim):
        taken = (
            draw(st.lists(st.sampled_from(free), max_size=min(2, len(free)), unique=True))
            if free
            else []
        )
        free = [a for a in free if a not in taken]
        entries.append(None if not taken else taken[0] if len(taken) == 1 else tuple(taken))
    return PartitionSpec(*entries)


def shapes_for(
    mesh: Mesh, spec: PartitionSpec, ndim: int, *, max_block: int = 3
) -> st.SearchStrategy[tuple[int, ...]]:
    """Global shapes of rank ``ndim`` that ``spec`` splits evenly (blocks of 1..max_block)."""
    splits = [math.prod(mesh.shape[a] for a in axes) for axes in dim_axes(spec, ndim)]
    return st.tuples(*[st.integers(1, max_block).map(lambda b, s=s: b * s) for s in splits])


def arrays(shape: Sequence[int], dtype: str) -> st.SearchStrategy[np.ndarray]:
    """Arrays of small integer values (exact in bfloat16 sums over up to 8 devices)."""
    size = math.prod(shape)
    np_dtype = jax.numpy.dtype(dtype)

    def build(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.float64).astype(np_dtype).reshape(tuple(shape))

    return st.lists(st.integers(-8, 8), min_size=size, max_size=size).map(build)


@st.composite
def sharded_arrays(
    draw: st.DrawFn,
    mesh: Mesh | None = None,
    *,
    min_ndim: int = 1,
    max_ndim: int = 3,
    dtypes: Sequence[str] = DTYPES,
) -> tuple[Mesh, PartitionSpec, np.ndarray]:
    """``(mesh, spec, array)`` with the array's shape split evenly by ``spec`` on ``mesh``."""
    mesh = draw(meshes()) if mesh is None else mesh
    ndim = draw(st.integers(min_ndim, max_ndim))
    spec = draw(specs(mesh, ndim))
    shape = draw(shapes_for(mesh, spec, ndim))
    x = draw(arrays(shape, draw(st.sampled_from(list(dtypes)))))
    return mesh, spec, x
