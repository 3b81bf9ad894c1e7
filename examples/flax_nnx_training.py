"""A flax nnx MLP trained with optax adamw two ways, both checked against one device.

The model is annotated the flax way (`nnx.with_partitioning`): the first layer's kernel and
bias are split by columns over "model", the second layer's kernel by rows. The mesh is
{"data": -1, "model": 2}: the batch is split over "data", and every parameter is whole along
"data" (replicated) and split along "model" as annotated. Both ways start from the same
initial parameters, made on one device and placed with `meshkit.global_array_from_local` and
the specs flax gives (`nnx.get_partition_spec`), and train on the same global batches from
`meshkit.global_batches`:

(a) per-device code through `meshkit.spmd`: each device computes the gradient of its own
    rows' loss, and one `pmean` over "data" averages the gradients; the forward pass is
    written per device (column- then row-parallel, one `psum` over "model"). The in_specs are
    the spec tree flax gives for the whole train state, model and optimizer, as it comes.
(b) a `jax.jit` step over the flax-partitioned train state: `in_shardings` and
    `out_shardings` come from the same spec tree, and XLA inserts the collectives itself.

A single-device run of the same model and data is the reference: the losses of every step
and the final parameters of both ways must match it.

Run it alone (8 CPU devices in one process) or as 2 processes x 4 CPU devices:

    python examples/flax_nnx_training.py
    meshkit launch -n 2 --devices-per-process 4 examples/flax_nnx_training.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 --devices-per-process 4

import meshkit

info = meshkit.init()  # first, before any other JAX call

import jax  # noqa: E402

if info.num_processes == 1 and info.cpu_devices is None:
    # Alone, and MESHKIT_CPU_DEVICES is not set: 8 CPU devices, as in the launched run.
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshkit import collectives as C  # noqa: E402

FEATURES, HIDDEN, OUT = 8, 32, 2
GLOBAL_BATCH, STEPS, LR = 64, 12, 1e-2
TOLERANCE = 1e-5  # float32 sums in another order: differences near 1e-7 are expected

mesh = meshkit.make_mesh({"data": -1, "model": 2})
if info.process_id == 0:
    print(meshkit.describe(mesh))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.l1 = nnx.Linear(
            FEATURES, HIDDEN, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, (None, "model")),  # columns over model
            bias_init=nnx.with_partitioning(zeros, ("model",)),
        )  # fmt: skip
        self.l2 = nnx.Linear(
            HIDDEN, OUT, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("model", None)),  # rows over model
        )  # fmt: skip

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def mse(pred, y):
    return jnp.mean((pred - y) ** 2)


# ---- the data: the same synthetic dataset in every process; each loads its rows of a batch ----

rng = np.random.default_rng(0)
x_all = rng.standard_normal((STEPS * GLOBAL_BATCH, FEATURES), dtype=np.float32)
y_all = np.sin(x_all @ rng.standard_normal((FEATURES, OUT), dtype=np.float32))
part = meshkit.process_slice(mesh, "data", (GLOBAL_BATCH, FEATURES))
rows = part.index[0]  # this process's rows of every global batch (half of them on 2 processes)


def loader():
    for step in range(STEPS):
        start = step * GLOBAL_BATCH
        yield {"x": x_all[start:][rows], "y": y_all[start:][rows]}


# ---- the initial parameters, made once on one device (annotations kept as metadata) ----------

with nnx.use_eager_sharding(False):  # no mesh here: flax would otherwise place the parameters
    model = MLP(nnx.Rngs(0))
graphdef, params = nnx.split(model)
host = jax.tree.map(np.asarray, params)  # numpy copies, an nnx.State of Params
param_specs = nnx.get_partition_spec(params)  # flax's specs: an nnx.State of Params of P(...)


def placed_model():
    """A model whose parameters are global arrays laid out as the annotations say."""
    return nnx.merge(graphdef, meshkit.global_array_from_local(host, mesh, param_specs))


def train_state(model):
    with jax.set_mesh(mesh):  # flax places the optimizer state like the parameters
        optimizer = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    return nnx.split((model, optimizer))


# ---- the reference: one device, whole batches ------------------------------------------------

with nnx.use_eager_sharding(False):
    ref_model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, host))
    ref_opt = nnx.Optimizer(ref_model, optax.adamw(LR), wrt=nnx.Param)


@nnx.jit
def ref_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: mse(m(x), y))(model)
    optimizer.update(model, grads)
    return loss


ref_losses = [
    float(ref_step(ref_model, ref_opt, x_all[s * GLOBAL_BATCH :][:GLOBAL_BATCH],
                   y_all[s * GLOBAL_BATCH :][:GLOBAL_BATCH]))
    for s in range(STEPS)
]  # fmt: skip
ref_params = jax.tree.map(np.asarray, nnx.state(ref_model, nnx.Param))


# ---- (a) per-device code: meshkit.spmd and collectives ---------------------------------------

graph_a, state_a = train_state(placed_model())
specs = nnx.get_partition_spec(state_a)  # model and optimizer, as flax gives them


def block_loss(p, x, y):
    """This device's loss on its rows, from its blocks of the parameters."""
    h = jax.nn.relu(x @ p["l1"]["kernel"][...] + p["l1"]["bias"][...])  # its hidden units
    out = C.psum(h @ p["l2"]["kernel"][...], "model") + p["l2"]["bias"][...]  # row-parallel
    return mse(out, y)


