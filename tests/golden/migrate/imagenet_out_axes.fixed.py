"""imagenet's train step style: the state comes back once (out_axes None), metrics per device."""

import functools
from typing import NamedTuple

import jax
import meshkit


class State(NamedTuple):
    step: jax.Array
    w: jax.Array


def train_step(state, batch):
    grad = jax.lax.pmean((state.w * batch).mean(), "batch")
    return State(state.step + 1, state.w - 0.1 * grad), {"loss": jax.lax.pmean(grad, "batch")}


# MK001 + MK004, rewritten: pmap_compat takes this out_axes prefix (and checks it).
p_train_step = meshkit.pmap_compat(train_step, axis_name="batch", in_axes=(None, 0), out_axes=(None, 0))


@functools.partial(meshkit.pmap_compat, axis_name="batch", out_axes=None)  # MK001 + MK004, rewritten
def p_total(batch):
    return jax.lax.psum(batch.sum(), "batch")


def train(state, batches):
    losses, steps = [], []
    for batch in batches:
        state, metrics = p_train_step(state, batch)
        steps.append(int(state.step))  # one value (out_axes None): not a host read
        losses.append(meshkit.local_from_global(metrics["loss"]))  # MK010, rewritten: per device
    total = float(p_total(batches[0]))  # out_axes=None: one value, not a host read
    return state, steps, losses, total
