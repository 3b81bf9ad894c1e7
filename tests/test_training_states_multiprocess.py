"""Real training states across 2 processes x 4 CPU devices: nothing compared carries an address.

A flax linen `TrainState` holds `apply_fn` and optax's closures as static fields; an nnx state,
a `functools.partial` and a `jax.tree_util.Partial` hold functions too. Python's own texts for
them differ in every process, so processes that compared them never agreed. Here each goes
through `meshkit.pmap_compat`, `meshkit.spmd` and `meshkit.global_array_from_local` and must
equal plain JAX on one device; programs that do differ between the processes are still named.

Functions starting with an underscore run inside the launched processes.
"""

from __future__ import annotations

import pytest
from ranks.preloads import ECOSYSTEM

pytestmark = [pytest.mark.multiprocess, pytest.mark.warm_cluster(preload=ECOSYSTEM)]


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


@pytest.fixture(autouse=True)
def _ecosystem():
    from conftest import require

    require("flax", "flax TrainState and nnx states")
    require("optax", "optax transformations inside the states")


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def _loss(params, apply_fn, x, y):
    import jax.numpy as jnp

    return jnp.mean((apply_fn(params, x) - y) ** 2)


def _train_step(state, x, y, *, scale):
    import jax

    loss, grads = jax.value_and_grad(_loss)(state.params, state.apply_fn, x, y)
    grads = jax.lax.pmean(grads, "batch")
    return state.apply_gradients(grads=grads), jax.lax.pmean(loss, "batch") * scale


def _scale(x, k):
    return x * k


def _psum_scaled(block, k):
    import jax

    return jax.lax.psum(block.sum() * k, "data")


def _states_through_every_entry():
    import functools

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from flax.training import train_state

    import meshkit

    me, n = jax.process_index(), jax.local_device_count()
    x, y = _data()
    rows = slice(me * 2 * n, (me + 1) * 2 * n)  # this process's devices' rows, 2 per device
    model = nn.Dense(1)
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))
    tx = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(0.1))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    # pmap_compat over a partial of the step, as flax's examples write it; a host batch beside
    # the replicated state (its structure, with apply_fn and tx, is what the processes compare).
    p_step = meshkit.pmap_compat(functools.partial(_train_step, scale=1.0), "batch")
    replicated = meshkit.replicate(state)
    ours = []
    for _ in range(3):
        replicated, loss = p_step(replicated, x[rows].reshape(n, 2, 4), y[rows].reshape(n, 2, 1))
        ours.append(float(np.asarray(loss)[0]))
    ref, theirs = state, []
    for _ in range(3):
        loss, grads = jax.value_and_grad(_loss)(ref.params, ref.apply_fn, x, y)
        ref = ref.apply_gradients(grads=grads)
        theirs.append(float(loss))

    # A jax.tree_util.Partial as a pmap_compat argument beside host data.
    partial_out = meshkit.pmap_compat(lambda f, v: jax.lax.psum(f(v), "batch"), "batch",
                                      in_axes=(None, 0))(
        jax.tree_util.Partial(_scale, k=2.0), x[rows].reshape(n, 2, 4)
    )  # fmt: skip

    # An nnx model's state (host copies) through spmd, replicated, beside a sharded batch.
    mesh = meshkit.make_mesh({"data": -1})
    linear = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    graph, nnx_state = nnx.split(linear)
    host_state = jax.tree.map(np.asarray, nnx_state)

    @meshkit.spmd(mesh=mesh, in_specs=("_", "data"), out_specs=jax.sharding.PartitionSpec())
    def nnx_sum(s, xb):
        return jax.lax.psum(nnx.merge(graph, s)(xb).sum(), "data")

    nnx_ours = float(nnx_sum(host_state, x[rows]))
    nnx_theirs = float(linear(jnp.asarray(x)).sum())

    # spmd over a functools.partial, with host data.
    scaled_sum = meshkit.spmd(
        functools.partial(_psum_scaled, k=2.0),
        mesh=mesh,
        in_specs="data",
        out_specs=jax.sharding.PartitionSpec(),
    )
    spmd_partial = (float(scaled_sum(x[rows])), float(2.0 * x.sum()))

    # A Partial holding this process's rows, assembled into a global Partial.
    held = meshkit.global_array_from_local(jax.tree_util.Partial(_scale, x[rows]), mesh, "data")
    assembled = float(jax.jit(lambda p: p(3.0).sum())(held))
    return {
        "ours": ours,
        "theirs": theirs,
        "partial": np.asarray(partial_out)[0].tolist(),
        "partial_ref": (2.0 * x.reshape(8, 2, 4).sum(0)).tolist(),
        "nnx": (nnx_ours, nnx_theirs),
        "assembled": (assembled, float(3.0 * x.sum())),
        "spmd_partial": spmd_partial,
    }


