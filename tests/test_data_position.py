"""The data position: meshkit's resumable loaders, GlobalBatches.position and start=, in one process.

The loaders are checked without processes against a numpy reference: the processes of a
test-double mesh (devices carrying a ``process_index``) each get their `ProcessSlice`, and for
any dataset size, global batch, seed and epochs, their parts of every global step must assemble
to the reference global batch (the epoch's permutation, sliced), and a loader started at any step
must yield what an uninterrupted one yields from there. `global_batches` is then checked with
real loaders on this process's 8 CPU devices: the position after the caller's steps (never the
batches read ahead), resuming at it, and every bad ``start=``. Saving the position in a
checkpoint is in tests/test_checkpoint_data.py; real processes in
tests/test_data_position_multiprocess.py.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from conftest import require
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_loaders import _two_process_parts, batch_layouts

import meshkit
from meshkit import MeshkitError, loaders
from meshkit._src.core.data_position import (
    GlobalIterator,
    LoaderIdentity,
    decode_state,
    encode_state,
)
from meshkit._src.loaders.resumable import permute

pytestmark = pytest.mark.filterwarnings("ignore::meshkit.DtypeWarning")  # int64 ids -> int32


# The position itself.

identities = st.builds(
    LoaderIdentity,
    kind=st.sampled_from(["grain", "datasets"]),
    num_rows=st.integers(0, 10**9),
    global_batch=st.integers(1, 10**5),
    seed=st.none() | st.integers(0, 2**32 - 1),
    epochs=st.integers(1, 1000),
    drop_remainder=st.booleans(),
)


@st.composite
def positions(draw):
    kind = draw(st.sampled_from(["loader", "states", "steps"]))
    processes = draw(st.integers(1, 8))
    step = draw(st.integers(0, 10**9))
    if kind == "loader":
        return meshkit.DataPosition(
            step, draw(identities), draw(st.integers(0, 999)), draw(st.integers(0, 10**5)),
            processes,
        )  # fmt: skip
    if kind == "states":
        states = {p: encode_state(draw(st.binary(max_size=64))) for p in range(processes)}
        return meshkit.DataPosition(step, processes=processes, states=states)
    return meshkit.DataPosition(step, processes=processes)


@given(positions())
def test_a_position_survives_json(position):
    text = position.to_json()
    assert meshkit.DataPosition.from_json(text) == position
    assert meshkit.DataPosition.from_dict(json.loads(text)) == position
    assert position.kind in ("loader", "states", "steps")


@given(st.binary(max_size=512) | st.dictionaries(st.text(max_size=8), st.integers(), max_size=8))
def test_states_are_encoded_as_json_text_and_back(state):
    assert decode_state(encode_state(state)) == state


def test_a_state_that_is_not_bytes_nor_json_cannot_be_encoded():
    with pytest.raises(TypeError, match="a state of type object is neither bytes nor JSON values"):
        encode_state(object())


def test_loader_position_counts_epochs_and_steps_in_them():
    identity = LoaderIdentity("grain", 45, 16, 7, 2)
    assert identity.steps_per_epoch == 3
    assert LoaderIdentity("grain", 45, 16, 7, 2, drop_remainder=True).steps_per_epoch == 2
    p = meshkit.DataPosition(7, identity, epoch=1, epoch_step=2, processes=2)
    assert p.loader_step == 5
    assert p.describe() == (
        "step 7 of grain_batches(num_rows=45, global_batch=16, seed=7, epochs=2), epoch 1 at "
        "its step 2"
    )
    assert len(p.to_json()) < 1024


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", r"^meshkit.DataPosition.from_json: not JSON \(.*\): '\{'.$"),
        ("[1]", r"^meshkit.DataPosition.from_json: expected a JSON object; got list.$"),
        ('{"step": 1}', r"^meshkit.DataPosition.from_json: no valid format version in \{"),
        (
            '{"version": 2, "step": 1}',
            r"^meshkit.DataPosition.from_json: the data position is of format version 2; this "
            r"meshkit reads versions up to 1.\nConsider the meshkit version that saved it, or a "
            r"newer one.$",
        ),
        ('{"version": 1}', r"^meshkit.DataPosition.from_json: not a data position \(KeyError"),
        (
            '{"version": 1, "step": -1}',
            r"not a data position \(ValueError\('expected an int >= 0, got -1'\)\)",
        ),
    ],
)
def test_what_is_no_data_position_is_refused(text, message):
    with pytest.raises(MeshkitError, match=message):
        meshkit.DataPosition.from_json(text)


# The loaders' order, and the loaders against a numpy reference.


@given(st.integers(0, 3000), st.integers(0, 2**32 - 1), st.integers(0, 10**6))
def test_the_order_is_a_permutation_of_every_epoch(n, seed, epoch):
    order = permute(np.arange(n), n, seed, epoch)
    assert order.dtype == np.int64
    np.testing.assert_array_equal(np.sort(order), np.arange(n))


def test_the_order_never_changes_between_runs_or_versions():
    # A saved position names rows through this order: these values are part of the format.
    assert permute(np.arange(10), 10, 0, 0).tolist() == [2, 6, 5, 8, 9, 1, 7, 3, 4, 0]
    assert permute(np.arange(10), 10, 0, 1).tolist() == [0, 4, 6, 2, 9, 8, 5, 7, 1, 3]
    assert permute(np.arange(10), 10, 1, 0).tolist() == [7, 6, 9, 8, 4, 1, 0, 3, 2, 5]
    big = permute(np.array([0, 1, 10**9 - 1]), 10**9, 2**32 - 1, 12345).tolist()
    assert big == [538122852, 952610892, 709792127]


def test_the_order_shuffles_evenly():
    # Where row 0 lands, over 5000 seeds: every position about as often.
    counts = np.bincount([permute(np.array([0]), 10, s, 0)[0] for s in range(2000)], minlength=10)
    assert counts.min() > 140
    assert counts.max() < 260
    order = permute(np.arange(10000), 10000, 3, 0)
    assert abs(np.corrcoef(np.arange(10000), order)[0, 1]) < 0.05


def _grain_source(n):
    import grain

    # Each element is the index the loader read: epoch * n + key.
    return grain.MapDataset.range(n).map_with_index(lambda i, _: np.int64(i))


def _order(n, seed, epoch):
    """Epoch ``epoch``'s order of ``range(n)``: the permutation, one position at a time."""
    if seed is None:
        return np.arange(n)
    return np.array([permute(np.array([i]), n, seed, epoch)[0] for i in range(n)], np.int64)


