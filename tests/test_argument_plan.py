"""meshkit._src.sharding.layout.argument_plan: the plan spmd and pmap_compat share, checked against JAX."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit._src.sharding import layout
from meshkit._src.sharding.layout import argument_plan


@pytest.fixture
def mesh() -> jax.sharding.Mesh:
    return meshkit.make_mesh({"data": 4, "model": 2}, axis_types="auto")


def test_plan_is_cached_and_shares_one_sharding_per_spec(mesh: jax.sharding.Mesh) -> None:
    specs = (P("data"), P(), P("data"))
    plan = argument_plan(mesh, specs, ("args[0]", "args[1]", "args[2]"))
    assert argument_plan(mesh, specs, ("args[0]", "args[1]", "args[2]")) is plan
    assert plan.targets[0] is plan.targets[2]
    assert plan.targets[0] == NamedSharding(mesh, P("data"))
    assert tuple(t.spec for t in plan.targets) == specs


def test_placed_only_when_every_leaf_has_its_target(mesh: jax.sharding.Mesh) -> None:
    plan = argument_plan(mesh, (P("data"), P()), ("args[0]", "args[1]"))
    a = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("data")))
    b = jax.device_put(np.ones(3), NamedSharding(mesh, P()))
    assert plan.placed([a, b])
    assert plan.placed([a, b])  # again, now decided by identity
    assert not plan.placed([a, np.ones(3)])  # host data
    assert not plan.placed([b, a])  # each leaf laid out as the other's target
    assert not plan.placed([a, jax.device_put(np.ones(3), jax.devices()[0])])


@pytest.mark.parametrize("spec", [P("data"), P("model", "data"), P(None, "model"), P()])
def test_blocks_are_jax_indices(mesh: jax.sharding.Mesh, spec: P) -> None:
    shape = (8, 12)
    plan = argument_plan(mesh, (spec,), ("args[0]",))
    blocks = layout.plan(plan.targets[0], shape, jax.process_index())
    expected = NamedSharding(mesh, spec).devices_indices_map(shape)
    want = {
        d: tuple(
            slice(s.start or 0, n if s.stop is None else s.stop)
            for s, n in zip(i, shape, strict=True)
        )
        for d, i in expected.items()
    }
    assert {p.device: p.global_index for p in blocks.placements} == want
    assert blocks.local_shape == shape  # one process holds every block
