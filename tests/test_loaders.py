"""meshkit.loaders: which rows each process loads, for grain, Hugging Face datasets and numpy.

The plan is checked without processes, against meshkit's own layout of a global batch: the
processes of a test-double mesh (devices carrying a ``process_index``) each get their
`ProcessSlice`, and for any dataset size every row must be loaded once per epoch, every full
global batch must assemble to its rows in order, and the last one to the rows a single process
would load. The adapters are then checked against the plan with the real libraries; the
multi-process runs are in tests/test_loaders_multiprocess.py.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import require
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from test_layout import FakeDevice, fake_meshes, named_blocks

import meshkit
from meshkit import MeshkitError, loaders
from meshkit._src.loaders import rows as _loaders
from meshkit._src.sharding import layout as _layout
from meshkit._src.sharding.mesh import order_devices
from meshkit.testing import strategies as mks


@st.composite
def batch_layouts(draw):
    """(every process's ProcessSlice of one global batch, the layout plans) over 8 fake devices."""
    mesh, processes, _ = draw(fake_meshes())
    spec = draw(mks.specs(mesh, 1))
    (global_batch,) = draw(mks.shapes_for(mesh, spec, 1, max_block=4))
    blocks = named_blocks(mesh, spec, (global_batch,))
    plans = [_layout.plan_from_blocks(blocks, (global_batch,), p) for p in range(processes)]
    return [_layout.describe_plan(p) for p in plans], plans


@given(batch_layouts(), st.integers(0, 150))
def test_every_row_is_loaded_once_per_epoch_in_the_global_batches_one_process_would_load(
    layout, num_rows
):
    parts, plans = layout
    global_batch = parts[0].global_shape[0]
    local_batch = parts[0].local_shape[0]
    full = num_rows // global_batch
    rows = {p.process: loaders.process_rows(p, num_rows) for p in parts}
    by_shard = {}
    for part in parts:
        mine = rows[part.process]
        assert mine.dtype == np.int64
        # Processes of one shard (replicas, or rows shared with other columns) load the same.
        if part.shard_index in by_shard:
            np.testing.assert_array_equal(mine, by_shard[part.shard_index])
        by_shard[part.shard_index] = mine
        # The lazy plan (grain's datasets and sampler) agrees with the array.
        plan = _loaders._rows(part, num_rows, "test")
        assert [plan.position(j) for j in range(len(plan))] == mine.tolist()
    assert sorted(by_shard) == list(range(parts[0].shard_count))
    # Each full global batch k assembles, under meshkit's layout, to rows k*G..(k+1)*G in order.
    # (Processes hold different numbers of rows per batch in some hand-made meshes: each its own.)
    for plan in plans:
        mine, batch = rows[plan.process], plan.local_shape[0]
        for k in range(full):
            chunk = mine[k * batch : (k + 1) * batch]
            for placement in plan.placements:
                (g,), (loc,) = placement.global_index, placement.local_index
                np.testing.assert_array_equal(
                    chunk[loc], k * global_batch + np.arange(g.start, g.stop)
                )
    # Shards whose rows overlap only in hand-made meshes with devices in mixed order, where
    # shard_index cannot split a dataset; elsewhere they partition the rows of a global batch.
    row_sets = {p.shard_index: set(loaders.process_rows(p, global_batch).tolist()) for p in parts}
    if sum(map(len, row_sets.values())) > global_batch:
        return
    # Disjoint shards that cover every row exactly once.
    np.testing.assert_array_equal(
        np.sort(np.concatenate(list(by_shard.values()))), np.arange(num_rows)
    )
    # The last global batch: split as evenly as possible, in shard order, the rows one process
    # would load there (every shard's part of it is at most one local batch).
    tails = [by_shard[i][full * local_batch :] for i in range(len(by_shard))]
    assert max(map(len, tails)) - min(map(len, tails)) <= 1
    assert max(map(len, tails)) <= local_batch
    np.testing.assert_array_equal(
        np.concatenate(tails), np.arange(full * global_batch, num_rows, dtype=np.int64)
    )


def _one_process_part(global_batch=8):
    mesh = meshkit.make_mesh({"data": -1})
    return meshkit.process_slice(mesh, "data", (global_batch,))


def _two_process_parts(global_batch=8, replicas=False):
    """The ProcessSlices of 2 fake processes x 4 devices; with replicas, data inside each."""
    devices = [FakeDevice(i, i // 4) for i in range(8)]
    sizes, names = ((2, 4), ("model", "data")) if replicas else ((8,), ("data",))
    mesh = SimpleNamespace(
        devices=order_devices(devices, sizes),
        axis_names=names,
        shape=dict(zip(names, sizes, strict=True)),
    )
    blocks = named_blocks(mesh, P("data"), (global_batch,))
    return [
        _layout.describe_plan(_layout.plan_from_blocks(blocks, (global_batch,), p)) for p in (0, 1)
    ]


def test_process_rows_of_two_processes():
    p0, p1 = _two_process_parts()
    assert loaders.process_rows(p0, 20).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17]
    assert loaders.process_rows(p1, 20).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 18, 19]
    # 17 rows: the last global batch holds one row, process 1 none of it.
    assert loaders.process_rows(p1, 17).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    r0, r1 = _two_process_parts(replicas=True)
    assert (r0.shard_count, r0.replicas) == (1, (0, 1))
    assert loaders.process_rows(r0, 20).tolist() == loaders.process_rows(r1, 20).tolist()
    assert loaders.process_rows(r0, 20).tolist() == list(range(20))


@pytest.mark.parametrize(
    ("part", "num_rows", "message"),
    [
        (
            "data",
            8,
            r"^meshkit.loaders.process_rows: part must be a meshkit.ProcessSlice; got str.\n"
            r"Consider part = meshkit.process_slice\(mesh, spec, \(global_batch,\)\), the layout of one global batch.$",
        ),
        (
            None,
            -1,
            r"^meshkit.loaders.process_rows: the number of rows must be an int >= 0; got -1.$",
        ),
        (
            None,
            2.0,
            r"^meshkit.loaders.process_rows: the number of rows must be an int .*got 2.0.$",
        ),
        (None, True, r"the number of rows must be an int .*got True"),
    ],
)
def test_process_rows_refuses_bad_input(part, num_rows, message):
    with pytest.raises(MeshkitError, match=message):
        loaders.process_rows(_one_process_part() if part is None else part, num_rows)


def test_process_rows_refuses_a_slice_without_rows():
    part = meshkit.process_slice(meshkit.make_mesh({"data": -1}), "", ())
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.loaders.process_rows: part describes a global array of shape \(\), which has no rows to split.\n"
        r"Consider part = meshkit.process_slice\(mesh, spec, \(global_batch,\)\) with a global batch of at least one row.$",
    ):
        loaders.process_rows(part, 8)