def _reference(n, global_batch, seed, epochs, drop, kind):
    """Every global batch, as the dataset indices read (grain) or the row ids (datasets)."""
    batches = []
    for e in range(epochs):
        order = _order(n, seed, e) + (e * n if kind == "grain" else 0)
        stop = n - n % global_batch if drop else n
        batches += [order[k : min(k + global_batch, stop)] for k in range(0, stop, global_batch)]
    return batches


def _loader(kind, n, part, **options):
    if kind == "grain":
        require("grain")
        return loaders.grain_batches(_grain_source(n), part, **options)
    return loaders.hf_batches(_table(n), part, **options)


@functools.cache
def _table(n):
    require("datasets")
    import datasets

    return datasets.Dataset.from_dict({"id": np.arange(n, dtype=np.int64)})


def _ids(batch):
    return np.asarray(batch["id"] if isinstance(batch, dict) else batch)


@settings(max_examples=40)
@given(
    batch_layouts(),
    st.integers(0, 70),
    st.none() | st.integers(0, 2**32 - 1),
    st.integers(1, 3),
    st.booleans(),
    st.sampled_from(["grain", "datasets"]),
    st.data(),
)
def test_the_parts_of_every_process_assemble_to_the_reference_and_resume_anywhere(
    layout, n, seed, epochs, drop, kind, data
):
    parts, plans = layout
    global_batch = parts[0].global_shape[0]
    # Meshes whose shards partition a global batch (not hand-made ones of mixed device order).
    rows = {p.shard_index: set(loaders.process_rows(p, global_batch).tolist()) for p in parts}
    assume(sum(map(len, rows.values())) == global_batch)
    reference = _reference(n, global_batch, seed, epochs, drop, kind)
    runs = {}
    for part in parts:
        loader = _loader(kind, n, part, seed=seed, epochs=epochs, drop_remainder=drop)
        assert len(loader) == len(reference)
        runs[part.process] = [_ids(b) for b in loader]
        # A loader started at any step yields what the uninterrupted one yields from there.
        k = data.draw(st.integers(0, len(reference)), label="resume at")
        resumed = loader.iterate(k)
        assert isinstance(resumed, GlobalIterator)
        assert resumed.step == k
        rest = [_ids(b) for b in resumed]
        assert resumed.step == len(reference)
        assert len(rest) == len(reference) - k
        for a, b in zip(rest, runs[part.process][k:], strict=True):
            np.testing.assert_array_equal(a, b)
    full = n // global_batch
    per_epoch = len(reference) // epochs
    for step, want in enumerate(reference):
        if step % per_epoch < full:  # a full global batch: each process's rows in place
            got = np.full(global_batch, -1, np.int64)
            for plan in plans:
                local = runs[plan.process][step]
                for placement in plan.placements:
                    (g,), (loc,) = placement.global_index, placement.local_index
                    got[g] = local[loc]
            np.testing.assert_array_equal(got, want)
        else:  # the short last one: the shards' parts in shard order (a shard's may be empty)
            shards = {p.shard_index: runs[p.process][step] for p in parts}
            got = np.concatenate([shards[i] for i in sorted(shards)])
            np.testing.assert_array_equal(got, want)


