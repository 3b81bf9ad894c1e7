"""An image classifier trained the pmap way, written as flax's imagenet example is.

Legacy code as users have it: a linen model with BatchNorm synced over the pmapped axis, a
`TrainState` carrying the batch statistics, `jax_utils.replicate`, `common_utils.shard`,
`jax_utils.prefetch_to_device`, `pmap(partial(train_step, ...))`, `get_metrics`, an evaluation
through `jax_utils.pad_shard_unpad`, and a step with ``in_axes=(None, 0), out_axes=(None, 0)``
whose state comes back as one copy. Each process loads its own rows of a global batch of 16.
Printed: ``METRICS <json>`` (from every process) with the training metrics, this process's
evaluation predictions and the final step.

Run it as written (plain `jax.pmap`, one process), with `jax.pmap` and flax's helpers replaced
by meshkit's, or after `meshkit migrate --fix`.
"""

import functools
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax.training import common_utils, train_state

GLOBAL_BATCH = 16
STEPS = 6
EVAL_ROWS = 36  # global; not a multiple of 8 (nor 18 of 4): pad_shard_unpad pads it


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(features=4, kernel_size=(3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name="batch")(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(features=4)(x)


class TrainState(train_state.TrainState):
    batch_stats: Any


def dataset(seed, rows):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(rows, 8, 8, 1)).astype(np.float32)
    labels = (images[:, :4, :4, 0].mean((1, 2)) > 0).astype(np.int32) + 2 * (
        images[:, 4:, 4:, 0].mean((1, 2)) > 0
    ).astype(np.int32)
    return {"image": images, "label": labels}


def my_rows(total):
    per = total // jax.process_count()
    return slice(jax.process_index() * per, (jax.process_index() + 1) * per)


def create_train_state(rng, learning_rate_fn):
    model = CNN()
    variables = model.init(rng, jnp.ones((1, 8, 8, 1)), train=False)
    tx = optax.sgd(learning_rate=learning_rate_fn, momentum=0.9)
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )


def compute_metrics(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return jax.lax.pmean({"loss": loss, "accuracy": accuracy}, axis_name="batch")


def train_step(state, batch, learning_rate_fn):
    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, (logits, updates)

    (_, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = jax.lax.pmean(grads, axis_name="batch")
    metrics = compute_metrics(logits, batch["label"])
    metrics["learning_rate"] = learning_rate_fn(state.step)
    new_state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return new_state, metrics


def eval_step(state, batch):
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    return state.apply_fn(variables, batch["image"], train=False)


def sync_batch_stats(state):
    cross_replica_mean = jax.pmap(lambda x: jax.lax.pmean(x, "x"), "x")
    return state.replace(batch_stats=cross_replica_mean(state.batch_stats))


def batches(data):
    rows = my_rows(GLOBAL_BATCH)
    for step in range(STEPS):
        start = step * GLOBAL_BATCH
        chunk = {k: v[start : start + GLOBAL_BATCH][rows] for k, v in data.items()}
        yield common_utils.shard(chunk)


def main():
    learning_rate_fn = optax.linear_schedule(0.1, 0.01, STEPS)
    state = create_train_state(jax.random.key(0), learning_rate_fn)
    state = jax_utils.replicate(state)
    p_train_step = jax.pmap(
        functools.partial(train_step, learning_rate_fn=learning_rate_fn), axis_name="batch"
    )
    train = dataset(1, GLOBAL_BATCH * STEPS)
    train_metrics = []
    for batch in jax_utils.prefetch_to_device(batches(train), 2):
        state, metrics = p_train_step(state, batch)
        train_metrics.append(metrics)
    summary = jax.tree_util.tree_map(lambda x: x.tolist(), common_utils.get_metrics(train_metrics))
    state = sync_batch_stats(state)

    # One more step with the state as one copy: in_axes=(None, 0), out_axes=(None, 0).
    single = jax_utils.unreplicate(state)
    p_single_step = jax.pmap(
        functools.partial(train_step, learning_rate_fn=learning_rate_fn),
        axis_name="batch",
        in_axes=(None, 0),
        out_axes=(None, 0),
    )
    single, metrics = p_single_step(single, next(batches(train)))
    final_step = int(single.step)

    p_eval_step = jax.pmap(eval_step, axis_name="batch")
    held_out = dataset(2, EVAL_ROWS)
    mine = {k: v[my_rows(EVAL_ROWS)] for k, v in held_out.items()}
    logits = jax_utils.pad_shard_unpad(p_eval_step, static_argnums=(0,))(
        jax_utils.replicate(single), mine
    )
    report = {
        "train": summary,
        "last_loss": float(np.asarray(metrics["loss"])[0]),
        "predictions": np.asarray(logits).argmax(-1).tolist(),
        "logits_sum": float(np.asarray(logits, np.float64).sum()),
        "final_step": final_step,
        "process": jax.process_index(),
    }
    print("METRICS " + json.dumps(report), flush=True)


if __name__ == "__main__":
    if os.environ.get("LEGACY_CPU_DEVICES"):
        jax.config.update("jax_num_cpu_devices", int(os.environ["LEGACY_CPU_DEVICES"]))
    main()
