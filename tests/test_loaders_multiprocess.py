"""Real loaders through global_batches on 2 processes x 4 CPU devices, against 1 process x 8.

Each process builds the same dataset in memory, takes its part with `meshkit.loaders`, and feeds
a real grain ``DataLoader``, a grain ``MapDataset`` and a Hugging Face ``Dataset`` to
`meshkit.global_batches` with ``pad=True``, for two epochs. Every global batch is gathered: the
real rows (the mask) must cover the dataset once per epoch, the padding must be zeros outside
the mask, and the batches must equal those of the same code run as one process with 8 devices
(in the test process itself); the same again on a mesh whose data axis lies inside each
process (both processes load every row). A streaming ``IterableDataset``, split by node, must
cover every row once. Functions starting with an underscore run in the launched processes.
"""

from __future__ import annotations

import pytest
from ranks.preloads import ECOSYSTEM

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.long,
    pytest.mark.warm_cluster(preload=ECOSYSTEM),
]

GLOBAL_BATCH = 16
EPOCHS = 2


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _record(i):
    import numpy as np

    return {"id": np.int32(i), "x": np.array([i, -i], np.float32)}


def _epochs(batches_of_epoch, mesh):
    """Run ``batches_of_epoch(epoch)`` through global_batches; per epoch, each step's rows."""
    import numpy as np

    import meshkit

    out = []
    for epoch in range(EPOCHS):
        steps = []
        for batch, mask in meshkit.global_batches(batches_of_epoch(epoch), mesh, "data", pad=True):
            full = meshkit.gather({"batch": batch, "mask": mask})
            real = full["mask"]
            ids, x = full["batch"]["id"], full["batch"]["x"]
            np.testing.assert_array_equal(x[real], np.stack([ids[real], -ids[real]], 1))
            assert not ids[~real].any()  # padding is zeros
            assert not x[~real].any()
            steps.append({"rows": int(real.size), "ids": ids[real].tolist()})
        out.append(steps)
    return out


def _loader_runs():
    """Every loader's epochs of global batches, as this program's processes see them."""
    import warnings

    import datasets
    import grain
    import numpy as np

    import meshkit
    from meshkit import loaders

    # datasets' numpy format gives int64 integers; meshkit notes once that they become int32.
    warnings.filterwarnings("ignore", category=meshkit.DtypeWarning)
    mesh = meshkit.make_mesh({"data": -1})  # 2 processes: data across them
    part = meshkit.process_slice(mesh, "data", (GLOBAL_BATCH,))
    local_batch = part.local_shape[0]
    runs = {}

    # grain's DataLoader with meshkit's sampler, 45 rows: the last batch is 7 + 6 rows.
    source = [_record(i) for i in range(45)]

    def dataloader(epoch):
        return grain.DataLoader(
            data_source=source,
            sampler=loaders.grain_sampler(len(source), part, shuffle=True, seed=7, epoch=epoch),
            shard_options=grain.sharding.NoSharding(),
            operations=[grain.transforms.Batch(local_batch, drop_remainder=False)],
        )

    runs["grain DataLoader"] = _epochs(dataloader, mesh)

    # grain's MapDataset, 33 rows: the last global batch has 1 row, so process 1's loader ends
    # one batch before process 0's. Two epochs of one shuffled dataset: indices past the end.
    dataset = grain.MapDataset.source([_record(i) for i in range(33)]).shuffle(seed=3)

    def map_dataset(part):
        def epoch(e):  # grain reshuffles a shuffled MapDataset at each epoch past its end
            local = loaders.grain_dataset(dataset, part)
            return local.repeat(EPOCHS)[e * len(local) : (e + 1) * len(local)]

        return lambda e: epoch(e).batch(part.local_shape[0])

    runs["grain MapDataset"] = _epochs(map_dataset(part), mesh)

    # Hugging Face datasets, 45 rows, shuffled with the epoch as seed on every process.
    ids = np.arange(45, dtype=np.int32)
    table = datasets.Dataset.from_dict(
        {"id": ids, "x": np.stack([ids, -ids], 1).astype(np.float32)}
    )

    def hf(epoch):
        local = loaders.hf_dataset(table.shuffle(seed=epoch), part).with_format("numpy")
        return local.iter(batch_size=local_batch)

    runs["datasets Dataset"] = _epochs(hf, mesh)

    # Replicas: a mesh whose data axis lies inside each process; both processes load every row.
    inside = meshkit.make_mesh({"model": -1, "data": 4})
    whole = meshkit.process_slice(inside, "data", (GLOBAL_BATCH,))
    runs["replicas"] = _epochs(map_dataset(whole), inside)
    runs["part"] = [part.shard_index, part.shard_count, whole.shard_count, list(whole.replicas)]

    # A streaming IterableDataset, split by node (3 files: every other example per process).
    stream = datasets.Dataset.from_dict({"id": ids[:33]}).to_iterable_dataset(num_shards=3)
    streamed = loaders.hf_dataset(stream.with_format("numpy"), part).iter(batch_size=local_batch)
    runs["stream"] = []
    for batch, mask in meshkit.global_batches(streamed, mesh, "data", pad=True, dtype="int32"):
        full = meshkit.gather({"id": batch["id"], "mask": mask})
        runs["stream"].append(full["id"][full["mask"]].tolist())
    return runs


def _require(*modules):
    # Imported here, not at the top: the launched processes import this file, and conftest
    # would give them 8 CPU devices each instead of the launcher's 4.
    from conftest import require

    for module in modules:
        require(module)


def test_real_loaders_cover_every_row_once_and_match_one_process(warm_cluster):
    _require("grain", "datasets")
    results = warm_cluster.run(_loader_runs, timeout=240, env={"MESHKIT_CHECK_TIMEOUT": "60"})
    assert [r.pop("part") for r in results] == [[0, 2, 1, [0, 1]], [1, 2, 1, [0, 1]]]
    assert results[0] == results[1]  # every process gathers the same global batches
    runs = results[0]
    # A stream split by node: every row once, in batches that depend on the process count.
    assert sorted(i for step in runs.pop("stream") for i in step) == list(range(33))
    alone = _loader_runs()  # this test process: one process, 8 CPU devices
    assert alone.pop("part") == [0, 1, 1, [0]]
    assert sorted(i for step in alone.pop("stream") for i in step) == list(range(33))
    sizes = {"grain DataLoader": 45, "grain MapDataset": 33, "datasets Dataset": 45, "replicas": 33}
    for name, epochs in runs.items():
        assert epochs == alone[name], name  # the same global batches, step by step
        for steps in epochs:
            ids = [i for s in steps for i in s["ids"]]
            assert sorted(ids) == list(range(sizes[name])), name  # once per epoch
            assert all(s["rows"] == GLOBAL_BATCH for s in steps[:-1]), name
        assert epochs[0] != epochs[1], name  # reshuffled
    # The uneven last batches, padded: 7 + 6 real rows in 16 (4 per device on 2 x 4 devices,
    # 2 per device on 8), and 1 real row: process 1 contributes only padding.
    last = {name: [(s[-1]["rows"], len(s[-1]["ids"])) for s in e] for name, e in runs.items()}
    assert last["grain DataLoader"] == [(16, 13)] * EPOCHS
    assert last["grain MapDataset"] == [(8, 1)] * EPOCHS
    assert last["replicas"] == [(4, 1)] * EPOCHS  # the data axis: 4 devices in each process