# grain


def test_grain_dataset_reads_the_plan_lazily_and_reaches_the_next_epochs():
    grain = require("grain")
    for part in _two_process_parts():
        ds = grain.MapDataset.range(21).shuffle(seed=3)
        local = loaders.grain_dataset(ds, part)
        rows = loaders.process_rows(part, 21)
        assert len(local) == len(rows)
        assert [local[j] for j in range(len(local))] == [ds[int(r)] for r in rows]
        # Index len + j: epoch 1 of the parent, which grain reshuffles.
        second = [local[len(local) + j] for j in range(len(local))]
        assert second == [ds[21 + int(r)] for r in rows]
        assert second != [local[j] for j in range(len(local))]
        assert list(local.repeat(2)) == [local[j] for j in range(2 * len(local))]
        batches = [b.tolist() for b in local.batch(part.local_shape[0])]
        assert [len(b) for b in batches] == [4, 4, 3 if part.process == 0 else 2]
        assert local[2:4][0] == local[2]  # slices are grain's own


def test_grain_dataset_of_an_empty_part():
    grain = require("grain")
    _, p1 = _two_process_parts()
    local = loaders.grain_dataset(grain.MapDataset.range(1), p1)  # process 1 gets no row
    assert len(local) == 0
    assert list(local.batch(4)) == []
    with pytest.raises(IndexError):
        local[0]


def test_grain_dataset_refuses_an_iter_dataset():
    grain = require("grain")
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.loaders.grain_dataset: expected a grain.MapDataset \(random access\); got \w+.\n"
        r"Consider taking the part of the MapDataset before .to_iter_dataset\(\), or, for a pipeline without random access, "
        r"grain's own sharding with meshkit.loaders.grain_shard_options\(part\).$",
    ):
        loaders.grain_dataset(grain.MapDataset.range(4).to_iter_dataset(), _one_process_part())


