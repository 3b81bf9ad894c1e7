"""Names of the pmap era that JAX 0.10.2 and 0.12 removed: meshkit migrate reports MK012."""

import jax
from jax.experimental import maps
from jax.experimental.maps import xmap

import jax as J


def step(params, grads):
    # fixed: jax.tree.map, through the file's own `jax`
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def count(tree):
    # fixed: a from-import, used through jax (the import goes, `import jax` stays)
    return len(jax.tree.leaves(tree))


def merge(a, b):
    # fixed, keeping the alias J
    return J.tree.map(lambda x, y: x + y, a, b)


def shape_of(x: jax.Array) -> tuple:
    # fixed: jax.Array
    return x.shape


spec = jax.sharding.PartitionSpec("data")  # fixed: jax.sharding.PartitionSpec (the alias P becomes the full name)
mesh = maps.Mesh(jax.devices(), ("data",))  # not fixed: a removed module
run = xmap(lambda x: x, in_axes=["i"], out_axes=["i"])  # not fixed
flat, treedef = jax.tree.flatten({"a": 1})  # fixed
