"""Whole-group restarts: a process crashes at step 7, `meshkit launch --max-restarts` starts
every process again, and the run resumes from its latest checkpoint (step 6).

The program is an ordinary training loop with two additions: it resumes from
`meshkit.checkpoint.latest` (two lines), and it saves a checkpoint every 2 steps with
`meshkit.checkpoint.step_path`. To show a restart, process 1 kills itself after step 7 of the
first attempt (`meshkit.runtime_info().attempt == 0`); the launcher stops the others, starts
the whole group again, and the second attempt restores step 6 and finishes. The launcher's
report lists both attempts: the start, the restore, the stop.

    meshkit launch -n 2 -d 2 --max-restarts 2 examples/restart_on_failure.py
    meshkit launch -n 2 -d 2 --max-restarts 2 examples/restart_on_failure.py --dir /tmp/run

With ``--compilation-cache DIR`` the second attempt reads its programs from JAX's persistent
compilation cache instead of compiling them; the report shows each attempt's compile time.
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 2 --max-restarts 2

import argparse
import os
import shutil
import signal
import tempfile

import meshkit

info = meshkit.init()  # first, before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--dir", default=None, help="checkpoints (default: a new directory)")
args = parser.parse_args()
# Every process and every attempt must use the same directory: by default, one named after the
# launcher (the parent of every process, in every attempt), removed at the end.
root = args.dir or os.path.join(tempfile.gettempdir(), f"meshkit-restart-example-{os.getppid()}")

STEPS, EVERY, BATCH, FEATURES = 12, 2, 16, 8
mesh = meshkit.make_mesh({"data": -1})
replicated = NamedSharding(mesh, P())
true_w = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)


def batch(step):
    """Step ``step``'s global batch (the same in every attempt): this process's rows."""
    rng = np.random.default_rng([1, step])
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = (x @ true_w + 0.1 * rng.standard_normal(BATCH)).astype(np.float32)
    lo, hi = meshkit.process_slice(mesh, "data", (BATCH,)).ranges[0][0]
    return (
        meshkit.global_array_from_local(x[lo:hi], mesh, "data"),
        meshkit.global_array_from_local(y[lo:hi], mesh, "data"),
    )


@jax.jit
def train_step(w, x, y):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return jax.lax.with_sharding_constraint(w - 0.1 * grad, replicated), loss


# --8<-- [start:resume]
found = meshkit.checkpoint.latest(root)
w, start = (meshkit.checkpoint.restore(found.path, mesh)["w"], found.step + 1) if found else (
    jax.jit(lambda: jnp.zeros(FEATURES, jnp.float32), out_shardings=replicated)(), 1)  # fmt: skip
# --8<-- [end:resume]
if jax.process_index() == 0:
    print(f"attempt {info.attempt}: starting at step {start} (checkpoints in {root})")
for step in range(start, STEPS + 1):
    w, loss = train_step(w, *batch(step))
    if step % EVERY == 0:
        meshkit.checkpoint.save(meshkit.checkpoint.step_path(root, step), {"w": w})
    if jax.process_index() == 0:
        print(f"step {step}: loss {float(loss):.5f}")
    if info.attempt == 0 and step == 7 and jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: the launcher restarts every process
if jax.process_index() == 0:
    print(f"done after {info.attempt} restart(s): final loss {float(loss):.5f}")
if args.dir is None:
    meshkit.barrier("checkpoints read")  # nobody reads them any more
    if jax.process_index() == 0:
        shutil.rmtree(root)