def test_a_grain_loader_reads_its_batches_in_grains_threads_and_stacks_elements():
    require("grain")
    import grain

    part = _two_process_parts(global_batch=8)[1]
    ds = grain.MapDataset.range(20).map(lambda i: {"id": np.int32(i), "x": np.ones(3) * i})
    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    batches = list(loaders.grain_batches(ds, part, read_options=options))
    assert [b["id"].tolist() for b in batches] == [[4, 5, 6, 7], [12, 13, 14, 15], [18, 19]]
    assert batches[0]["x"].shape == (4, 3)
    # 17 rows: process 1 has no row of the last global batch; its part is empty, not missing.
    empty = list(loaders.grain_batches(grain.MapDataset.range(17), part))[-1]
    assert empty.shape == (0,)
    assert empty.dtype == np.int64
    assert repr(loaders.grain_batches(ds, part, seed=3, epochs=2, drop_remainder=True)) == (
        "meshkit.loaders.grain_batches(num_rows=20, global_batch=8, seed=3, epochs=2, "
        "drop_remainder=True)"
    )


def test_an_hf_loader_gives_numpy_columns_and_empty_parts():
    require("datasets")
    import datasets

    part = _two_process_parts(global_batch=8)[1]
    table = datasets.Dataset.from_dict({"id": list(range(17)), "x": [[i, -i] for i in range(17)]})
    batches = list(loaders.hf_batches(table, part))
    assert [b["id"].tolist() for b in batches] == [[4, 5, 6, 7], [12, 13, 14, 15], []]
    assert batches[0]["x"].shape == (4, 2)
    assert batches[-1]["x"].shape == (0, 2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda ds, part: loaders.grain_batches(list(range(8)), part),
            r"^meshkit.loaders.grain_batches: expected a grain.MapDataset \(random access\); got "
            r"list.\nConsider grain.MapDataset.source\(...\) with the maps before "
            r".to_iter_dataset\(\); for a pipeline without random access, its iterator in "
            r"meshkit.global_batches saves grain's own state \(resumable on as many processes\).$",
        ),
        (
            lambda ds, part: loaders.grain_batches(ds, part, seed=-1),
            r"^meshkit.loaders.grain_batches: seed must be None \(no shuffle\) or an int in "
            r"\[0, 2\*\*32\), the same on every process; got -1.$",
        ),
        (
            lambda ds, part: loaders.grain_batches(ds, part, seed=True),
            r"seed must be None \(no shuffle\) or an int in \[0, 2\*\*32\), the same on every "
            r"process; got True.$",
        ),
        (
            lambda ds, part: loaders.grain_batches(ds, part, epochs=0),
            r"^meshkit.loaders.grain_batches: epochs must be an int >= 1; got 0.$",
        ),
        (
            lambda ds, part: loaders.grain_batches(ds, part, drop_remainder=1),
            r"^meshkit.loaders.grain_batches: drop_remainder must be True or False; got 1.$",
        ),
        (
            lambda ds, part: loaders.grain_batches(ds, part, read_options=4),
            r"^meshkit.loaders.grain_batches: read_options must be a grain.ReadOptions; got int.$",
        ),
        (
            lambda ds, part: loaders.grain_batches(ds, "data"),
            r"^meshkit.loaders.grain_batches: part must be a meshkit.ProcessSlice; got str.",
        ),
        (
            lambda ds, part: loaders.grain_batches(ds, part).iterate(5),
            r"^meshkit.loaders.grain_batches\(num_rows=20, global_batch=8, seed=None, "
            r"epochs=1\).iterate: step must be an int in \[0, 3\]; got 5.$",
        ),
    ],
)
def test_bad_grain_loaders(call, message):
    require("grain")
    import grain

    with pytest.raises(MeshkitError, match=message):
        call(grain.MapDataset.range(20), _two_process_parts(global_batch=8)[0])


