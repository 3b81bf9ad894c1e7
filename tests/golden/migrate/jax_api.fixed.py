"""JAX's 2025-26 API moves: shard_map, check_rep, mesh contexts, cloud_tpu_init, library pmaps."""

import functools

import equinox as eqx
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("x",))


# MK013 + MK014: positional mesh and specs named, check_rep renamed
def total(a):
    f = jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False)
    return f(a)


@functools.partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=True)
def double(b):  # MK013 + MK014 through functools.partial
    return b * 2


def modern(a):  # MK014 alone: jax.shard_map already, the old keyword
    return jax.shard_map(lambda b: b, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)(a)


OPTIONS = {"check_rep": False}


def through_kwargs(a):  # MK014, not fixed: the key is in OPTIONS
    return jax.shard_map(lambda b: b, mesh=mesh, in_specs=P("x"), out_specs=P("x"), **OPTIONS)(a)


def contexts(a, m: Mesh):
    with jax.set_mesh(mesh):  # MK015, fixed
        b = a + 1
    with jax.set_mesh(m):  # MK015, fixed
        b = b + 1
    with Mesh(np.array(jax.devices()), ("y",)) as other:  # MK015, not fixed: `as`
        b = b + len(other.axis_names)
    return b


step = nnx.pmap(lambda m, x: m(x), axis_name="batch")  # MK017
filtered = eqx.filter_pmap(lambda x: x + 1)  # MK017
