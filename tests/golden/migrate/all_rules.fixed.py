"""A pmap-era training script: one of every pattern meshkit migrate reports."""

import functools

import jax
import jax.numpy as jnp
import meshkit
import numpy as np
from jax.sharding import PmapSharding


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


# MK001: a decorator through functools.partial, with donation.
@functools.partial(meshkit.pmap_compat, axis_name="batch", donate_argnums=(0,))
def train_step(params, batch):
    grads = jax.grad(loss_fn)(params, batch)
    grads = jax.lax.pmean(grads, "batch")
    return params - 0.1 * grads, jax.lax.pmean(loss_fn(params, batch), "batch")


# MK001 + MK003: the device axis last.
gather_last = jax.pmap(lambda x: x * 2, out_axes=-1)

# MK001 + MK004: device 0's value, unchecked.
total = meshkit.pmap_compat(lambda x: jax.lax.psum(x, "i"), axis_name="i", out_axes=None)

# MK001 + MK002: a pmapped function inside another.
inner = meshkit.pmap_compat(lambda x: x + 1, axis_name="inner")


@meshkit.pmap_compat
def outer(x):
    return inner(x)


def train(params, batches, key):
    params = meshkit.replicate(params)  # MK005
    keys = meshkit.shard_prng_key(key)  # MK006
    history = []
    for batch in batches:
        params, loss = train_step(params, meshkit.shard(batch))  # MK006
        history.append(meshkit.unreplicate(loss))  # MK010
    return meshkit.unreplicate(params), history, keys  # MK005


def place(x):
    devices = jax.local_devices()
    replicated = meshkit.device_put_replicated(x, devices)  # MK007
    return replicated, meshkit.device_put_sharded([x] * len(devices), devices)  # MK007


def is_pmapped(x):
    return isinstance(x.sharding, PmapSharding)  # MK008


jax.config.update("jax_pmap_shmap_merge", True)  # MK009

compiled = train_step.lower(np.zeros((8, 2)), np.zeros((8, 2))).compile()  # MK011

# MK012: a name JAX removed.
leaves = jax.tree.leaves({"a": 1})
