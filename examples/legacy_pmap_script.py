"""A pmap-era training script, as it was written: the input of `meshkit migrate --fix`.

Everything below `meshkit.init()` is legacy code: `jax.pmap` (a call and a decorator), state
replicated by hand along a leading device axis, and host reads of pmap outputs
(`jax.device_get`, `np.asarray`, `x[0]`, `tree_map(lambda x: x[0], ...)`, `float(...)`).
`meshkit migrate --fix` rewrites it to `meshkit.pmap_compat`, `meshkit.unreplicate` and
`meshkit.local_from_global`, and the rewritten script prints the same lines, in one process
and in each process of a multi-process run (`tests/test_migrate_examples.py` checks both).

    python examples/legacy_pmap_script.py
    meshkit launch -n 2 -d 4 examples/legacy_pmap_script.py
    meshkit migrate --diff examples/legacy_pmap_script.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 4

import functools

import jax
import jax.numpy as jnp
import numpy as np

import meshkit

FEATURES, CLASSES, PER_DEVICE_BATCH, STEPS, LR = 8, 3, 4, 12, 0.5


def loss_fn(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    picked = jnp.take_along_axis(logits, batch["y"][:, None], axis=1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked)


def train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    grads = jax.lax.pmean(grads, "batch")
    params = jax.tree_util.tree_map(lambda p, g: p - LR * g, state["params"], grads)
    metrics = {"loss": jax.lax.pmean(loss, "batch"), "local_loss": loss}
    return {"params": params, "step": state["step"] + 1}, metrics


@functools.partial(jax.pmap, axis_name="batch")
def predict(params, batch):
    return jnp.argmax(batch["x"] @ params["w"] + params["b"], axis=-1)


def main():
    n = jax.local_device_count()
    centres = np.random.default_rng(0).standard_normal((CLASSES, FEATURES)).astype(np.float32)
    data = np.random.default_rng(1 + jax.process_index())  # each process reads its own rows

    def next_batch():
        y = data.integers(0, CLASSES, n * PER_DEVICE_BATCH).astype(np.int32)
        x = centres[y] + 0.5 * data.standard_normal((len(y), FEATURES)).astype(np.float32)
        return {"x": x.reshape(n, PER_DEVICE_BATCH, FEATURES), "y": y.reshape(n, -1)}

    params = {"w": np.zeros((FEATURES, CLASSES), np.float32), "b": np.zeros(CLASSES, np.float32)}
    state = jax.tree_util.tree_map(
        lambda x: np.broadcast_to(x, (n, *np.shape(x))), {"params": params, "step": np.int32(0)}
    )
    p_train_step = jax.pmap(train_step, axis_name="batch", donate_argnums=(0,))
    for step in range(STEPS):
        state, metrics = p_train_step(state, next_batch())
        if step % 4 == 3:
            local = jax.device_get(metrics)["local_loss"]
            print(f"step {step + 1}: loss {float(metrics['loss'][0]):.6f}, this process's "
                  + " ".join(f"{v:.4f}" for v in local))  # fmt: skip
    correct = seen = 0
    for _ in range(3):
        batch = next_batch()
        predictions = np.asarray(predict(state["params"], batch))
        correct += int((predictions == batch["y"]).sum())
        seen += predictions.size
    host = jax.tree_util.tree_map(lambda x: x[0], state)  # the first replica, to checkpoint
    print(f"eval: {correct}/{seen} correct on this process's rows")
    print(f"checkpoint: step {int(host['step'])}, |w| {np.linalg.norm(host['params']['w']):.6f}")
    print(f"mean |w| over replicas {float(abs(state['params']['w']).mean()):.6f}")


if __name__ == "__main__":
    info = meshkit.init()  # joins the processes of a `meshkit launch` run; nothing else changes
    if info.num_processes == 1 and info.cpu_devices is None:
        jax.config.update("jax_num_cpu_devices", 8)  # alone: 8 CPU devices, as when launched
    main()