def test_grain_sampler_keys_are_grains_shuffle_at_meshkits_positions():
    grain = require("grain")
    order = grain.MapDataset.range(21).shuffle(seed=5)
    one = loaders.grain_sampler(21, _one_process_part(), shuffle=True, seed=5, epoch=1)
    assert [one[j].record_key for j in range(21)] == [order[21 + j] for j in range(21)]
    # Each record's rng comes from its position in the epoch: the same draw whatever the
    # number of processes.
    draws = {one[j].record_key: one[j].rng.integers(1 << 30) for j in range(21)}
    keys = []
    for part in _two_process_parts():
        sampler = loaders.grain_sampler(21, part, shuffle=True, seed=5, epoch=1)
        assert len(sampler) == len(loaders.process_rows(part, 21))
        for j in range(len(sampler)):
            record = sampler[j]
            assert record.index == j
            assert record.rng.integers(1 << 30) == draws[record.record_key]
            keys.append(record.record_key)
        with pytest.raises(IndexError):
            sampler[len(sampler)]
        assert "seed=5, epoch=1" in repr(sampler)
    assert sorted(keys) == list(range(21))
    plain = loaders.grain_sampler(21, _one_process_part())
    assert [plain[j].record_key for j in range(21)] == list(range(21))
    assert plain[0].rng is None


def test_a_grain_dataloader_with_the_sampler_feeds_global_batches():
    grain = require("grain")
    part = _one_process_part(global_batch=8)
    source = [{"id": np.int32(i), "x": np.full(2, i, np.float32)} for i in range(20)]
    loader = grain.DataLoader(
        data_source=source,
        sampler=loaders.grain_sampler(len(source), part, shuffle=True, seed=0),
        shard_options=grain.sharding.NoSharding(),
        operations=[grain.transforms.Batch(part.local_shape[0])],
    )
    mesh = meshkit.make_mesh({"data": -1})
    seen, shapes = [], []
    for batch, mask in meshkit.global_batches(loader, mesh, "data", pad=True):
        ids = np.asarray(batch["id"])[np.asarray(mask)]
        np.testing.assert_array_equal(np.asarray(batch["x"])[np.asarray(mask)][:, 0], ids)
        seen += ids.tolist()
        shapes.append((batch["id"].shape, int(mask.sum())))
    assert shapes == [((8,), 8), ((8,), 8), ((8,), 4)]
    assert sorted(seen) == list(range(20))
    order = grain.MapDataset.range(20).shuffle(seed=0)
    assert seen == [order[i] for i in range(20)]


def test_grain_sampler_refuses_bad_input():
    part = _one_process_part()
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.loaders.grain_sampler: shuffle=True needs a seed, the same on every process.\n"
        r"Consider seed=0 \(any int in \[0, 2\*\*32\)\).$",
    ):
        loaders.grain_sampler(8, part, shuffle=True)
    with pytest.raises(
        MeshkitError, match=r"^meshkit.loaders.grain_sampler: seed must be .*got -1.$"
    ):
        loaders.grain_sampler(8, part, shuffle=True, seed=-1)
    with pytest.raises(MeshkitError, match=r"epoch must be an int >= 0; got -1."):
        loaders.grain_sampler(8, part, epoch=-1)
    with pytest.raises(MeshkitError, match=r"shuffle must be True or False; got 1."):
        loaders.grain_sampler(8, part, shuffle=1)  # type: ignore[arg-type]
    with pytest.raises(MeshkitError, match=r"^meshkit.loaders.grain_sampler: part must be"):
        loaders.grain_sampler(8, (0, 1))  # type: ignore[arg-type]


def test_grain_shard_options_follow_the_shards_not_the_process_index():
    grain = require("grain")
    _, r1 = _two_process_parts(replicas=True)
    assert loaders.grain_shard_options(r1) == grain.sharding.ShardOptions(0, 1, False)
    _, p1 = _two_process_parts()
    assert loaders.grain_shard_options(p1, drop_remainder=True) == grain.sharding.ShardOptions(
        1, 2, True
    )
    with pytest.raises(MeshkitError, match=r"^meshkit.loaders.grain_shard_options: part must be"):
        loaders.grain_shard_options(1)  # type: ignore[arg-type]


