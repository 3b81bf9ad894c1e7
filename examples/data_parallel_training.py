"""Data-parallel logistic regression: one loader per process, global batches, a masked loss.

Every process can generate the same synthetic dataset of 1001 rows from a seed, but loads only
its own shard of the rows, the one `meshkit.process_slice` names. `meshkit.global_batches`
joins the processes' batches into global batches for a plain `jax.jit` train step; with
pad=True the last, uneven batch is padded and a mask marks the real rows, so the loss ignores
the padding. At the end, `meshkit.gather` brings the predictions to process 0.

Run it alone (8 CPU devices in one process) or as 2 processes x 4 CPU devices:

    python examples/data_parallel_training.py
    meshkit launch -n 2 -d 4 examples/data_parallel_training.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 4

import meshkit

info = meshkit.init()  # first, before any other JAX call

import jax  # noqa: E402

if info.num_processes == 1 and info.cpu_devices is None:
    # Alone, and MESHKIT_CPU_DEVICES is not set: 8 CPU devices, as in the launched run.
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROWS, FEATURES, GLOBAL_BATCH, EPOCHS, LR = 1001, 8, 128, 5, 0.5

mesh = meshkit.make_mesh({"data": -1})  # every device of every process, batch split over all
# Which rows this process loads, and how many per step: half of each global batch on 2 processes.
part = meshkit.process_slice(mesh, "data", (GLOBAL_BATCH, FEATURES))
local_batch = part.local_shape[0]

# The same dataset in every process (same seed); each keeps its shard of the rows.
rng = np.random.default_rng(0)
x_all = rng.standard_normal((ROWS, FEATURES), dtype=np.float32)
true_w = rng.standard_normal(FEATURES, dtype=np.float32)
y_all = (x_all @ true_w + 0.3 * rng.standard_normal(ROWS) > 0).astype(np.float32)
mine = np.array_split(np.arange(ROWS), part.shard_count)[part.shard_index]  # 501 or 500 rows


def loader(epoch):
    """This process's batches for one epoch; the last one is smaller (53 or 52 rows)."""
    # Seeded by shard, not by process: processes that share a shard must load the same rows.
    order = np.random.default_rng([epoch, part.shard_index]).permutation(mine)
    for start in range(0, len(order), local_batch):
        rows = order[start : start + local_batch]
        yield {"x": x_all[rows], "y": y_all[rows]}


def loss_fn(params, batch, mask):
    logits = batch["x"] @ params["w"] + params["b"]
    nll = jax.nn.softplus(logits) - batch["y"] * logits  # binary cross-entropy, from logits
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask)  # the mean over the real rows


@jax.jit
def train_step(params, batch, mask):
    # The batch is split over "data", params are whole on every device: XLA sums the gradient
    # over the devices itself.
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, mask)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


# Replicated parameters: spec "" (no dimension split); every process passes the same values.
params = meshkit.global_array_from_local(
    {"w": np.zeros(FEATURES, np.float32), "b": np.zeros((), np.float32)}, mesh, ""
)
losses = []
for epoch in range(EPOCHS):
    step_losses = []
    for batch, mask in meshkit.global_batches(loader(epoch), mesh, "data", pad=True):
        params, loss = train_step(params, batch, mask)
        step_losses.append(loss)  # read once per epoch, so the steps queue up without waiting
    losses.append(float(jnp.mean(jnp.stack(step_losses))))  # replicated: any process reads it
    real = int(mask.sum())  # a computation on every process's devices: every process runs it
    if info.process_id == 0:
        last = f"last batch {mask.shape[0]} rows ({real} real)"
        print(f"epoch {epoch}: {len(step_losses)} steps, {last}, mean loss {losses[-1]:.4f}")
assert losses[-1] < losses[0], losses

# Predictions for the whole dataset: each process passes its shard (501 or 500 rows, padded).
x_eval, mask = meshkit.global_array_from_local(x_all[mine], mesh, "data", pad=True)
probs = jax.jit(lambda p, x: jax.nn.sigmoid(x @ p["w"] + p["b"]))(params, x_eval)
gathered = meshkit.gather({"probs": probs, "mask": mask}, to=0)  # None on other processes
if gathered is not None:
    # The real rows, in shard order, are the dataset's rows in order.
    predicted = gathered["probs"][gathered["mask"]] > 0.5
    accuracy = float(np.mean(predicted == y_all))
    print(f"accuracy on all {predicted.size} rows: {accuracy:.3f}")
    assert accuracy > 0.9, accuracy
print(f"process {info.process_id}/{info.num_processes}: OK")