def test_training_states_and_partials_go_through_every_entry_and_equal_plain_jax(warm_cluster):
    import numpy as np

    for r in warm_cluster.run(_states_through_every_entry, timeout=240):
        np.testing.assert_allclose(r["ours"], r["theirs"], rtol=1e-6)
        assert r["ours"][0] > r["ours"][-1]  # it trains
        np.testing.assert_allclose(r["partial"], r["partial_ref"], rtol=1e-6)
        np.testing.assert_allclose(*r["nnx"], rtol=1e-5)
        np.testing.assert_allclose(*r["assembled"], rtol=1e-5)
        np.testing.assert_allclose(*r["spmd_partial"], rtol=1e-5)


def _programs_that_differ():
    """Process 1 passes another function, another optimizer, another static: each is named."""
    import functools

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import meshkit

    me, n = jax.process_index(), jax.local_device_count()
    x, y = _data()
    rows = slice(me * 2 * n, (me + 1) * 2 * n)
    xb, yb = x[rows].reshape(n, 2, 4), y[rows].reshape(n, 2, 1)
    messages = {}
    apply = meshkit.pmap_compat(lambda f, v: f(v), "batch", in_axes=(None, 0))
    try:
        apply(jax.tree_util.Partial(_scale if me == 0 else _other, k=2.0), xb)
    except meshkit.MeshkitError as e:
        messages["function"] = str(e)

    model = nn.Dense(1)
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))
    tx = optax.adam(0.1) if me == 0 else optax.sgd(0.1)
    state = meshkit.replicate(
        train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    )
    p_step = meshkit.pmap_compat(functools.partial(_train_step, scale=1.0), "batch")
    try:
        p_step(state, xb, yb)
    except meshkit.MeshkitError as e:
        messages["optimizer"] = str(e)

    # The same structure, another static value baked into the program: the compile-time
    # comparison names it.
    same_state = meshkit.replicate(
        train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(0.1))
    )
    other = meshkit.pmap_compat(functools.partial(_train_step, scale=1.0 + me), "batch")
    try:
        other(same_state, xb, yb)
    except meshkit.DivergenceError as e:
        messages["static"] = str(e)
    return messages


def _other(x, k):
    return x - k


def test_processes_with_other_functions_optimizers_or_statics_are_named(warm_cluster):
    results = warm_cluster.run(
        _programs_that_differ, timeout=180, env={"MESHKIT_CHECK_TIMEOUT": "30"}
    )
    for messages in results:
        function = messages["function"]
        assert "processes passed pytrees of different structure" in function
        assert "process 0: " in function
        assert "test_training_states_multiprocess._scale:" in function
        assert "test_training_states_multiprocess._other:" in function
        assert "0x" not in function
        optimizer = messages["optimizer"]
        assert "processes passed pytrees of different structure" in optimizer
        assert "ScaleByAdamState" in optimizer
        assert "0x" not in optimizer
        static = messages["static"]
        assert "compiled different programs" in static
        assert "_train_step" in static
        assert "0x" not in static


def test_the_same_states_in_one_process_of_eight_devices():
    # This process alone (8 CPU devices from conftest): the same program, the same numbers.
    import numpy as np

    r = _states_through_every_entry()
    np.testing.assert_allclose(r["ours"], r["theirs"], rtol=1e-6)
    np.testing.assert_allclose(r["partial"], r["partial_ref"], rtol=1e-6)
    np.testing.assert_allclose(*r["nnx"], rtol=1e-5)
    np.testing.assert_allclose(*r["assembled"], rtol=1e-5)
    np.testing.assert_allclose(*r["spmd_partial"], rtol=1e-5)
