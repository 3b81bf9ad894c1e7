"""Names of the pmap era that JAX 0.10.2 and 0.12 removed: meshkit migrate reports MK012."""

import jax
from jax.experimental import maps
from jax.experimental.maps import xmap
from jax.config import config  # not a module any more: `from jax import config`
from jax.experimental import optix  # removed module: optax

import jax as J
import meshkit


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
logs = jax.tree.map(lambda a, b: a + b, {"x": 1}, {"x": 2})  # fixed: jax.tree.map
shards = meshkit.device_put_sharded([1, 2], jax.devices()[:2])  # MK007 and MK012, fixed
