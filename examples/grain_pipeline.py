"""A grain input pipeline feeding global batches: every row once per epoch, on any process count.

Each process builds the same grain data source (1001 records, in memory here) and a
`grain.DataLoader` whose sampler, `meshkit.loaders.grain_sampler`, reads only this process's
rows of every global batch of 128, in an order shuffled per epoch the same way everywhere.
`meshkit.global_batches` joins the processes' batches into global arrays; the last batch of an
epoch (1001 = 7 x 128 + 105) is padded and masked. A jitted step counts, on the devices, how
often each record was seen; at the end of each epoch the counts must all be 1.

The global batches do not depend on the number of processes: the digest printed per epoch is
the same alone (8 CPU devices in one process) and as 2 processes x 4 CPU devices:

    python examples/grain_pipeline.py
    meshkit launch -n 2 -d 4 examples/grain_pipeline.py
"""

# `nox -s examples` runs this file under `meshkit launch` with these arguments:
# meshkit-launch: -n 2 -d 4

import meshkit

info = meshkit.init()  # first, before any other JAX call

import jax  # noqa: E402

if info.num_processes == 1 and info.cpu_devices is None:
    # Alone, and MESHKIT_CPU_DEVICES is not set: 8 CPU devices, as in the launched run.
    jax.config.update("jax_num_cpu_devices", 8)

import hashlib  # noqa: E402

import grain  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from meshkit import loaders  # noqa: E402

RECORDS, GLOBAL_BATCH, EPOCHS, SEED = 1001, 128, 3, 42

mesh = meshkit.make_mesh({"data": -1})
part = meshkit.process_slice(mesh, "data", (GLOBAL_BATCH,))  # this process's rows of a batch
source = [{"id": np.int32(i), "x": np.full(4, i, np.float32)} for i in range(RECORDS)]


def loader(epoch):
    """This process's batches of one epoch, as a plain grain DataLoader."""
    return grain.DataLoader(
        data_source=source,
        sampler=loaders.grain_sampler(len(source), part, shuffle=True, seed=SEED, epoch=epoch),
        shard_options=grain.sharding.NoSharding(),  # the sampler already shards
        operations=[grain.transforms.Batch(part.local_shape[0], drop_remainder=False)],
    )


@jax.jit
def count(seen, batch, mask):
    """Add 1 for each real row of the batch; padded rows add nothing."""
    return seen.at[batch["id"]].add(mask.astype(jnp.int32))


replicated = NamedSharding(mesh, PartitionSpec())
for epoch in range(EPOCHS):
    seen = jax.device_put(jnp.zeros(RECORDS, jnp.int32), replicated)
    digest = hashlib.sha256()
    steps = 0
    for batch, mask in meshkit.global_batches(loader(epoch), mesh, "data", pad=True):
        seen = count(seen, batch, mask)
        ids = meshkit.gather(batch["id"])[meshkit.gather(mask)]  # the real rows, in order
        digest.update(ids.tobytes())
        steps += 1
    last_rows, last_real = mask.shape[0], int(mask.sum())
    times = np.asarray(meshkit.gather(seen))
    if info.process_id == 0:
        print(
            f"epoch {epoch}: {steps} steps, last batch {last_real} real rows in {last_rows}; "
            f"records seen once: {int((times == 1).sum())} of {RECORDS}, "
            f"twice or more: {int((times > 1).sum())}; batches {digest.hexdigest()[:12]}"
        )
    assert (times == 1).all()

print(f"process {info.process_id}/{info.num_processes}: OK")