def test_bad_hf_loaders():
    require("datasets")
    import datasets

    part = _two_process_parts()[0]
    table = datasets.Dataset.from_dict({"id": list(range(20))})
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.loaders.hf_batches: expected a map-style datasets.Dataset; got "
        r"DatasetDict, which holds the splits \['train'\].\nConsider one split, such as "
        r"dataset\['train'\].$",
    ):
        loaders.hf_batches(datasets.DatasetDict({"train": table}), part)
    with pytest.raises(
        MeshkitError,
        match=r"got IterableDataset.\nConsider meshkit.loaders.hf_dataset\(dataset, part\) for a "
        r"stream \(its position is not saved\), or a map-style datasets.Dataset",
    ):
        loaders.hf_batches(table.to_iterable_dataset(), part)
    with pytest.raises(
        MeshkitError,
        match=r"got list.\nConsider datasets.Dataset.from_dict\(...\) or load_dataset\(...\)\[split\].$",
    ):
        loaders.hf_batches([1, 2], part)
    with pytest.raises(MeshkitError, match=r"^meshkit.loaders.hf_batches: epochs must be an int"):
        loaders.hf_batches(table, part, epochs=1.5)


# global_batches: the position after the caller's steps, and start=.


def _mesh():
    return meshkit.make_mesh({"data": -1})


def _grain_loader(n=45, global_batch=16, seed=7, epochs=2, **options):
    require("grain")
    part = meshkit.process_slice(_mesh(), "data", (global_batch,))
    return loaders.grain_batches(_grain_source(n), part, seed=seed, epochs=epochs, **options)


def _made(loader):
    with meshkit.global_batches(loader, _mesh(), "data", pad="ragged") as batches:
        return batches.position()


def _run(loader, *, start=None, stop=None, prefetch=2):
    """The global batches' real rows, step by step; and the position where the run stopped."""
    out = []
    with meshkit.global_batches(loader, _mesh(), "data", pad="ragged", start=start,
                                prefetch=prefetch) as batches:  # fmt: skip
        for batch, mask in batches:
            out.append(np.asarray(batch)[np.asarray(mask)].tolist())
            if len(out) == stop:
                break
        return out, batches.position()


@settings(max_examples=15)
@given(st.integers(1, 40), st.sampled_from([8, 16, 24]), st.integers(1, 3), st.data())
def test_resuming_a_meshkit_loader_gives_the_batches_an_uninterrupted_run_takes(
    n, global_batch, epochs, data
):
    full, end = _run(_grain_loader(n, global_batch, 3, epochs))
    assert end.step == len(full)
    assert (end.epoch, end.epoch_step) == (epochs, 0)
    k = data.draw(st.integers(0, len(full)))
    prefetch = data.draw(st.integers(1, 4))
    head, position = _run(_grain_loader(n, global_batch, 3, epochs), stop=k, prefetch=prefetch)
    if k == 0:  # no step taken: the position of the iterator as made
        head, position = [], _made(_grain_loader(n, global_batch, 3, epochs))
    assert position.step == k
    assert position.loader_step == k
    assert position.kind == "loader"
    assert position.processes == 1
    rest, again = _run(_grain_loader(n, global_batch, 3, epochs), start=position)
    assert head + rest == full
    assert again == end  # steps count on from the position


def test_the_position_is_the_one_after_the_callers_step_not_the_batches_read_ahead():
    require("grain")
    import grain

    def source():
        return grain.MapDataset.range(80).batch(8).to_iter_dataset()

    for prefetch in (1, 2, 4):
        batches = meshkit.global_batches(source(), _mesh(), "data", prefetch=prefetch)
        it = iter(source())
        assert batches.position().states == {0: encode_state(it.get_state())}
        for step in range(1, 9):
            next(batches)
            next(it)
            assert batches._prefetch.assembled >= step
            position = batches.position()
            assert position.step == step
            assert position.states == {0: encode_state(it.get_state())}, (prefetch, step)
        batches.close()
        # Resumed from it: the batches the uninterrupted source gives next.
        resumed = meshkit.global_batches(source(), _mesh(), "data", start=position)
        assert [int(np.asarray(b)[0]) for b in resumed] == [64, 72]
        assert resumed.steps == 10


