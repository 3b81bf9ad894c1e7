"""What the launched processes of `tests/test_error_messages.py` run: a first training loop.

Linear regression with optax's adam on `meshkit.global_batches`, as
`examples/first_training_loop.py` writes it, with one classic mistake each. Nothing is caught:
the launcher's report and each rank's output are what a new user reads.
"""

from __future__ import annotations

import numpy as np

FEATURES, GLOBAL_BATCH, STEPS = 8, 64, 4


def _loop(batch_of, *, pad, each_step=None):
    """Train for `STEPS` steps on this process's batches (``batch_of(x, y)`` may change them)."""
    import jax
    import jax.numpy as jnp
    import optax

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    rows = meshkit.process_slice(mesh, "data", (GLOBAL_BATCH,)).local_shape[0]
    rng = np.random.default_rng(jax.process_index())

    def loader():
        for _ in range(STEPS):
            x = rng.standard_normal((rows, FEATURES), dtype=np.float32)
            yield batch_of(x, x.sum(axis=1))

    optimizer = optax.adam(0.05)

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = meshkit.global_array_from_local(
        {"w": np.zeros(FEATURES, np.float32), "b": np.zeros((), np.float32)}, mesh, ""
    )
    opt_state = jax.jit(optimizer.init)(params)
    for item in meshkit.global_batches(loader(), mesh, "data", pad=pad):
        batch, mask = item if pad else (item, None)
        params, opt_state, loss = train_step(params, opt_state, batch)  # every process
        if each_step is not None:
            each_step(mask)
        float(loss)
    return "done"


def only_process_0_sums_the_mask():
    """Process 0 alone sums the mask of every global batch: a computation process 1 never runs."""
    import jax

    def each_step(mask):
        if jax.process_index() == 0:
            int(mask.sum())  # process 0 only

    return _loop(lambda x, y: {"x": x, "y": y}, pad=True, each_step=each_step)


def process_1_pads_to_40_rows():
    """Process 1's loader pads its batches of 32 rows to 40 (a batch size of its own)."""
    import jax

    def batch_of(x, y):
        if jax.process_index() == 1:
            x = np.concatenate([x, np.zeros((8, FEATURES), np.float32)])
            y = np.concatenate([y, np.zeros(8, np.float32)])
        return {"x": x, "y": y}

    return _loop(batch_of, pad=False)
