"""wmt's evaluation style: one tohost helper for pmap outputs and numpy batches alike."""

import meshkit
import numpy as np


def tohost(x):
    """Every device's rows on the host, the device axis folded into the batch."""
    n_device, n_batch, *remaining = x.shape
    return meshkit.local_from_global(x).reshape((n_device * n_batch, *remaining))  # MK010, rewritten: numpy too


p_pred_step = meshkit.pmap_compat(lambda inputs, scale: inputs * scale, axis_name="batch", in_axes=(0, None))


def predict(scale, batches):
    rows = []
    for batch in batches:
        batch = meshkit.shard(batch)  # a numpy batch stays numpy
        predicted = p_pred_step(batch["inputs"], scale)
        rows.append((tohost(predicted), tohost(batch["inputs"])))
    return rows


def scores(scale, batch):
    out = p_pred_step(batch, scale)
    return meshkit.local_from_global(out), meshkit.local_from_global(out)  # MK010 x2, rewritten


def first_or_zeros(scale, batch, warm):
    out = p_pred_step(batch, scale) if warm else np.zeros(batch.shape, np.float32)
    return meshkit.local_from_global(out)  # MK010, rewritten: numpy too
