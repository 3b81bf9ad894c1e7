"""Resumable training with orbax: a checkpoint every 4 steps, a run that stops, a restart.

A small two-layer regression model is trained on a 4 x 2 mesh (the batch split over "data",
the hidden units over "model") for 12 steps. orbax's CheckpointManager saves the state every 4
steps; `meshkit.checkpoint.check_savable` checks it first (global arrays only, the same tree in
every process) and `meshkit.checkpoint.targets` lays the restored arrays out on the mesh.
Every step's data is a function of the step number, so a restarted run sees the same batches.

Without arguments the program shows the whole story in one go: an uninterrupted run, a run
that stops after step 6 (as if killed: steps 5 and 6 were never saved), and a restart from its
latest checkpoint (step 4). The restart's losses equal the uninterrupted run's, bit for bit.

With ``--dir DIR`` it is one run that resumes from the latest checkpoint in DIR, if any: kill
it (Ctrl-C, or SIGKILL a rank) and start it again with the same command.
(`examples/preemptible_training.py` tells the same story through `meshkit.checkpoint.save`,
with the data position, a preemption notice and a crash; ``tests/test_resume.py`` kills it.)

    python examples/resumable_training.py
    meshkit launch -n 2 -d 4 examples/resumable_training.py
    meshkit launch -n 2 -d 4 examples/resumable_training.py --dir /tmp/run --pause 0.5
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 4

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import meshkit

info = meshkit.init()  # first, before any other JAX call

import jax  # noqa: E402

if info.num_processes == 1 and info.cpu_devices is None:
    jax.config.update("jax_num_cpu_devices", 8)  # alone: 8 CPU devices, as in the launched run

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

STEPS, EVERY, BATCH, FEATURES, HIDDEN, LR, MOMENTUM = 12, 4, 64, 16, 8, 0.05, 0.9

mesh = meshkit.make_mesh({"data": -1, "model": 2})
SPECS = {"w1": "_ model", "w2": "model"}  # hidden units split over "model"
shardings = {k: NamedSharding(mesh, meshkit.spec(s)) for k, s in SPECS.items()}
replicated = NamedSharding(mesh, meshkit.spec(""))
true_w = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)


def batch(step):
    """The global batch of ``step`` (the same in every run); this process passes its rows."""
    rng = np.random.default_rng([1, step])
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = np.tanh(x @ true_w) + 0.1 * rng.standard_normal(BATCH).astype(np.float32)
    mine = {
        k: meshkit.process_slice(mesh, "data", v.shape).take(v) for k, v in {"x": x, "y": y}.items()
    }
    return meshkit.global_array_from_local(mine, mesh, "data")


def initial_state():
    rng = np.random.default_rng(2)
    params = {
        "w1": rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32) / 4,
        "w2": rng.standard_normal(HIDDEN).astype(np.float32) / 4,
    }
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    place = meshkit.global_array_from_local
    return {"params": place(params, mesh, SPECS), "velocity": place(zeros, mesh, SPECS)}


def loss_fn(params, data):
    prediction = jnp.tanh(data["x"] @ params["w1"]) @ params["w2"]
    return jnp.mean((prediction - data["y"]) ** 2)


# The state keeps its layout from step to step (and a restored state has the same one), so a
# resumed run compiles and computes exactly what the uninterrupted run did.
@jax.jit
def train_step(state, data):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], data)
    velocity = jax.tree.map(lambda v, g: MOMENTUM * v + g, state["velocity"], grads)
    params = jax.tree.map(lambda p, v: p - LR * v, state["params"], velocity)
    new = {"params": params, "velocity": velocity}
    new = jax.lax.with_sharding_constraint(new, {"params": shardings, "velocity": shardings})
    return new, jax.lax.with_sharding_constraint(loss, replicated)


def say(text):
    if info.process_id == 0:
        print(text, flush=True)


# --8<-- [start:train]
def train(directory, label, *, stop_after=None, pause=0.0):
    """Train to STEPS from the latest checkpoint in ``directory``; the losses of the steps run."""
    options = ocp.CheckpointManagerOptions(max_to_keep=2, cleanup_tmp_directories=True)
    losses = {}
    handler = ocp.StandardCheckpointHandler()  # what each step holds: one pytree
    with ocp.CheckpointManager(
        Path(directory).absolute(), options=options, item_handlers=handler
    ) as manager:
        start = manager.latest_step()  # complete checkpoints only: never a save cut short
        if start is None:
            start, state = 0, initial_state()
        else:
            # The saved tree's shapes and specs, laid out on this mesh (any mesh shape would do).
            target = meshkit.checkpoint.targets(manager.item_metadata(start), mesh)
            saved = manager.restore(start, args=ocp.args.StandardRestore(target))
            state = {"params": saved["params"], "velocity": saved["velocity"]}
            say(f"{label}: resumed from the checkpoint of step {saved['step']}")
        for step in range(start + 1, STEPS + 1):
            state, loss = train_step(state, batch(step))
            losses[step] = float(loss)  # replicated: every process reads it (and waits for it)
            say(f"{label}: step {step} loss {losses[step]!r}")
            if step % EVERY == 0:
                tree = {**state, "step": step}
                meshkit.checkpoint.check_savable(tree)  # every process, before orbax
                manager.save(step, args=ocp.args.StandardSave(tree))  # written in the background
            if step == stop_after:
                say(f"{label}: stopped after step {step}, as if killed (later steps are lost)")
                break
            time.sleep(pause)
    return losses


# --8<-- [end:train]


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--dir", help="one resumable run with its checkpoints in DIR")
parser.add_argument("--pause", type=float, default=0.0, help="seconds to wait after each step")
args = parser.parse_args()

if args.dir:
    train(args.dir, "run", pause=args.pause)
else:
    # Every process must see the same directory: on one machine, one named after this run's
    # coordinator port (or this process alone); on a cluster, a shared filesystem (--dir).
    port = info.coordinator_address.rsplit(":", 1)[1] if info.coordinator_address else None
    run = f"port{port}" if port else f"pid{os.getpid()}"
    root = Path(tempfile.gettempdir()) / f"meshkit-resumable-{run}"
    if info.process_id == 0:
        shutil.rmtree(root, ignore_errors=True)  # nothing left from an earlier run of that name
    meshkit.barrier("resumable_training: a fresh directory")
    reference = train(root / "uninterrupted", "uninterrupted")
    first = train(root / "interrupted", "first run", stop_after=6)
    restarted = train(root / "interrupted", "restarted")
    assert min(restarted) == EVERY + 1, restarted  # it resumed from the checkpoint of step 4
    same = all(losses[s] == reference[s] for losses in (first, restarted) for s in losses)
    say(f"the first run and the restart give the uninterrupted run's losses: {same}")
    assert same, (reference, first, restarted)
    assert reference[STEPS] < reference[1] / 2, reference  # it learns
    meshkit.barrier("resumable_training: done")
    if info.process_id == 0:
        shutil.rmtree(root)
print(f"process {info.process_id}/{info.num_processes}: OK")
