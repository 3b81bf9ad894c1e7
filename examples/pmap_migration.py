"""Before and after: a pmap-style training loop moved to meshkit by changing its imports.

`legacy_training` is written the way flax's ImageNet example trains: parameters replicated to
every device, each process's batch reshaped to (devices, per-device batch, ...), per-device
dropout keys, gradients averaged with `jax.lax.pmean`, metrics read back with `get_metrics`.
It takes the three things old code imports as arguments:

    before: jax.pmap,            flax.jax_utils,  flax.training.common_utils
    after:  meshkit.pmap_compat, meshkit,         meshkit

and this file runs it both ways and checks that the losses agree. (flax is not a dependency of
meshkit: the "before" run uses `FlaxLike`, a few lines doing what those flax helpers do.)

Run it alone (8 CPU devices in one process) or as 2 processes x 4 CPU devices:

    python examples/pmap_migration.py
    meshkit launch -n 2 -d 4 examples/pmap_migration.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 4

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import meshkit

FEATURES, HIDDEN, CLASSES, PER_DEVICE_BATCH, STEPS, LR = 16, 32, 4, 8, 30, 0.3


# --8<-- [start:legacy]
def legacy_training(pmap: Any, jax_utils: Any, common_utils: Any) -> tuple[np.ndarray, Any]:
    """A data-parallel MLP classifier, pmap style. Returns (loss per step, final parameters)."""
    n = jax.local_device_count()
    rng = np.random.default_rng(0)  # the same parameters and data-generating model everywhere
    params = {
        "w1": rng.standard_normal((FEATURES, HIDDEN), dtype=np.float32) * 0.3,
        "w2": rng.standard_normal((HIDDEN, CLASSES), dtype=np.float32) * 0.3,
    }
    centres = rng.standard_normal((CLASSES, FEATURES), dtype=np.float32) * 2
    data = np.random.default_rng(1 + jax.process_index())  # each process loads its own rows

    def batches():
        while True:
            labels = data.integers(0, CLASSES, n * PER_DEVICE_BATCH)
            x = centres[labels] + data.standard_normal((len(labels), FEATURES), dtype=np.float32)
            yield {"x": x, "y": labels.astype(np.int32)}

    def train_step(params, batch, key):
        def loss_fn(p):
            h = jax.nn.relu(batch["x"] @ p["w1"])
            keep = jax.random.bernoulli(key, 0.9, h.shape)  # dropout, a key per device
            logits = (jnp.where(keep, h / 0.9, 0.0)) @ p["w2"]
            picked = jnp.take_along_axis(logits, batch["y"][:, None], axis=1)[:, 0]
            return jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, axis_name="batch")
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return params, {"loss": jax.lax.pmean(loss, axis_name="batch")}

    p_train_step = pmap(train_step, axis_name="batch", donate_argnums=(0,))
    p_params = jax_utils.replicate(params)
    root = jax.random.PRNGKey(0)
    history = []
    for step, batch in zip(range(STEPS), batches(), strict=False):
        keys = common_utils.shard_prng_key(jax.random.fold_in(root, step))
        p_params, metrics = p_train_step(p_params, common_utils.shard(batch), keys)
        history.append(metrics)
    losses = common_utils.get_metrics(history)["loss"]
    return np.asarray(losses), jax.device_get(jax_utils.unreplicate(p_params))


# --8<-- [end:legacy]


class FlaxLike:
    """What flax.jax_utils / flax.training.common_utils do, for the "before" run."""

    @staticmethod
    def replicate(tree):
        n = jax.local_device_count()
        return jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))), tree)

    @staticmethod
    def unreplicate(tree):
        return jax.tree.map(lambda x: x[0], tree)

    @staticmethod
    def shard(tree):
        n = jax.local_device_count()
        return jax.tree.map(lambda x: x.reshape((n, -1, *x.shape[1:])), tree)

    @staticmethod
    def shard_prng_key(key):
        return jax.random.split(key, jax.local_device_count())

    @staticmethod
    def get_metrics(history):
        rows = [jax.device_get(FlaxLike.unreplicate(m)) for m in history]
        return jax.tree.map(lambda *xs: np.stack(xs), *rows)


def compare() -> np.ndarray:
    """Run the loop before and after; check they agree; return the losses."""
    before = legacy_training(jax.pmap, FlaxLike, FlaxLike)
    after = legacy_training(meshkit.pmap_compat, meshkit, meshkit)
    np.testing.assert_allclose(after[0], before[0], rtol=1e-5, atol=1e-6)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    jax.tree.map(close, after[1], before[1])  # the final parameters too
    return after[0]


if __name__ == "__main__":
    info = meshkit.init()  # before any JAX computation
    if info.num_processes == 1 and info.cpu_devices is None:
        jax.config.update("jax_num_cpu_devices", 8)  # alone: 8 CPU devices, as when launched
    losses = compare()
    me, count = jax.process_index(), jax.process_count()
    print(f"process {me}/{count}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {STEPS} steps")
    print(f"process {me}/{count}: jax.pmap and meshkit.pmap_compat agree on every step's loss")