def test_grains_own_dataloader_sharding_leaves_records_out():
    # What the docs say of grain's own sharding (grain 0.2.18): its DataLoader reads
    # num_records // shard_count records per shard, so 17 records over 2 shards lose one.
    grain = require("grain")
    seen = []
    for part in _two_process_parts():
        options = loaders.grain_shard_options(part)
        loader = grain.DataLoader(
            data_source=list(range(17)),
            sampler=grain.samplers.IndexSampler(17, shard_options=options, num_epochs=1),
            shard_options=options,
        )
        seen += list(loader)
    assert len(seen) == 16
    assert sorted(set(range(17)) - set(seen)) == [8]


# Hugging Face datasets


def test_hf_dataset_selects_the_plan_and_splits_streams_by_node():
    datasets = require("datasets")
    from datasets.distributed import split_dataset_by_node

    ds = datasets.Dataset.from_dict({"id": list(range(21))}).shuffle(seed=2)
    order = ds["id"]
    streamed = datasets.Dataset.from_dict({"id": list(range(21))}).to_iterable_dataset(3)
    seen = []
    for part in _two_process_parts():
        local = loaders.hf_dataset(ds, part)
        assert local["id"] == [order[int(r)] for r in loaders.process_rows(part, 21)]
        sizes = [len(b["id"]) for b in local.iter(batch_size=part.local_shape[0])]
        assert sizes == [4, 4, 3 if part.process == 0 else 2]
        mine = [r["id"] for r in loaders.hf_dataset(streamed, part)]
        theirs = split_dataset_by_node(streamed, rank=part.shard_index, world_size=2)
        assert mine == [r["id"] for r in theirs]
        seen += mine
    assert sorted(seen) == list(range(21))


def test_hf_dataset_feeds_global_batches():
    datasets = require("datasets")
    part = _one_process_part(global_batch=8)
    ds = datasets.Dataset.from_dict(
        {"id": np.arange(20, dtype=np.int32), "x": np.arange(40, dtype=np.float32).reshape(20, 2)}
    )
    local = loaders.hf_dataset(ds.shuffle(seed=1), part).with_format("numpy")
    mesh = meshkit.make_mesh({"data": -1})
    seen = []
    with warnings.catch_warnings():
        # datasets' numpy format gives int64 integers; meshkit's notice that they become int32.
        warnings.simplefilter("ignore", meshkit.DtypeWarning)
        batches = meshkit.global_batches(local.iter(batch_size=8), mesh, "data", pad=True)
        for batch, mask in batches:
            real = np.asarray(mask)
            seen += np.asarray(batch["id"])[real].tolist()
            np.testing.assert_array_equal(
                np.asarray(batch["x"])[real][:, 0], 2 * np.asarray(batch["id"])[real]
            )
    assert seen == ds.shuffle(seed=1)["id"]


def test_hf_dataset_refuses_what_is_not_one_dataset():
    datasets = require("datasets")
    part = _one_process_part()
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"id": [1]}),
            "test": datasets.Dataset.from_dict({"id": [2]}),
        }
    )
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.loaders.hf_dataset: expected a datasets.Dataset or datasets.IterableDataset; got DatasetDict, "
        r"which holds the splits \['test', 'train'\].\nConsider one split, such as dataset\['test'\].$",
    ):
        loaders.hf_dataset(splits, part)
    with pytest.raises(
        MeshkitError,
        match=r"got list.\nConsider datasets.Dataset.from_dict\(...\) or load_dataset\(...\)\[split\]; "
        r"for other loaders, meshkit.loaders.process_rows\(part, num_rows\).$",
    ):
        loaders.hf_dataset([1, 2], part)
    with pytest.raises(MeshkitError, match=r"^meshkit.loaders.hf_dataset: part must be"):
        loaders.hf_dataset(datasets.Dataset.from_dict({"id": [1]}), "data")  # type: ignore[arg-type]


def test_importing_meshkit_loaders_imports_neither_library():
    import subprocess
    import sys

    code = (
        "import sys, meshkit, meshkit.loaders; "
        "print(sorted(m for m in ('grain', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
