"""A first training loop: linear regression with optax's adam on global batches.

Every process can make the same synthetic dataset from a seed and loads only its rows of each
global batch. `meshkit.global_batches` joins the processes' batches into global arrays for a
plain `jax.jit` train step, and every process reads the same loss.

    python examples/first_training_loop.py
    meshkit launch -n 2 --devices-per-process 4 examples/first_training_loop.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 4

import meshkit

info = meshkit.init()  # first, before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

ROWS, FEATURES, GLOBAL_BATCH, EPOCHS = 1024, 8, 64, 3

mesh = meshkit.make_mesh({"data": -1})  # all devices of all processes; the batch split over them
# This process's part of every global batch: 32 of its 64 rows on 2 processes, all 64 alone.
part = meshkit.process_slice(mesh, "data", (GLOBAL_BATCH,))
local_batch = part.local_shape[0]

# The same dataset in every process (same seed): y = x @ w + noise.
rng = np.random.default_rng(0)
x_all = rng.standard_normal((ROWS, FEATURES), dtype=np.float32)
y_all = x_all @ rng.standard_normal(FEATURES, dtype=np.float32) + 1.0
y_all += 0.1 * rng.standard_normal(ROWS, dtype=np.float32)
mine = np.array_split(np.arange(ROWS), part.shard_count)[part.shard_index]  # this process's rows


def loader():
    """This process's batches, `local_batch` rows each, for every epoch."""
    for epoch in range(EPOCHS):
        order = np.random.default_rng([epoch, part.shard_index]).permutation(mine)
        for start in range(0, len(order), local_batch):
            rows = order[start : start + local_batch]
            yield {"x": x_all[rows], "y": y_all[rows]}


def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)  # the mean over the global batch


optimizer = optax.adam(0.05)


@jax.jit
def train_step(params, opt_state, batch):
    # The batch is split over "data", params are whole on every device: XLA sums the gradient.
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# Replicated parameters (spec "": no dimension split); every process passes the same values.
params = meshkit.global_array_from_local(
    {"w": np.zeros(FEATURES, np.float32), "b": np.zeros((), np.float32)}, mesh, ""
)
opt_state = jax.jit(optimizer.init)(params)
losses = []
with meshkit.global_batches(loader(), mesh, "data") as batches:
    for batch in batches:  # a dict of global arrays of GLOBAL_BATCH rows
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))  # a replicated scalar: every process can read it
        if info.process_id == 0 and batches.steps % 12 == 0:
            print(f"step {batches.steps}: loss {losses[-1]:.4f}")

print(f"process {info.process_id}/{info.num_processes}: final loss {losses[-1]:.6f}")
assert losses[-1] < losses[0] / 10, (losses[0], losses[-1])
# Every process ran the same steps on the same global batches, so each read the same loss.
finals = multihost_utils.process_allgather(np.float32(losses[-1]))  # one per process
assert np.all(finals == finals[0]), finals
