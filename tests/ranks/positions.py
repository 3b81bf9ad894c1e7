"""What the processes of `tests/test_data_position_multiprocess.py` run: each function is a body.

The launched processes import this module, not the test module: they need meshkit, JAX, numpy
and the loaders (grain, datasets, orbax), not pytest. The test process runs the same bodies
itself, as one process with 8 CPU devices.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

import meshkit
from meshkit import loaders
from meshkit._src.core.data_position import encode_state

GLOBAL_BATCH = 16
SAVE_AT = 2  # the step after which the run saves a checkpoint with its data position
CKPT = "MESHKIT_TEST_CKPT"  # the checkpoints' root, for bodies started with run_in_processes


def _mesh():
    return meshkit.make_mesh({"data": -1})


def _part():
    return meshkit.process_slice(_mesh(), "data", (GLOBAL_BATCH,))


def _grain(seed=7):
    import grain

    # Each element names the row and the index read (epoch * 45 + row): both must match.
    ds = grain.MapDataset.range(45).map_with_index(
        lambda i, row: {"id": np.int32(row), "x": np.array([i, -i], np.float32)}
    )
    return loaders.grain_batches(ds, _part(), seed=seed, epochs=2)


def _datasets():
    import datasets

    table = datasets.Dataset.from_dict(
        {"id": np.arange(33, dtype=np.int32), "x": np.zeros((33, 2), np.float32)}
    )
    return loaders.hf_batches(table, _part(), seed=5)  # its last global batch: 1 row


def _dataloader():
    """grain's DataLoader with meshkit's sampler: each process keeps its own state."""
    import grain

    source = [{"id": np.int32(i), "x": np.zeros(2, np.float32)} for i in range(96)]
    part = _part()
    return grain.DataLoader(
        data_source=source,
        sampler=loaders.grain_sampler(len(source), part, shuffle=True, seed=3),
        shard_options=grain.sharding.NoSharding(),
        operations=[grain.transforms.Batch(part.local_shape[0])],
    )


# name -> (the loader, global_batches' pad)
LOADERS = {
    "grain": (_grain, "ragged"),  # 2 epochs, each with a short last batch
    "datasets": (_datasets, True),
    "dataloader": (_dataloader, False),
}


def _ids(batch, mask):
    """The global batch's real rows: every process gathers the same."""
    if mask is None:
        return meshkit.gather(batch["id"]).tolist()
    full = meshkit.gather({"id": batch["id"], "x": batch["x"], "mask": mask})
    return full["id"][full["mask"]].tolist()


def _steps(batches, pad):
    for item in batches:
        batch, mask = item if pad else (item, None)
        yield _ids(batch, mask)


def _read_ahead(batches, at_least, within=30.0):
    """The steps the helper thread has read past the caller's: waits until ``at_least``.

    The trap this guards: a loader's own state at that moment is ahead of the caller's step.
    """
    deadline = time.monotonic() + within
    while batches._prefetch.assembled < batches.steps + at_least and time.monotonic() < deadline:
        time.sleep(0.005)
    return batches._prefetch.assembled - batches.steps


def save_mid_run(root):
    """Every loader uninterrupted; a checkpoint with the data position after SAVE_AT steps.

    Returns each loader's global batches (their ids) step by step, and, for the DataLoader,
    whether this process's saved state is the one a fresh iterator has after SAVE_AT batches
    (not after those the helper read ahead).
    """
    out = {}
    for name, (make, pad) in LOADERS.items():
        steps = []
        with meshkit.global_batches(make(), _mesh(), "data", pad=pad, prefetch=3) as batches:
            for ids in _steps(batches, pad):
                steps.append(ids)
                if len(steps) == SAVE_AT:
                    # The datasets loader has one batch left after SAVE_AT.
                    out[name + " read ahead"] = _read_ahead(batches, 1 if name == "datasets" else 2)
                    state = {"step": SAVE_AT}
                    meshkit.checkpoint.save(f"{root}/{name}", state, data=batches)
        out[name] = steps
    it = iter(_dataloader())
    for _ in range(SAVE_AT):
        next(it)
    saved = meshkit.checkpoint.data_position(f"{root}/dataloader")
    out["state after the steps taken"] = saved.states[jax.process_index()] == encode_state(
        it.get_state()
    )
    return out


def resume(root):
    """Each loader resumed from its checkpoint's position: its global batches from there on.

    A position that does not resume here (per-process states on another process count) gives
    its error's message instead.
    """
    out = {}
    for name, (make, pad) in LOADERS.items():
        position = meshkit.checkpoint.data_position(f"{root}/{name}")
        assert meshkit.checkpoint.restore(f"{root}/{name}", _mesh()) == {"step": SAVE_AT}
        try:
            batches = meshkit.global_batches(make(), _mesh(), "data", pad=pad, start=position)
        except meshkit.MeshkitError as e:
            out[name] = str(e)
            continue
        with batches:
            out[name] = list(_steps(batches, pad))
            out[name + " steps"] = batches.steps
    return out


def resume_from_env():
    return resume(os.environ[CKPT])


def refusals(root):
    """Every bad input, raised on every process: each message (None: nothing raised)."""
    me = jax.process_index()
    out = {}

    def error(call):
        try:
            call()
        except meshkit.MeshkitError as e:
            return str(e)
        return None

    # Processes that save different positions.
    out["different positions"] = error(
        lambda: meshkit.checkpoint.save(
            f"{root}/different", {"step": 1}, data=meshkit.DataPosition(step=10 + me)
        )
    )
    out["nothing written"] = not os.path.exists(f"{root}/different")
    # Another loader (another seed) on every process.
    position = meshkit.checkpoint.data_position(f"{root}/grain")
    out["another loader"] = error(
        lambda: meshkit.global_batches(_grain(seed=8), _mesh(), "data", start=position)
    )
    # Another loader on process 1 only: every process raises, naming it.
    out["another loader on process 1"] = error(
        lambda: meshkit.global_batches(
            _grain(seed=8 if me == 1 else 7), _mesh(), "data", pad="ragged", start=position
        )
    )
    # Processes resuming at different positions.
    moved = meshkit.DataPosition(
        position.step + me, position.loader, position.epoch, (position.epoch_step or 0) + me
    )
    out["resumed at different positions"] = error(
        lambda: meshkit.global_batches(_grain(), _mesh(), "data", pad="ragged", start=moved)
    )
    # A checkpoint saved without a position.
    meshkit.checkpoint.save(f"{root}/no-data", {"step": 1})
    out["no data position"] = error(lambda: meshkit.checkpoint.data_position(f"{root}/no-data"))
    out["missing_ok"] = meshkit.checkpoint.data_position(f"{root}/no-data", missing_ok=True)
    # The loop goes on after all of these: the processes are still in step.
    with meshkit.global_batches(_grain(), _mesh(), "data", pad="ragged", start=position) as b:
        out["still in step"] = len(list(_steps(b, True)))
    # A resumed loop left early, after the same step on every process: no error (the steps
    # compared by stop_together count on from the position's, on every process alike).
    with meshkit.global_batches(_grain(), _mesh(), "data", pad="ragged", start=position) as b:
        next(b)
    out["closed together after"] = b.steps
    return out
