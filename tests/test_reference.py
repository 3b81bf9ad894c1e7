"""The naive reference runner itself: blocks, reassembly, and the errors it raises."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import MeshkitError
from meshkit import collectives as C
from meshkit.testing import assert_spmd_matches_reference, reference_spmd


def test_each_device_sees_its_own_block_in_row_major_order():
    mesh = meshkit.make_mesh({"x": 2, "y": 4})
    x = np.arange(8 * 4).reshape(8, 4)
    out = reference_spmd(lambda a: a, mesh, "x y", "x y", x)
    np.testing.assert_array_equal(out, x)
    index = reference_spmd(
        lambda a: a[:1, :1] * 0 + C.axis_index(("y", "x")), mesh, "x y", "x y", x
    )
    # (x, y) -> y * 2 + x, because the tuple puts y outermost.
    assert index.tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_collectives_see_every_device_of_their_group_only():
    mesh = meshkit.make_mesh({"x": 2, "y": 4})
    x = np.arange(8.0).reshape(2, 4)
    sums = reference_spmd(lambda a: C.psum(a, "y"), mesh, "x y", "x", x)
    assert sums.ravel().tolist() == [6.0, 22.0]


def test_divergent_devices_are_named_instead_of_hanging():
    mesh = meshkit.make_mesh({"x": 8})

    def diverge(a):
        if int(C.axis_index("x")) == 3:
            return a
        return C.psum(a, "x")

    with pytest.raises(
        MeshkitError,
        match=r"the devices diverged: device x=0 called psum over 'x' while device x=3 returned",
    ):
        reference_spmd(diverge, mesh, "x", "x", np.ones(8))


def test_output_claimed_replicated_but_different_is_reported():
    mesh = meshkit.make_mesh({"x": 8})
    with pytest.raises(
        MeshkitError,
        match=r"out_specs P\(\) says this output is the same on every device along \['x'\], but device x=0 and device x=1 hold different values",
    ):
        reference_spmd(lambda a: a, mesh, "x", P(), np.arange(8.0))


def test_exceptions_in_user_code_name_the_device():
    mesh = meshkit.make_mesh({"x": 8})

    def boom(a):
        if int(C.axis_index("x")) == 5:
            raise RuntimeError("boom")
        return C.psum(a, "x")

    with pytest.raises(RuntimeError, match="boom") as e:
        reference_spmd(boom, mesh, "x", "_", np.ones(8))
    assert "device x=5" in "".join(getattr(e.value, "__notes__", []))


def test_assert_catches_a_wrong_result():
    """A reference that cannot fail is no reference: a difference must be caught."""
    import jax

    mesh = meshkit.make_mesh({"x": 8})

    def doubles_only_when_compiled(a):
        return a * 2 if isinstance(a, jax.core.Tracer) else a

    with pytest.raises(AssertionError, match=r"output"):
        assert_spmd_matches_reference(doubles_only_when_compiled, mesh, "x", "x", np.ones(8))
    assert_spmd_matches_reference(lambda a: a * 2, mesh, "x", "x", np.ones(8, np.float32))


def test_reference_rejects_specs_count_and_traced_collectives():
    import jax

    mesh = meshkit.make_mesh({"x": 8})
    with pytest.raises(MeshkitError, match="in_specs has 2 entries for 1 arguments"):
        reference_spmd(lambda a: a, mesh, ("x", "x"), "x", np.ones(8))
    with pytest.raises(MeshkitError, match="a collective received a traced value"):
        reference_spmd(jax.jit(lambda a: C.psum(a, "x")), mesh, "x", "_", np.ones(8))
