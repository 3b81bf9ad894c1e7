"""meshkit._src.spmd.variance: which per-device values can differ, checked against what devices compute.

The reference is numeric: the program runs under shard_map on 8 CPU devices with random data and
every device's result is compared. A value the analysis calls invariant must be equal on every
device (soundness); one it calls varying must differ for this data (precision: the operations
drawn make a varying value differ for random floats). JAX's own replication typing is not the
reference: it types ``all_gather``'s result as varying (it is equal everywhere) and a ``cond``
on a device-dependent predicate as invariant (devices take different branches).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import io_callback
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit._src.spmd import variance as _variance

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("i",))

OPS = {
    "add_x": lambda v, x, y: v + x,
    "mul_y": lambda v, x, y: v * y,
    "psum": lambda v, x, y: jax.lax.psum(v, "i"),
    "pmax": lambda v, x, y: jax.lax.pmax(v, "i"),
    "index": lambda v, x, y: v + jax.lax.axis_index("i").astype(v.dtype),
    "all_gather": lambda v, x, y: jax.lax.all_gather(v, "i").sum(0),
    # Not a cycle: device 0 receives zeros.
    "ppermute": lambda v, x, y: jax.lax.ppermute(v, "i", [(j, j + 1) for j in range(N - 1)]),
    "scan": lambda v, x, y: jax.lax.scan(lambda c, _: (c * 2 + y, None), v, None, length=2)[0],
    "fori": lambda v, x, y: jax.lax.fori_loop(0, 2, lambda i, c: c + v, v),
    "while_var_trip": lambda v, x, y: jax.lax.while_loop(
        lambda c: c[0] < jax.lax.axis_index("i") % 3, lambda c: (c[0] + 1, c[1] * 1.5), (0, v)
    )[1],
    "cond_inv": lambda v, x, y: jax.lax.cond(
        jax.lax.psum(v, "i").sum() > 0, lambda a: a * 2, lambda a: a + 1, v
    ),
    "cond_var": lambda v, x, y: jax.lax.cond(
        jax.lax.axis_index("i") % 2 == 0, lambda a: a * 2, lambda a: a + 1, v
    ),
    "jit": lambda v, x, y: jax.jit(lambda a: jax.lax.psum(a, "i") + 1)(v),
    "remat": lambda v, x, y: jax.checkpoint(lambda a: jnp.sin(a) * 3)(v),
    "pure_callback": lambda v, x, y: jax.pure_callback(
        lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(v.shape, v.dtype), v
    ),
}


def _program(start: str, ops: list[str]) -> Any:
    def prog(x: Any, y: Any) -> Any:
        v = x[0] if start == "x" else y
        for op in ops:
            v = OPS[op](v, x[0], y)
        return v[None]

    return jax.shard_map(prog, mesh=MESH, in_specs=(P("i"), P()), out_specs=P("i"), check_vma=False)


@settings(max_examples=60)
@given(
    start=st.sampled_from(["x", "y"]),
    ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_verdict_matches_what_the_devices_compute(start, ops, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 2)).astype(np.float32)
    y = rng.normal(size=(2,)).astype(np.float32)
    fn = _program(start, ops)
    (verdict,) = _variance.shard_map_outputs(jax.make_jaxpr(fn)(x, y), "i", [True, False])
    per_device = np.asarray(jax.jit(fn)(x, y)).reshape(N, 2)
    equal = bool(np.allclose(per_device, per_device[0], rtol=1e-5, atol=1e-6))
    assert verdict.level != 1, verdict
    assert (verdict == _variance.INVARIANT) == equal, (start, ops, verdict, per_device)


def test_unfollowable_values_are_unknown_with_the_reason():
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    grouped = jax.shard_map(
        lambda x: jax.lax.psum(x, "i", axis_index_groups=groups),
        mesh=MESH, in_specs=P("i"), out_specs=P("i"), check_vma=False,
    )  # fmt: skip
    x = np.ones((N,), np.float32)
    (v,) = _variance.shard_map_outputs(jax.make_jaxpr(grouped)(x), "i", [True])
    assert v == _variance.Variance(1, "it passes through psum with axis_index_groups")

    def impure(x: Any) -> Any:
        total = jax.lax.psum(x, "i")
        return io_callback(lambda a: a, jax.ShapeDtypeStruct(total.shape, total.dtype), total)

    fn = jax.shard_map(impure, mesh=MESH, in_specs=P("i"), out_specs=P("i"), check_vma=False)
    (v,) = _variance.shard_map_outputs(jax.make_jaxpr(fn)(x), "i", [True])
    assert v == _variance.Variance(1, "it comes from jax.experimental.io_callback")
    # A varying input wins over an unknown one: that is an error, not a warning.
    assert _variance.join([v, _variance.VARYING]) == _variance.VARYING
    assert _variance.shard_map_outputs(jax.make_jaxpr(lambda a: a + 1)(x), "i", [True]) is None


def test_pmap_compat_warns_once_per_output_it_cannot_check():
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    f = meshkit.pmap_compat(
        lambda v: jax.lax.psum(v, "i", axis_index_groups=groups), "i", out_axes=None
    )
    x = np.arange(N, dtype=np.float32)
    with pytest.warns(meshkit.UncheckedOutputWarning) as caught:
        out = f(x)
    assert float(out) == 6.0  # device 0's group, as jax.pmap returns it
    assert str(caught[0].message) == (
        "meshkit.pmap_compat(<lambda>): out_axes=None for output (shape ()) is not checked to be "
        "the same on every device: it passes through psum with axis_index_groups, which meshkit "
        "cannot follow. Device 0's value is returned, as jax.pmap does (this warning is shown "
        "once).\nConsider out_axes=0 and reading entry 0 yourself, or reducing the value with "
        "jax.lax.pmean / psum over the whole axis."
    )
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(x)  # once per function and output
        f(x + 1)


def test_checked_outputs_that_jax_typing_gets_wrong():
    """all_gather results are equal everywhere; a cond on the device index is not."""
    x = np.arange(2 * N, dtype=np.float32).reshape(N, 2)
    gathered = meshkit.pmap_compat(lambda v: jax.lax.all_gather(v, "i").sum(), "i", out_axes=None)
    assert float(gathered(x)) == float(x.sum())
    branchy = meshkit.pmap_compat(
        lambda v: jax.lax.cond(jax.lax.axis_index("i") == 0, lambda: 1.0, lambda: 2.0),
        "i",
        out_axes=None,
    )
    with pytest.raises(meshkit.MeshkitError, match="varies over the mapped axis 'i'"):
        branchy(x)
