"""A sequence model trained the pmap way, written as flax's wmt example is.

Legacy code as users have it: a linen model with dropout, the dropout key folded per device
and step, `common_utils.onehot` and weighted metrics summed with ``psum``,
`pmap(partial(train_step, config=...), donate_argnums=(0,))`, `jax_utils.replicate`,
`common_utils.shard`, `get_metrics`, a `tohost` helper called on pmap outputs and on a numpy
batch, and a decoding step with ``static_broadcasted_argnums``. Each process loads its own rows
of a global batch of 16. Printed: ``METRICS <json>`` from every process.

Run it as written (plain `jax.pmap`, one process), with `jax.pmap` and flax's helpers replaced
by meshkit's, or after `meshkit migrate --fix`.
"""

import dataclasses
import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax.training import common_utils, train_state

VOCAB = 12
LENGTH = 6
GLOBAL_BATCH = 16
STEPS = 5


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 16
    dropout_rate: float = 0.1
    label_smoothing: float = 0.1


class SequenceModel(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens, train: bool):
        x = nn.Embed(VOCAB, self.config.width)(tokens)
        x = nn.Dense(self.config.width)(x)
        x = nn.Dropout(rate=self.config.dropout_rate, deterministic=not train)(nn.gelu(x))
        return nn.Dense(VOCAB)(x)


def tohost(x):
    """Collect batches from all devices to host and flatten batch dimensions."""
    n_device, n_batch, *remaining_dims = x.shape
    return np.array(x).reshape((n_device * n_batch,) + tuple(remaining_dims))


def compute_weighted_cross_entropy(logits, targets, weights, label_smoothing):
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (VOCAB - 1)
    soft = common_utils.onehot(targets, VOCAB, on_value=confidence, off_value=low)
    loss = -jnp.sum(soft * nn.log_softmax(logits), axis=-1)
    return (loss * weights).sum(), weights.sum()


def compute_metrics(logits, labels, weights, label_smoothing):
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
    correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
    metrics = {"loss": loss, "accuracy": correct, "denominator": weight_sum}
    return jax.lax.psum(metrics, axis_name="batch")


def train_step(state, batch, config, dropout_rng):
    inputs, targets = batch["inputs"], batch["targets"]
    weights = jnp.where(targets > 0, 1.0, 0.0)
    # One key per device and step, the same on any number of processes.
    rng = jax.random.fold_in(jax.random.fold_in(dropout_rng, state.step), jax.lax.axis_index("batch"))

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, inputs, train=True, rngs={"dropout": rng})
        loss, weight_sum = compute_weighted_cross_entropy(
            logits, targets, weights, config.label_smoothing
        )
        return loss / weight_sum, logits

    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = jax.lax.pmean(grads, "batch")
    new_state = state.apply_gradients(grads=grads)
    return new_state, compute_metrics(logits, targets, weights, config.label_smoothing)


def predict_step(params, inputs, apply_fn, steps):
    tokens = inputs
    for _ in range(steps):
        tokens = jnp.argmax(apply_fn({"params": params}, tokens, train=False), -1)
    return tokens


def batches(seed):
    rng = np.random.default_rng(seed)
    per = GLOBAL_BATCH // jax.process_count()
    mine = slice(jax.process_index() * per, (jax.process_index() + 1) * per)
    for _ in range(STEPS):
        inputs = rng.integers(1, VOCAB, size=(GLOBAL_BATCH, LENGTH)).astype(np.int32)
        targets = np.roll(inputs, -1, axis=1)
        targets[:, -1] = 0  # padding: weight 0
        yield {"inputs": inputs[mine], "targets": targets[mine]}


def main():
    config = Config()
    model = SequenceModel(config)
    params = model.init(jax.random.key(0), jnp.ones((1, LENGTH), jnp.int32), train=False)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 0.05, 2, STEPS), weight_decay=0.01)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params["params"], tx=tx)
    state = jax_utils.replicate(state)
    dropout_rngs = jax_utils.replicate(jax.random.key(1))
    p_train_step = jax.pmap(
        functools.partial(train_step, config=config), axis_name="batch", donate_argnums=(0,)
    )
    p_pred_step = jax.pmap(predict_step, axis_name="batch", static_broadcasted_argnums=(2, 3))
    metrics_all = []
    for batch in batches(3):
        shards = common_utils.shard(batch)
        state, metrics = p_train_step(state, shards, dropout_rng=dropout_rngs)
        metrics_all.append(metrics)
    metrics_all = common_utils.get_metrics(metrics_all)
    denominator = metrics_all.pop("denominator")
    summary = {k: (v / denominator).tolist() for k, v in metrics_all.items()}

    batch = next(batches(4))
    shards = common_utils.shard(batch)
    predicted = p_pred_step(state.params, shards["inputs"], model.apply, 2)
    report = {
        "train": summary,
        "predicted": tohost(predicted).tolist(),
        "inputs": tohost(shards["inputs"]).tolist(),  # tohost of numpy, as wmt's eval does
        "step": int(jax_utils.unreplicate(state).step),
        "process": jax.process_index(),
    }
    print("METRICS " + json.dumps(report), flush=True)


if __name__ == "__main__":
    if os.environ.get("LEGACY_CPU_DEVICES"):
        jax.config.update("jax_num_cpu_devices", int(os.environ["LEGACY_CPU_DEVICES"]))
    main()