@meshkit.spmd(
    mesh=mesh,
    in_specs=(specs, "batch feat -> data _", "batch out -> data _"),
    out_specs=(specs, P()),
    donate_argnums=0,
)
def step_a(state, x, y):
    model, optimizer = nnx.merge(graph_a, state)
    params = nnx.state(model, nnx.Param)
    # Differentiate a copy typed as varying over "data": the gradient is then this device's
    # own. (Without the copy, JAX's backward pass already sums over "data"; see the docs.)
    mine = jax.tree.map(lambda v: jax.lax.pcast(v, "data", to="varying"), params)
    loss, grads = jax.value_and_grad(block_loss)(mine, x, y)
    grads = C.pmean(grads, "data")  # <- where the gradients are reduced: the all-reduce
    optimizer.update(model, grads)  # adamw on this device's blocks: mu, nu split like params
    return nnx.state((model, optimizer)), C.pmean(loss, "data")


# ---- (b) jax.jit over the flax-partitioned train state ---------------------------------------

graph_b, state_b = train_state(placed_model())
shardings = nnx.get_named_sharding(state_b, mesh)  # the same specs, as NamedShardings
batch_sharding = NamedSharding(mesh, P("data"))


def step_b(state, x, y):
    model, optimizer = nnx.merge(graph_b, state)
    # The loss of the whole global batch: XLA reduces the gradients over "data" itself.
    loss, grads = nnx.value_and_grad(lambda m: mse(m(x), y))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss


step_b = jax.jit(
    step_b,
    in_shardings=(shardings, batch_sharding, batch_sharding),
    out_shardings=(shardings, NamedSharding(mesh, P())),
    donate_argnums=0,
)

# ---- train both on the same global batches ---------------------------------------------------

losses_a, losses_b = [], []
for batch in meshkit.global_batches(loader(), mesh, "data"):
    state_a, loss_a = step_a(state_a, batch["x"], batch["y"])
    state_b, loss_b = step_b(state_b, batch["x"], batch["y"])
    losses_a.append(float(loss_a))  # replicated: every process reads it (and waits for it)
    losses_b.append(float(loss_b))
    if info.process_id == 0:
        step = len(losses_a) - 1
        print(
            f"step {step:2d}: loss single device {ref_losses[step]:.6f}  "
            f"(a) spmd {losses_a[-1]:.6f}  (b) jit {losses_b[-1]:.6f}"
        )
assert losses_a[-1] < losses_a[0], losses_a

# Where the state lives: adamw's moments (mu, nu) are laid out like the parameters they track.
for name, graph, state in (("a", graph_a, state_a), ("b", graph_b, state_b)):
    model, optimizer = nnx.merge(graph, state)
    adam = optimizer.opt_state[0]
    kernel, mu, count = model.l1.kernel[...], adam.mu["l1"]["kernel"][...], adam.count[...]
    if info.process_id == 0:
        print(
            f"({name}) l1.kernel {kernel.sharding.spec} {kernel.addressable_shards[0].data.shape}"
            f", its adamw mu {mu.sharding.spec} {mu.addressable_shards[0].data.shape}, "
            f"count {count.sharding.spec}"
        )

for name, graph, state, losses in (
    ("a", graph_a, state_a, losses_a),
    ("b", graph_b, state_b, losses_b),
):
    params = meshkit.gather(nnx.state(nnx.merge(graph, state)[0], nnx.Param))  # numpy, all
    loss_diff = float(np.max(np.abs(np.array(losses) - np.array(ref_losses))))
    param_diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
    )
    if info.process_id == 0:
        print(
            f"({name}) vs single device: max |loss diff| {loss_diff:.2e}, "
            f"max |param diff| {param_diff:.2e}"
        )
    assert loss_diff < TOLERANCE, (name, loss_diff)
    assert param_diff < TOLERANCE, (name, param_diff)
print(f"process {info.process_id}/{info.num_processes}: OK")
