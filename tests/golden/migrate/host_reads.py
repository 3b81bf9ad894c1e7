"""Host reads of pmap outputs wherever the value flows (MK010), and what is not one."""

import functools

import jax
import numpy as np
from flax import jax_utils
from flax.training import common_utils


@functools.partial(jax.pmap, axis_name="batch")
def train_step(state, batch):
    return state, {"loss": jax.lax.pmean((state * batch).sum(), "batch")}


p_predict = jax.pmap(lambda state, x: state * x)
p_stats = jax.pmap(lambda x: x.mean())


class Trainer:
    def __init__(self, state):
        self.state = jax_utils.replicate(state)  # MK005

    def step(self, batch):
        self.state, metrics = train_step(self.state, common_utils.shard(batch))
        return metrics

    def save(self):
        host = jax.device_get(jax.tree_util.tree_map(lambda x: x[0], self.state))  # MK010
        return host


def evaluate(state, batches):
    preds = []
    for batch in batches:
        preds.append(p_predict(state, batch))
    stacked = np.stack([np.array(p) for p in preds])  # MK010: np.array of each
    return stacked, jax.device_get(preds)  # MK010: the whole list


def first_loss(trainer, batch):
    metrics = trainer.step(batch)  # not followed: trainer is a parameter
    loss = p_stats(batch)
    value = float(loss[0])  # MK010
    total = sum(x.item() for x in [loss])  # MK010: a comprehension over a list of outputs
    return value, total, metrics


def run(state, batches):
    state = jax_utils.replicate(state)  # MK005
    for batch in batches:
        state, metrics = train_step(state, batch)
        print(metrics["loss"][0])  # MK010: a field, then an entry
    scores = jax.tree_util.tree_map(np.asarray, metrics)  # MK010
    out = train_step(state, batches[0])
    picked = out[0]  # train_step returns a tuple: out[0] is an output, not a read
    host_state = np.asarray(picked)  # MK010 (fixed: meshkit.local_from_global)
    state = jax_utils.unreplicate(state)  # MK005
    print(state[0])  # state is one device's value now: not reported
    local = np.zeros(3)
    return scores, host_state, local[0], summarize(out[1])  # local[0] is numpy: not reported


def summarize(metrics):
    return {k: v.mean() for k, v in metrics.items()}  # stays on device: not a read


def keep(state, batch):
    new = train_step(state, batch)[0]
    new = new.replace(step=0) if hasattr(new, "replace") else new * 2  # still on device
    return jax.tree_util.tree_map(lambda a: a[0], new)  # MK010 (fixed: meshkit.unreplicate)


def predict_all(state, batches):
    return [p_predict(state, b) for b in batches]


def best(state, batches):
    scores = predict_all(state, batches)  # a list of pmap outputs, through a return
    return max(float(s[0]) for s in scores)  # MK010 (fixed: meshkit.unreplicate)
