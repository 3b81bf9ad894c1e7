"""A small training loop that resumes from its latest checkpoint, for restart tests.

12 steps of linear regression on a ``{"data": -1}`` mesh, a checkpoint every 2 steps
(``<root>/step_<n>``); each step's batch is a function of the step, so a resumed run sees the
batches an uninterrupted one would. Process 0 prints ``ATTEMPT a``, ``LOSS step value`` per step
and, at the end, ``FINAL loss digest`` (the parameters' bytes).

    python training.py ROOT [--kill-at S] [--fail-at S] [--every-attempt] [--victim P]
                            [--pause-at S DIR]

``--kill-at S``: process ``--victim`` (default 1) SIGKILLs itself after step S (a crash);
``--fail-at S``: it raises there (a bug). On the first attempt only, unless ``--every-attempt``.
``--pause-at S DIR``: on the first attempt, every process writes ``DIR/ready<p>`` after step S
and waits there (for a test to kill a whole host).
"""

import argparse
import hashlib
import os
import signal
import time

import meshkit

info = meshkit.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("root")
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--fail-at", type=int, default=None)
parser.add_argument("--every-attempt", action="store_true")
parser.add_argument("--victim", type=int, default=1)
parser.add_argument("--pause-at", nargs=2, default=None)
args = parser.parse_args()

STEPS, EVERY, BATCH, FEATURES = 12, 2, 16, 8
me = jax.process_index()
mesh = meshkit.make_mesh({"data": -1})
replicated = NamedSharding(mesh, P())
true_w = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)


def batch(step):
    rng = np.random.default_rng([1, step])
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = (x @ true_w + 0.1 * rng.standard_normal(BATCH)).astype(np.float32)
    rows = meshkit.process_slice(mesh, "data", (BATCH,)).ranges[0][0]  # this process's rows
    return (
        meshkit.global_array_from_local(x[slice(*rows)], mesh, "data"),
        meshkit.global_array_from_local(y[slice(*rows)], mesh, "data"),
    )


@jax.jit
def train_step(w, x, y):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return jax.lax.with_sharding_constraint(w - 0.1 * grad, replicated), loss


found = meshkit.checkpoint.latest(args.root)
if found is not None:
    w, start = meshkit.checkpoint.restore(found.path, mesh)["w"], found.step + 1
else:
    w, start = jax.jit(lambda: jnp.zeros(FEATURES, jnp.float32), out_shardings=replicated)(), 1
if me == 0:
    print(f"ATTEMPT {info.attempt} from step {start}", flush=True)
loss = None
for step in range(start, STEPS + 1):
    w, loss = train_step(w, *batch(step))
    if me == 0:
        print(f"LOSS {step} {float(loss)!r}", flush=True)
    if step % EVERY == 0:
        meshkit.checkpoint.save(meshkit.checkpoint.step_path(args.root, step), {"w": w})
    now = args.every_attempt or info.attempt == 0
    if me == args.victim and now and step == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if me == args.victim and now and step == args.fail_at:
        raise RuntimeError(f"process {me} fails at step {step} on purpose")
    if args.pause_at and info.attempt == 0 and step == int(args.pause_at[0]):
        open(os.path.join(args.pause_at[1], f"ready{me}"), "w").close()
        time.sleep(600)
if me == 0:
    digest = hashlib.sha256(np.asarray(w.addressable_data(0)).tobytes()).hexdigest()[:16]
    print(f"FINAL {float(loss)!r} {digest}", flush=True)