def test_a_grain_dataloader_resumes_from_its_own_state():
    require("grain")
    import grain

    part = meshkit.process_slice(_mesh(), "data", (8,))
    source = [{"id": np.int32(i)} for i in range(40)]

    def dataloader():
        return grain.DataLoader(
            data_source=source,
            sampler=loaders.grain_sampler(len(source), part, shuffle=True, seed=1),
            shard_options=grain.sharding.NoSharding(),
            operations=[grain.transforms.Batch(8)],
        )

    def ids(batches):
        return [np.asarray(b["id"]).tolist() for b in batches]

    full = ids(meshkit.global_batches(dataloader(), _mesh(), "data"))
    batches = meshkit.global_batches(dataloader(), _mesh(), "data", prefetch=3)
    head = ids([next(batches), next(batches)])
    position = batches.position()
    batches.close()
    assert len(position.to_json()) < 1024  # grain's state, encoded, per process
    resumed = meshkit.global_batches(dataloader(), _mesh(), "data", start=position)
    assert head + ids(resumed) == full


def test_a_plain_iterator_keeps_only_its_steps():
    loader = (np.full((8,), i, np.float32) for i in range(3))
    batches = meshkit.global_batches(loader, _mesh(), "data")
    assert batches.position() == meshkit.DataPosition(0)
    next(batches)
    assert batches.position() == meshkit.DataPosition(1)
    assert batches.position().kind == "steps"
    batches.close()


