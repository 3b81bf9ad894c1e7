"""meshkit.checkpoint's data position in one process (8 CPU devices): save(data=), data_position.

The position saved is the iterator's after the steps its caller took, inside orbax's commit;
read back without arrays, it resumes the data at the next global batch. Every bad input is a
`MeshkitError` before anything is written. Two processes, and resuming on 1, 2 and 4, are in
tests/test_data_position_multiprocess.py.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from conftest import require

import meshkit
from meshkit import MeshkitError, loaders
from meshkit._src.core.data_position import encode_state

pytestmark = pytest.mark.filterwarnings("ignore::meshkit.DtypeWarning")  # int64 ids -> int32


@pytest.fixture(autouse=True)
def _orbax():
    require("orbax.checkpoint", "orbax")


def _mesh():
    return meshkit.make_mesh({"data": -1})


def _loader(seed=7, epochs=2):
    require("grain")
    import grain

    part = meshkit.process_slice(_mesh(), "data", (16,))
    return loaders.grain_batches(grain.MapDataset.range(45), part, seed=seed, epochs=epochs)


def _rows(batches, stop=None):
    out = []
    for batch, mask in batches:
        out.append(np.asarray(batch)[np.asarray(mask)].tolist())
        if len(out) == stop:
            break
    return out


def test_a_checkpoint_resumes_the_data_at_the_next_global_batch(tmp_path):
    full = _rows(meshkit.global_batches(_loader(), _mesh(), "data", pad="ragged"))
    batches = meshkit.global_batches(_loader(), _mesh(), "data", pad="ragged", prefetch=3)
    head = _rows(batches, stop=2)
    meshkit.checkpoint.save(tmp_path / "step_2", {"step": 2}, data=batches)
    batches.close()
    position = meshkit.checkpoint.data_position(tmp_path / "step_2")
    assert position == batches.position()
    assert (position.step, position.epoch, position.epoch_step) == (2, 0, 2)
    # The arrays restore as before; the position is metadata beside them.
    assert meshkit.checkpoint.restore(tmp_path / "step_2", _mesh()) == {"step": 2}
    resumed = meshkit.global_batches(_loader(), _mesh(), "data", pad="ragged", start=position)
    assert head + _rows(resumed) == full
    assert resumed.steps == len(full)
    # The position is in orbax's step metadata, under "meshkit", as JSON values.
    saved = json.loads((tmp_path / "step_2" / "_CHECKPOINT_METADATA").read_text())
    assert saved["custom_metadata"]["meshkit"]["data_position"] == position.to_dict()


def test_a_grain_iterators_state_is_saved_and_resumed(tmp_path):
    require("grain")
    import grain

    def source():
        return grain.MapDataset.range(64).batch(8).to_iter_dataset()

    batches = meshkit.global_batches(source(), _mesh(), "data", prefetch=4)
    next(batches)
    next(batches)
    meshkit.checkpoint.save(tmp_path / "c", {"w": np.ones(3, np.float32)}, data=batches)
    batches.close()
    position = meshkit.checkpoint.data_position(tmp_path / "c")
    assert position.states == {0: encode_state({"next_index": 2})}  # not the 4 read ahead
    resumed = meshkit.global_batches(source(), _mesh(), "data", start=position)
    assert [int(np.asarray(b)[0]) for b in resumed] == [16, 24, 32, 40, 48, 56]


def test_a_position_alone_is_saved_too(tmp_path):
    position = meshkit.DataPosition(5)
    meshkit.checkpoint.save(tmp_path / "c", {"step": 5}, data=position)
    assert meshkit.checkpoint.data_position(tmp_path / "c") == position


def test_a_checkpoint_without_data_position(tmp_path):
    meshkit.checkpoint.save(tmp_path / "c", {"step": 1})
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.data_position: the checkpoint at .*/c was saved without a "
        r"data position \(no data= given to meshkit.checkpoint.save\), so nothing says which "
        r"batch comes next.\nConsider meshkit.checkpoint.save\(path, tree, data=batches\) with "
        r"the meshkit.global_batches iterator that fed the step; for this checkpoint, "
        r"data_position\(path, missing_ok=True\) gives None, and start=None starts the data "
        r"from its beginning.$",
    ):
        meshkit.checkpoint.data_position(tmp_path / "c")
    assert meshkit.checkpoint.data_position(tmp_path / "c", missing_ok=True) is None


def test_no_checkpoint_at_all(tmp_path):
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.data_position: there is no checkpoint at .*/none.\n"
        r"Consider the path given to save",
    ):
        meshkit.checkpoint.data_position(tmp_path / "none")
    (tmp_path / "c.orbax-checkpoint-tmp-1").mkdir()
    with pytest.raises(MeshkitError, match=r"is a checkpoint that was never completed"):
        meshkit.checkpoint.data_position(tmp_path / "c.orbax-checkpoint-tmp-1")
    with pytest.raises(MeshkitError, match=r"only 'c.orbax-checkpoint-tmp-1' is there"):
        meshkit.checkpoint.data_position(tmp_path / "c")
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.data_position: missing_ok must be True or False; got 1.$",
    ):
        meshkit.checkpoint.data_position(tmp_path / "c", missing_ok=1)


def test_a_position_of_a_newer_format_is_refused(tmp_path):
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    newer = {"meshkit": {"data_position": {"version": 9, "step": 1}}}
    checkpointer.save(tmp_path / "c", {"step": 1}, custom_metadata=newer)
    checkpointer.wait_until_finished()
    checkpointer.close()
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.data_position: the data position is of format version 9; "
        r"this meshkit reads versions up to 1.\nConsider the meshkit version that saved it, or "
        r"a newer one.$",
    ):
        meshkit.checkpoint.data_position(tmp_path / "c")


class _Unsavable:
    def __iter__(self):
        return self

    def __next__(self):
        return np.zeros(8, np.float32)

    def get_state(self):
        return object()

    def set_state(self, state):
        raise AssertionError("not called")


def test_bad_data_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.save: data must be a meshkit.GlobalBatches \(its position\(\) "
        r"is saved\) or a meshkit.DataPosition; got list.\nConsider data=batches, the "
        r"meshkit.global_batches iterator that fed this step.$",
    ):
        meshkit.checkpoint.save(tmp_path / "a", {"step": 1}, data=[1, 2])
    batches = meshkit.global_batches(_Unsavable(), _mesh(), "data")
    next(batches)
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.save: data='s source keeps a state of type object \(its "
        r"get_state\(\)\), which is neither bytes nor JSON values: it cannot go into a "
        r"checkpoint's metadata.\nConsider a source whose get_state\(\) gives bytes or JSON "
        r"values \(a grain DataLoader or IterDataset iterator\), or "
        r"meshkit.loaders.grain_batches / hf_batches.$",
    ):
        meshkit.checkpoint.save(tmp_path / "b", {"step": 1}, data=batches)
    batches.close()
    others = meshkit.DataPosition(1, processes=2, states={1: encode_state(b"")})
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.checkpoint.save: data= holds per-process states of processes \[1\], "
        r"none of this process \(0\).\nConsider data=batches, the iterator itself.$",
    ):
        meshkit.checkpoint.save(tmp_path / "c", {"step": 1}, data=others)
    assert not list(tmp_path.iterdir())


def test_saving_the_position_costs_under_a_millisecond_and_a_kibibyte(tmp_path):
    """The issue's budget, in one process: the position's own work and bytes in the save."""
    require("grain")
    import grain

    source = [{"id": np.int32(i)} for i in range(64)]
    part = meshkit.process_slice(_mesh(), "data", (8,))
    loader = grain.DataLoader(
        data_source=source,
        sampler=loaders.grain_sampler(len(source), part, shuffle=True, seed=1),
        shard_options=grain.sharding.NoSharding(),
        operations=[grain.transforms.Batch(8)],
    )
    batches = meshkit.global_batches(loader, _mesh(), "data")
    next(batches)
    from meshkit._src.checkpoint import data as _data

    # What save adds: the position, its checks and entry, the metadata (one process: nothing
    # is sent), timed over many calls in this thread's CPU time (the suite's other workers
    # share the cores: wall time here says how busy they are; the bench times the wall).
    calls = 200
    started = time.thread_time()
    for _ in range(calls):
        shared = _data.share(batches, tmp_path, "save")
        _ = shared.entry
        _ = shared.metadata()
    assert (time.thread_time() - started) / calls < 1e-3
    size = len(json.dumps(shared.metadata()["custom_metadata"]))
    assert size < 1024, size
    batches.close()
