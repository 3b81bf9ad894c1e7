"""Per-call cost of make_mesh in 2 processes: meshkit (with its agreement check) vs JAX."""

import json
import sys

import meshkit

meshkit.init()

import jax  # noqa: E402

sys.path.insert(0, sys.argv[1])
from _timing import median_seconds  # noqa: E402

axes = {"data": -1, "model": jax.local_device_count()}
shape = (jax.device_count() // jax.local_device_count(), jax.local_device_count())
# Both processes run the same calls in the same order, as make_mesh's check requires.
base = median_seconds(lambda: jax.make_mesh(shape, ("data", "model")), number=10)
ours = median_seconds(lambda: meshkit.make_mesh(axes), number=10)
if jax.process_index() == 0:
    print("BENCH " + json.dumps({"jax": base, "meshkit": ours}))
