"""Every way of importing the legacy names that meshkit migrate resolves."""

import jax as j
from functools import partial

import meshkit
from mylib import shard  # someone else's shard: not reported

a = meshkit.pmap_compat(lambda x: x)
b = meshkit.pmap_compat(lambda x: x)
c = meshkit.pmap_compat(lambda x: x)
d = partial(meshkit.pmap_compat, axis_name="i")
e = meshkit.pad_shard_unpad(a)
f = meshkit.replicate({"w": 1.0})
g = meshkit.unreplicate(f)
h = meshkit.prefetch_to_device(iter([]), 2)
i = meshkit.get_metrics([])
k = meshkit.shard_prng_key(j.random.PRNGKey(0))
m = meshkit.device_put_sharded([1, 2], j.local_devices())
n = shard(1)


def replicate(x):  # a local function of the same name: not reported
    return x


o = replicate(1)
