"""Raw `jax.jit` code whose processes pad their batches differently: stopped before it runs.

Each process loads sentences of different lengths and pads its batch. Padded to each process's
own longest sentence, the processes build global arrays of different shapes and compile
different programs for one step: without meshkit, every step runs and computes a wrong number.
After `meshkit.init`, the programs are compared when JAX compiles them, so the first call
raises `meshkit.DivergenceError` on every process, naming the function and the argument. Padded
to the longest sentence of all processes (one small exchange), the step runs.

    meshkit launch -n 2 --devices-per-process 4 examples/padded_sequences.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 --devices-per-process 4

import meshkit

info = meshkit.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("data",))
sharding = NamedSharding(mesh, P("data"))
rng = np.random.default_rng(info.process_id)
# This process's 4 sentences: token ids, of lengths that differ between processes.
sentences = [rng.integers(1, 100, size=n) for n in (5, 9, 12 + 4 * info.process_id, 3)]


def padded(length: int) -> jax.Array:
    """This process's sentences padded with 0 to ``length``, as its rows of a global batch."""
    rows = np.zeros((len(sentences), length), np.int32)
    for i, s in enumerate(sentences):
        rows[i, : len(s)] = s
    return jax.make_array_from_process_local_data(sharding, rows)


@jax.jit
def mean_tokens(batch: jax.Array) -> jax.Array:
    """The mean number of real (non-padding) tokens per sentence of the global batch."""
    return jnp.mean(jnp.sum(batch > 0, axis=1))


own = max(len(s) for s in sentences)  # this process's longest sentence: differs
try:
    mean_tokens(padded(own))
except meshkit.DivergenceError as e:
    print(f"process {info.process_id}: padded to {own}: {str(e).splitlines()[3]}")

# Pad to the longest sentence of all processes instead: one program everywhere.
longest = int(np.max(multihost_utils.process_allgather(np.int32(own))))
mean = float(mean_tokens(padded(longest)))
print(f"process {info.process_id}: padded to {longest}: {mean:.2f} tokens per sentence")
