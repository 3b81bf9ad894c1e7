"""Training that a scheduler may preempt at any step, and that resumes exactly.

A flax nnx MLP trained with optax's adam on a grain dataset, read through
`meshkit.loaders.grain_batches` and `meshkit.global_batches`. Three additions make it
preemptible, and nothing else in the loop changes:

1. it resumes from `meshkit.checkpoint.latest`: the train state comes back into its own
   structure (``like=``), and the data at the global batch the saved run would have taken next
   (`meshkit.checkpoint.data_position`, ``start=``);
2. `meshkit.checkpoint.should_save(step, every=EVERY)` says when to save: every ``EVERY`` steps,
   and once after a preemption notice (SIGTERM), at a step that is the same on every process;
3. the save holds the data position (``data=batches``); the save after a notice ends the
   program with status 143, for the scheduler to start it again.

Run alone, the file is a demonstration (what ``nox -s examples`` runs): it launches the training
as 2 processes x 4 CPU devices three times, an uninterrupted run, a run that process 1's
"scheduler" preempts after step 6 (it sends itself SIGTERM), and that run started again, and
checks that the resumed run ends with the uninterrupted run's loss and parameters, bit for bit.

    python examples/preemptible_training.py
    meshkit launch -n 2 -d 4 examples/preemptible_training.py train /tmp/run   # one run
    meshkit launch -n 2 -d 4 --max-restarts 1 examples/preemptible_training.py train /tmp/r2 \
        --crash-at 6                                   # a crash, and the restart it needs

Preempt a run by hand with ``kill -TERM`` to ``meshkit launch`` (it forwards the notice to
every process), then start the same command again: it goes on from the step it saved.
"""

import argparse
import hashlib
import os
import signal
import sys
import tempfile
import time

ROWS, FEATURES, HIDDEN, GLOBAL_BATCH, EPOCHS, EVERY = 384, 8, 32, 16, 1, 4
STEPS = ROWS // GLOBAL_BATCH * EPOCHS  # 24 global batches


def train(root: str, notice_at: int | None, crash_at: int | None, step_time: float) -> None:
    """One run of the training, resuming from the latest checkpoint under ``root``."""
    import meshkit

    info = meshkit.init()  # first, before any other JAX call

    import grain
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = meshkit.make_mesh({"data": -1})
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    # The data: the same dataset on every process; each reads its rows of each global batch.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    y = np.sin(x @ rng.standard_normal((FEATURES, 1))).astype(np.float32)
    dataset = grain.MapDataset.source(list(range(ROWS))).map(lambda i: {"x": x[i], "y": y[i]})
    part = meshkit.process_slice(mesh, "data", (GLOBAL_BATCH,))
    loader = meshkit.loaders.grain_batches(dataset, part, seed=0, epochs=EPOCHS)

    # The train state: an nnx model and its optimizer, made the same way on every process.
    with nnx.use_eager_sharding(False):
        model = nnx.Sequential(
            nnx.Linear(FEATURES, HIDDEN, rngs=nnx.Rngs(0)),
            nnx.relu,
            nnx.Linear(HIDDEN, 1, rngs=nnx.Rngs(1)),
        )
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = meshkit.global_array_from_local(jax.tree.map(np.asarray, state), mesh, P())

    @jax.jit
    def train_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(
            model
        )
        optimizer.update(model, grads)
        return jax.lax.with_sharding_constraint(nnx.state((model, optimizer)), replicated), loss

    found = meshkit.checkpoint.latest(root)
    position = None
    if found is not None:
        state = meshkit.checkpoint.restore(found.path, mesh, like=state)
        position = meshkit.checkpoint.data_position(found.path)
    me = info.process_id
    if me == 0:
        print(f"START at step {0 if position is None else position.step}", flush=True)
    loss = None
    with meshkit.global_batches(loader, mesh, "data", start=position) as batches:
        for batch in batches:
            step = batches.steps  # counts on from the saved position
            state, loss = train_step(state, jax.device_put(batch, rows))
            if me == 0:
                print(f"LOSS {step} {float(loss)!r}", flush=True)
            if step == notice_at and me == 1 and found is None:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, to one process
            if step == crash_at and me == 1 and found is None:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing saved at this step
            time.sleep(step_time)  # a longer step, for whoever watches
            if meshkit.checkpoint.should_save(step, every=EVERY):
                path = meshkit.checkpoint.step_path(root, step)
                meshkit.checkpoint.save(path, state, keep=2, data=batches)
    if me == 0 and loss is not None:
        params = jax.tree.leaves(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param))
        data = b"".join(np.asarray(p.addressable_data(0)).tobytes() for p in params)
        print(f"FINAL {float(loss)!r} {hashlib.sha256(data).hexdigest()[:16]}", flush=True)
        np.savez(os.path.join(root, "final.npz"), *[np.asarray(p.addressable_data(0))
                                                    for p in params])  # fmt: skip


def demo() -> int:
    """The uninterrupted run, a preempted run and its resumption, compared."""
    import meshkit

    def launch(root: str, *args: str) -> meshkit.LaunchResult:
        return meshkit.launch(
            [__file__, "train", root, *args], num_processes=2, devices_per_process=4,
            platform="cpu", timeout=300, stream=False,
        )  # fmt: skip

    def said(result: meshkit.LaunchResult, word: str) -> str:
        # Process 0's line from `word` on (Gloo's own messages may share its line of stdout).
        lines = result.ranks[0].stdout.splitlines()
        return next(x[x.index(word) :] for x in lines if word in x)

    def final(result: meshkit.LaunchResult) -> str:
        return said(result, "FINAL ")

    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as cut:
        reference = launch(whole)
        print("uninterrupted: ", final(reference))
        preempted = launch(cut, "--notice-at", "6")
        print(f"preempted:      status {preempted.returncode}")
        print("  " + preempted.report.strip().replace("\n", "\n  "))
        resumed = launch(cut)
        start = said(resumed, "START at step")
        print(f"resumed:        {final(resumed)} ({start.lower()})")
    same = preempted.preempted and final(resumed) == final(reference)
    print("the resumed run ends as the uninterrupted one:", same)
    return 0 if same else 1


if __name__ == "__main__":
    if len(sys.argv) == 1:
        sys.exit(demo())
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train"])
    parser.add_argument(
        "root", help="the checkpoints' directory, on a filesystem all processes see"
    )
    parser.add_argument(
        "--notice-at",
        type=int,
        default=None,
        help="process 1 sends itself SIGTERM after this step (first run only)",
    )
    parser.add_argument(
        "--crash-at",
        type=int,
        default=None,
        help="process 1 kills itself (SIGKILL) after this step (first run only)",
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds added to a step")
    args = parser.parse_args()
    train(args.root, args.notice_at, args.crash_at, args.step_time)
