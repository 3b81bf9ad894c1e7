"""An unmodified pmap-era training and evaluation loop, run with jax.pmap and with pmap_compat.

`legacy_program` is written as pmap code was: state replicated with a leading device axis,
each process's batch reshaped to (local devices, per-device batch, ...), metrics read back with
`jax.device_get`, predictions read with `np.asarray`, the first replica taken with
`jax.tree_util.tree_map(lambda x: x[0], state)` for a "checkpoint", and a mean taken on the
host. The only thing passed in is the pmap. This file runs it with `jax.pmap`, then with
`meshkit.pmap_compat`, prints what each printed, and checks the two are the same text, in
one process and in each process of a multi-process run.

    python examples/pmap_unmodified_loop.py
    meshkit launch -n 2 -d 4 examples/pmap_unmodified_loop.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 4

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import meshkit

FEATURES, CLASSES, PER_DEVICE_BATCH, STEPS, LR = 8, 3, 4, 12, 0.5


# --8<-- [start:legacy]
def legacy_program(pmap: Callable[..., Any]) -> list[str]:
    """Train and evaluate a linear classifier, pmap style; return the lines it prints."""
    n = jax.local_device_count()
    rng = np.random.default_rng(0)  # the same initial parameters in every process
    params = {"w": np.zeros((FEATURES, CLASSES), np.float32), "b": np.zeros(CLASSES, np.float32)}
    centres = rng.standard_normal((CLASSES, FEATURES)).astype(np.float32)
    data = np.random.default_rng(1 + jax.process_index())  # each process reads its own rows

    def batch():
        y = data.integers(0, CLASSES, n * PER_DEVICE_BATCH).astype(np.int32)
        x = centres[y] + 0.5 * data.standard_normal((len(y), FEATURES)).astype(np.float32)
        return {"x": x.reshape(n, PER_DEVICE_BATCH, FEATURES), "y": y.reshape(n, -1)}

    def loss_fn(p, b):
        logits = b["x"] @ p["w"] + p["b"]
        picked = jnp.take_along_axis(logits, b["y"][:, None], axis=1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked)

    def train_step(state, b):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], b)
        grads = jax.lax.pmean(grads, "batch")
        new = jax.tree_util.tree_map(lambda p, g: p - LR * g, state["params"], grads)
        metrics = {"loss": jax.lax.pmean(loss, "batch"), "local_loss": loss}
        return {"params": new, "step": state["step"] + 1}, metrics

    def predict(p, b):
        return jnp.argmax(b["x"] @ p["w"] + p["b"], axis=-1)

    p_train = pmap(train_step, axis_name="batch", donate_argnums=(0,))
    p_predict = pmap(predict, axis_name="batch")
    replicate = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda x: np.broadcast_to(x, (n, *np.shape(x))), tree
    )
    state = replicate({"params": params, "step": np.int32(0)})
    lines = []
    for step in range(STEPS):
        state, metrics = p_train(state, batch())
        if step % 4 == 3:
            m = jax.device_get(metrics)
            lines.append(
                f"step {step + 1}: loss {m['loss'][0]:.6f}, on this process's devices "
                + " ".join(f"{v:.4f}" for v in m["local_loss"])
            )
    correct = seen = 0
    for _ in range(3):
        b = batch()
        predictions = np.asarray(p_predict(state["params"], b))
        correct += int((predictions == b["y"]).sum())
        seen += predictions.size
    host = jax.tree_util.tree_map(lambda x: x[0], state)  # the first replica, for a checkpoint
    lines.append(f"eval: {correct}/{seen} correct on this process's rows")
    lines.append(
        f"checkpoint: step {int(host['step'])}, |w| {np.linalg.norm(host['params']['w']):.6f}"
    )
    lines.append(f"mean |weight| over replicas {float(abs(state['params']['w']).mean()):.6f}")
    return lines


# --8<-- [end:legacy]


def compare() -> list[str]:
    """Run the program with jax.pmap and with pmap_compat; the printed lines must be equal."""
    before = legacy_program(jax.pmap)
    after = legacy_program(meshkit.pmap_compat)
    if before != after:
        raise AssertionError(f"jax.pmap printed\n{before}\npmap_compat printed\n{after}")
    return after


if __name__ == "__main__":
    info = meshkit.init()  # before any JAX computation
    if info.num_processes == 1 and info.cpu_devices is None:
        jax.config.update("jax_num_cpu_devices", 8)  # alone: 8 CPU devices, as when launched
    me, count = jax.process_index(), jax.process_count()
    for line in compare():
        print(f"process {me}/{count}: {line}")
    print(f"process {me}/{count}: jax.pmap and meshkit.pmap_compat printed the same lines")
