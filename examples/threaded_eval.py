"""Two threads assembling global arrays at once: training batches, and evaluation batches.

The main thread trains on `meshkit.global_batches`; a second thread prepares the evaluation
set's global arrays ahead of time. Processes agree call by call, in order, and two threads
interleave differently in each process, so the second thread names a *channel*,
`meshkit.channel("eval")`, the same in every process: its calls pair up with the other
processes' calls on that channel, whatever the threads' own names or timing. Debug mode is on,
so every call is also compared across processes; a thread without a channel would be told how
to name one.

    meshkit launch -n 2 --devices-per-process 4 examples/threaded_eval.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 --devices-per-process 4

import queue
import threading

import meshkit

info = meshkit.init()
meshkit.debug.enable(timeout=60)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

if info.num_processes == 1 and info.cpu_devices is None:
    jax.config.update("jax_num_cpu_devices", 8)

mesh = meshkit.make_mesh({"data": -1})
part = meshkit.process_slice(mesh, "data", (64, 4))  # this process's rows of each batch
rows = part.local_shape[0]
me = jax.process_index()


def train_loader(steps=20):
    for step in range(steps):
        yield np.full((rows, 4), step + me, np.float32)


def prepare_eval(out: queue.Queue, parts=6):
    """Assemble the evaluation batches on the "eval" channel, while the main thread trains."""
    with meshkit.channel("eval"):
        for k in range(parts):
            local = np.full((rows, 4), 10 * k + me, np.float32)
            out.put(meshkit.global_array_from_local(local, mesh, "data"))
    out.put(None)


@jax.jit
def step_fn(total, batch):
    return total + batch.mean()  # a mean over every process's rows: a collective


evaluated: queue.Queue = queue.Queue()
helper = threading.Thread(target=prepare_eval, args=(evaluated,), name=f"eval-loader-{me}")
helper.start()

total = jnp.zeros(())
for batch in meshkit.global_batches(train_loader(), mesh, "data"):
    total = step_fn(total, batch)
helper.join()

eval_means = []
while (batch := evaluated.get()) is not None:
    eval_means.append(float(batch.mean()))

print(f"process {me}: train total {float(total):.1f}, eval means {eval_means}")
