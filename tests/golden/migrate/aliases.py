"""Every way of importing the legacy names that meshkit migrate resolves."""

import jax as j
from jax import pmap
from jax import pmap as pm
from jax import device_put_sharded
import flax
import flax.jax_utils as ju
from flax.jax_utils import replicate as rep, prefetch_to_device
from flax.training.common_utils import get_metrics
import flax.training.common_utils as cu
from functools import partial

from mylib import shard  # someone else's shard: not reported

a = j.pmap(lambda x: x)
b = pmap(lambda x: x)
c = pm(lambda x: x)
d = partial(pm, axis_name="i")
e = ju.pad_shard_unpad(a)
f = rep({"w": 1.0})
g = flax.jax_utils.unreplicate(f)
h = prefetch_to_device(iter([]), 2)
i = get_metrics([])
k = cu.shard_prng_key(j.random.PRNGKey(0))
m = device_put_sharded([1, 2], j.local_devices())
n = shard(1)


def replicate(x):  # a local function of the same name: not reported
    return x


o = replicate(1)