class _Unsavable:
    """An iterator whose state is an object: its position is kept, not savable as JSON."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        if self.i > 2:
            raise StopIteration
        return np.zeros(8, np.float32)

    def get_state(self):
        return object()

    def set_state(self, state):
        raise AssertionError("not called")


def test_an_unsavable_state_is_marked_in_the_position():
    batches = meshkit.global_batches(_Unsavable(), _mesh(), "data")
    next(batches)
    assert json.loads(batches.position().states[0]) == {"unsavable": "object"}
    batches.close()


def _start_error(loader, start, **options):
    with pytest.raises(MeshkitError) as info:
        meshkit.global_batches(loader, _mesh(), "data", start=start, **options)
    return str(info.value)


def test_a_position_of_another_loader_is_refused_naming_what_differs():
    _, position = _run(_grain_loader(), stop=2)
    for changed, differs in [
        ({"seed": 8}, r"seed 7 \(this loader: 8\)"),
        ({"n": 46}, r"num_rows 45 \(this loader: 46\)"),
        ({"global_batch": 8}, r"global_batch 16 \(this loader: 8\)"),
        ({"drop_remainder": True}, r"drop_remainder False \(this loader: True\)"),
    ]:
        message = _start_error(_grain_loader(**changed), position)
        assert re_match(
            r"^meshkit.global_batches: start= is the position of another loader: it was taken "
            r"from grain_batches\(num_rows=45, global_batch=16, seed=7, epochs=2\), and the "
            r"loader given is grain_batches\(.*\); they differ in " + differs + r". A position "
            r"resumes the loader it was taken from \(the same dataset length, global batch, seed "
            r"and drop_remainder\), so that the next global batch is the one the saved run would "
            r"have taken.\nConsider building the loader as the saved run did \(DataPosition.loader "
            r"describes it\), or start=None to start this loader from its beginning.$",
            message,
        )
    # Another kind of loader (another order): refused too.
    require("datasets")
    import datasets

    table = datasets.Dataset.from_dict({"id": list(range(45))})
    part = meshkit.process_slice(_mesh(), "data", (16,))
    message = _start_error(loaders.hf_batches(table, part, seed=7, epochs=2), position)
    assert "they differ in kind 'grain' (this loader: 'datasets')" in message
    # More epochs than the saved run: the position resumes there.
    rest, _ = _run(_grain_loader(epochs=3), start=position)
    assert len(rest) == 3 * 3 - 2


def re_match(pattern, text):
    import re

    assert re.match(pattern, text, re.S), f"{pattern!r}\n !~ {text!r}"
    return True


def test_a_position_past_the_loaders_end_is_refused():
    _, position = _run(_grain_loader(epochs=3), stop=7)
    message = _start_error(_grain_loader(epochs=2), position)
    assert message == (
        "meshkit.global_batches: start= is at epoch 2, step 1 of it, past the end of "
        "grain_batches(num_rows=45, global_batch=16, seed=7, epochs=2) (6 global batches in 2 "
        "epochs).\nConsider epochs=3 or more."
    )


def test_positions_of_other_kinds_of_source_are_refused():
    require("grain")
    import grain

    _, of_loader = _run(_grain_loader(), stop=1)
    plain = [np.zeros(8, np.float32)]
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.global_batches: start= holds the position of a meshkit loader, "
        r"grain_batches\(num_rows=45, global_batch=16, seed=7, epochs=2\), and the iterable "
        r"given is a list_iterator: a position resumes the kind of source it was taken from.\n"
        r"Consider passing meshkit.loaders.grain_batches\(num_rows=45, global_batch=16, seed=7, "
        r"epochs=2\) as the saved run did.$",
    ):
        meshkit.global_batches(plain, _mesh(), "data", start=of_loader)
    of_states = meshkit.DataPosition(1, processes=1, states={0: encode_state(b"x")})
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.global_batches: start= holds the states of a source with "
        r"get_state\(\)/set_state\(\) \(a grain DataLoader or IterDataset iterator\), and the "
        r"iterable given is a meshkit loader, grain_batches\(.*\): a position resumes the kind "
        r"of source it was taken from.\nConsider passing the same kind of source as the saved "
        r"run did.$",
    ):
        meshkit.global_batches(_grain_loader(), _mesh(), "data", start=of_states)
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.global_batches: start= holds the states of a source with "
        r"get_state\(\)/set_state\(\) \(a grain DataLoader or IterDataset iterator\), and the "
        r"iterable given is a list_iterator, which has no set_state\(\): a position resumes the "
        r"kind of source it was taken from.\nConsider passing the same kind of source as the "
        r"saved run did.$",
    ):
        meshkit.global_batches(plain, _mesh(), "data", start=of_states)
    steps = (
        r"^meshkit.global_batches: start= holds only a step count \(step 3\): its batches came "
        r"from an iterable without a position to save \(no meshkit loader, no get_state\(\)\), "
        r"so nothing says where to resume it.\nConsider meshkit.loaders.grain_batches or "
        r"hf_batches, whose position is global and resumes on any number of processes; or a "
        r"source with get_state\(\)/set_state\(\), such as a grain DataLoader's iterator; or "
        r"start=None to start the data from its beginning.$"
    )
    for source in (plain, _grain_loader(), grain.MapDataset.range(8).to_iter_dataset()):
        with pytest.raises(MeshkitError, match=steps):
            meshkit.global_batches(source, _mesh(), "data", start=meshkit.DataPosition(3))
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.global_batches: start must be a meshkit.DataPosition or None; got "
        r"dict.\nConsider meshkit.checkpoint.data_position\(path\), or the position\(\) of the "
        r"iterator to resume.$",
    ):
        meshkit.global_batches(plain, _mesh(), "data", start={"step": 3})


def test_per_process_states_resume_only_on_as_many_processes_and_what_the_source_accepts():
    require("grain")
    import grain

    def source():
        return grain.MapDataset.range(40).batch(8).to_iter_dataset()

    two = meshkit.DataPosition(
        4, processes=2, states={0: encode_state({"next_index": 4}), 1: encode_state({})}
    )
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.global_batches: start= holds per-process states of a source with "
        r"get_state\(\) \(a grain DataLoader or IterDataset iterator\) from 2 processes; this run "
        r"has 1. Each state is one process's place in its own part of the data, so it resumes "
        r"only on as many processes, with the same layout.\nConsider "
        r"meshkit.loaders.grain_batches or hf_batches, whose position is global and resumes on "
        r"any number of processes; or resuming on 2 processes.$",
    ):
        meshkit.global_batches(source(), _mesh(), "data", start=two)
    other = meshkit.DataPosition(4, processes=1, states={1: encode_state({})})
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.global_batches: start= has no state for process 0 \(it holds processes "
        r"\[1\]\). GlobalBatches.position\(\) holds this process's state only; a position saved "
        r"by meshkit.checkpoint.save\(..., data=...\) every process's.\nConsider "
        r"meshkit.checkpoint.data_position\(path\).$",
    ):
        meshkit.global_batches(source(), _mesh(), "data", start=other)
    refused = meshkit.DataPosition(4, processes=1, states={0: encode_state({"other": 1})})
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.global_batches: PrefetchDatasetIterator.set_state refused the state of "
        r"process 0 saved at step 4: KeyError: .*\nConsider building the source as the saved run "
        r"did \(the same data source, sampler and operations\).$",
    ):
        meshkit.global_batches(source(), _mesh(), "data", start=refused)
