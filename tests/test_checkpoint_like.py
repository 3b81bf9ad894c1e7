"""`meshkit.checkpoint.restore(..., like=template)`: the tree comes back in the caller's structure.

optax states (NamedTuples), flax nnx states, dataclasses and tuples are saved, restored with a
template, and compared with what was saved: the same pytree structure (the same types) and the
same values; a hypothesis property does it for random nested structures. Templates that differ
from the checkpoint are named.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require
from hypothesis import given, settings
from hypothesis import strategies as st

import meshkit
from meshkit import MeshkitError


@pytest.fixture(autouse=True)
def _orbax():
    require("orbax.checkpoint", "orbax")


def _mesh():
    return meshkit.make_mesh({"data": -1})


def _same(a: Any, b: Any) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_an_optax_state_comes_back_as_optax_types(tmp_path):
    optax = require("optax", "optax")
    params = {"w": jnp.arange(8.0), "b": jnp.zeros(())}
    tx = optax.adam(1e-2)
    opt = tx.init(params)
    _, opt = tx.update(params, opt, params)  # counts and moments that are not zeros
    state = {"params": params, "opt": opt, "step": 3}
    meshkit.checkpoint.save(tmp_path / "c", state)
    template = {"params": params, "opt": tx.init(params), "step": 0}
    back = meshkit.checkpoint.restore(tmp_path / "c", _mesh(), like=template)
    _same(back, state)
    assert back["opt"][0].mu["w"].shape == (8,)  # a ScaleByAdamState again, not a dict
    plain = meshkit.checkpoint.restore(tmp_path / "c", _mesh())
    assert isinstance(plain["opt"][0], dict)  # without like=: dicts and lists, as before


def test_a_flax_nnx_state_updates_a_fresh_model(tmp_path):
    nnx = require("flax.nnx", "flax")
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    meshkit.checkpoint.save(tmp_path / "c", nnx.state(model))
    fresh = nnx.Linear(4, 2, rngs=nnx.Rngs(1))  # other weights
    back = meshkit.checkpoint.restore(tmp_path / "c", _mesh(), like=nnx.state(fresh))
    nnx.update(fresh, back)
    x = jnp.ones((3, 4))
    np.testing.assert_array_equal(fresh(x), model(x))


def test_a_model_and_optimizer_state_with_numbered_layers_comes_back_whole(tmp_path):
    # nnx.Sequential's layers and the (model, optimizer) pair are numbered: orbax stores them
    # under the keys "0", "1"; the template's items are matched to them.
    nnx = require("flax.nnx", "flax")
    optax = require("optax", "optax")

    def build(seed):
        model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(seed)), nnx.relu,
                               nnx.Linear(8, 1, rngs=nnx.Rngs(seed + 1)))  # fmt: skip
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    model, optimizer = build(0)
    x = jnp.ones((3, 4))
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    optimizer.update(model, grads)  # a step, and moments that are not zeros
    meshkit.checkpoint.save(tmp_path / "c", nnx.state((model, optimizer)))
    fresh_model, fresh_opt = build(5)
    back = meshkit.checkpoint.restore(
        tmp_path / "c", _mesh(), like=nnx.state((fresh_model, fresh_opt))
    )
    _same(back, nnx.state((model, optimizer)))
    nnx.update((fresh_model, fresh_opt), back)
    np.testing.assert_array_equal(fresh_model(x), model(x))
    assert int(fresh_opt.step[...]) == 1


class Moments(NamedTuple):
    mu: Any
    nu: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    moments: Moments
    step: Any


def _leaf(draw, i: int) -> np.ndarray:
    shape = draw(st.sampled_from([(), (3,), (8,), (2, 4)]))
    return np.full(shape, i, np.float32) + np.arange(int(np.prod(shape)), dtype=np.float32).reshape(
        shape
    )


@st.composite
def trees(draw, depth: int = 0) -> Any:
    counter = draw(st.integers(0, 1000))
    if depth >= 2 or draw(st.booleans()):
        return _leaf(draw, counter)
    kind = draw(st.sampled_from(["dict", "list", "tuple", "named", "dataclass"]))
    kids = [draw(trees(depth + 1)) for _ in range(draw(st.integers(1, 3)))]
    if kind == "dict":
        return {f"k{i}": k for i, k in enumerate(kids)}
    if kind == "list":
        return kids
    if kind == "tuple":
        return tuple(kids)
    if kind == "named":
        return Moments(kids[0], draw(trees(depth + 1)))
    return TrainState(
        kids[0], Moments(draw(trees(depth + 1)), draw(trees(depth + 1))), _leaf(draw, 7)
    )


@settings(max_examples=12, deadline=None)
@given(trees())
def test_any_structure_comes_back_as_it_was_saved(tmp_path_factory, tree):
    root = tmp_path_factory.mktemp("like")
    mesh = _mesh()
    state = {"state": jax.tree.map(lambda x: jax.device_put(x), tree)}
    meshkit.checkpoint.save(root / "c", state)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), state)
    _same(meshkit.checkpoint.restore(root / "c", mesh, like=template), state)


def test_a_template_that_differs_is_named(tmp_path):
    state = {"params": {"w": jnp.ones(8)}, "moments": Moments(jnp.zeros(8), jnp.zeros(8))}
    meshkit.checkpoint.save(tmp_path / "c", state)
    mesh = _mesh()
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.restore: like= has \['params'\]\['b'\], which the checkpoint "
        r"lacks: at \['params'\] the checkpoint has the keys \['w'\].\nConsider as like= the state",
    ):
        meshkit.checkpoint.restore(
            tmp_path / "c", mesh, like={**state, "params": {"w": jnp.ones(8), "b": jnp.ones(())}}
        )
    with pytest.raises(
        MeshkitError,
        match=r"like= has \['params'\]\['w'\] of shape \(4,\); the checkpoint's is of shape \(8,\)",
    ):
        meshkit.checkpoint.restore(
            tmp_path / "c", mesh, like={**state, "params": {"w": jnp.ones(4)}}
        )
    with pytest.raises(
        MeshkitError,
        match=r"the checkpoint has \['moments'\]\['nu'\], which like= lacks; a restore into like= "
        r"would drop it",
    ):
        meshkit.checkpoint.restore(
            tmp_path / "c", mesh, like={**state, "moments": {"mu": jnp.zeros(8)}}
        )
