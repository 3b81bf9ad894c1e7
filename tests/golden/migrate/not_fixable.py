"""Findings --fix reports but leaves: each needs a person."""

import jax
from flax import jax_utils

OUT_AXES = 0
computed = jax.pmap(lambda x: x, out_axes=OUT_AXES)
mixed = jax.pmap(lambda x: (x, x), out_axes=(0, -1))
options = {"axis_name": "i"}
splat = jax.pmap(lambda x: x, **options)
mapper = jax.pmap  # a reference: how it is called is out of sight
newer = jax_utils.replicate({"w": 1.0}, axis_name="devices")  # a newer Flax keyword
