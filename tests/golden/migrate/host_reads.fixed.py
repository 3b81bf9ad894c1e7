"""Host reads of pmap outputs wherever the value flows (MK010), and what is not one."""

import functools

import jax
import meshkit
import numpy as np


@functools.partial(meshkit.pmap_compat, axis_name="batch")
def train_step(state, batch):
    return state, {"loss": jax.lax.pmean((state * batch).sum(), "batch")}


p_predict = meshkit.pmap_compat(lambda state, x: state * x)
p_stats = meshkit.pmap_compat(lambda x: x.mean())


class Trainer:
    def __init__(self, state):
        self.state = meshkit.replicate(state)  # MK005

    def step(self, batch):
        self.state, metrics = train_step(self.state, meshkit.shard(batch))
        return metrics

    def save(self):
        host = jax.device_get(meshkit.unreplicate(self.state))  # MK010
        return host


def evaluate(state, batches):
    preds = []
    for batch in batches:
        preds.append(p_predict(state, batch))
    stacked = np.stack([meshkit.local_from_global(p) for p in preds])  # MK010: np.array of each
    return stacked, jax.device_get(preds)  # MK010: the whole list


def first_loss(trainer, batch):
    metrics = trainer.step(batch)  # not followed: trainer is a parameter
    loss = p_stats(batch)
    value = float(meshkit.unreplicate(loss))  # MK010
    total = sum(x.item() for x in [loss])  # MK010: a comprehension over a list of outputs
    return value, total, metrics


def run(state, batches):
    state = meshkit.replicate(state)  # MK005
    for batch in batches:
        state, metrics = train_step(state, batch)
        print(meshkit.unreplicate(metrics["loss"]))  # MK010: a field, then an entry
    scores = jax.tree_util.tree_map(np.asarray, metrics)  # MK010
    out = train_step(state, batches[0])
    picked = out[0]  # train_step returns a tuple: out[0] is an output, not a read
    host_state = meshkit.local_from_global(picked)  # MK010 (fixed: meshkit.local_from_global)
    state = meshkit.unreplicate(state)  # MK005
    print(state[0])  # state is one device's value now: not reported
    local = np.zeros(3)
    return scores, host_state, local[0], summarize(out[1])  # local[0] is numpy: not reported


def summarize(metrics):
    return {k: v.mean() for k, v in metrics.items()}  # stays on device: not a read


def keep(state, batch):
    new = train_step(state, batch)[0]
    new = new.replace(step=0) if hasattr(new, "replace") else new * 2  # still on device
    return meshkit.unreplicate(new)  # MK010 (fixed: meshkit.unreplicate)


def predict_all(state, batches):
    return [p_predict(state, b) for b in batches]


def best(state, batches):
    scores = predict_all(state, batches)  # a list of pmap outputs, through a return
    return max(float(meshkit.unreplicate(s)) for s in scores)  # MK010 (fixed: meshkit.unreplicate)
