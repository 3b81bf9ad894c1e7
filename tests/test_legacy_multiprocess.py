"""The legacy helpers on 2 processes x 4 CPU devices, one launch for each group of checks.

Functions starting with an underscore run inside the launched processes (each imports this file
again) and return what they saw; the tests assert on every rank's answer.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiprocess


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _entries(x):
    """{global entry index: value as a list} of this process's shards of a device-axis array."""
    import numpy as np

    return {s.index[0].start: np.asarray(s.data)[0].tolist() for s in x.addressable_shards}


def _helpers():
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import meshkit
    from meshkit._src.pmap.legacy import (
        SPEC,
        device_put_replicated,
        device_put_sharded,
        get_metrics,
        pad_shard_unpad,
        prefetch_to_device,
        replicate,
        shard,
        shard_prng_key,
        unreplicate,
    )
    from meshkit._src.pmap.pmap import device_mesh

    me = jax.process_index()
    mine = jax.local_devices()
    out = {}

    # replicate: a global (8, ...) array, this process holding its 4 entries; jit sees all 8.
    r = replicate({"w": np.arange(3, dtype=np.float32)})["w"]
    out["replicate"] = (list(r.shape), r.is_fully_addressable, _entries(r))
    total = jax.jit(lambda a: a.sum(0))(r)
    out["replicate_sum"] = meshkit.gather(total).tolist()

    # unreplicate: each process's first entry (entry 4 * me); for replicated values the value.
    per_process = multihost_utils.host_local_array_to_global_array(
        np.arange(4, dtype=np.float32)[:, None] + 10 * me,
        device_mesh(),
        SPEC,
    )
    first = unreplicate(per_process)
    out["unreplicate"] = (np.asarray(first).tolist(), first.devices() == {mine[0]})
    out["unreplicate_replicated"] = np.asarray(unreplicate(r)).tolist()
    pmapped = jax.pmap(lambda a: a * 2)(np.full((4, 2), me + 1, np.float32))
    out["unreplicate_pmap"] = np.asarray(unreplicate(pmapped)).tolist()

    # shard, then made global: each process shards its own batch, entries assemble globally.
    batch = np.arange(8, dtype=np.int32) + 100 * me
    sharded = shard({"x": batch})["x"]
    g = multihost_utils.host_local_array_to_global_array(sharded, device_mesh(), SPEC)
    out["shard"] = (list(sharded.shape), meshkit.gather(g).tolist())

    # device_put_sharded / device_put_replicated over local devices: process-local arrays.
    local = device_put_sharded([np.full((2,), 10 * me + i) for i in range(4)], mine)
    out["sharded_local"] = (local.is_fully_addressable, np.asarray(local)[:, 0].tolist())
    rep_local = device_put_replicated(np.float32(me), mine)
    out["replicated_local"] = (rep_local.is_fully_addressable, np.asarray(rep_local).tolist())
    # ... and over every device: every process passes all 8 shards, puts its own.
    everywhere = device_put_sharded([np.int32(i) for i in range(8)], jax.devices())
    out["sharded_global"] = (everywhere.is_fully_addressable, _entries(everywhere))

    # shard_prng_key: global (8, 2) keys, each process's entries its own split.
    key = jax.random.fold_in(jax.random.PRNGKey(0), me)
    keys = shard_prng_key(key)
    want = np.asarray(jax.random.split(key, 4))
    got = [_entries(keys)[4 * me + i] for i in range(4)]
    out["keys"] = (list(keys.shape), got == want.tolist())

    # prefetch_to_device: global arrays, this process's entries from its own elements.
    elements = [{"x": np.full((4, 1), 10 * step + me, np.float32)} for step in range(3)]
    placed = [e["x"] for e in prefetch_to_device(iter(elements), 2)]
    out["prefetch"] = [(list(p.shape), meshkit.gather(p)[:, 0].tolist()) for p in placed]

    # pad_shard_unpad: each process pads its own batch (5 rows on process 0, 3 on process 1).
    rows = 5 if me == 0 else 3
    f = pad_shard_unpad(meshkit.pmap_compat(lambda w, x: x * w, in_axes=(None, 0)))
    out["pad"] = f(2.0, np.arange(rows, dtype=np.float32) + 100 * me).tolist()

    # get_metrics: replicated per-step metrics, stacked on every process.
    steps = [replicate({"loss": np.float32(s)}) for s in range(3)]
    out["metrics"] = get_metrics(steps)["loss"].tolist()
    return out


def test_each_helper_works_across_processes(warm_cluster):
    results = warm_cluster.run(_helpers, timeout=240)
    for me, r in enumerate(results):
        shape, addressable, entries = r["replicate"]
        assert shape == [8, 3]
        assert not addressable
        assert entries == {4 * me + i: [0.0, 1.0, 2.0] for i in range(4)}
        assert r["replicate_sum"] == [0.0, 8.0, 16.0]
        assert r["unreplicate"] == ([10.0 * me], True)
        assert r["unreplicate_replicated"] == [0.0, 1.0, 2.0]
        assert r["unreplicate_pmap"] == [2.0 * (me + 1)] * 2
        assert r["shard"] == ([4, 2], [[0, 1], [2, 3], [4, 5], [6, 7],
                                       [100, 101], [102, 103], [104, 105], [106, 107]])  # fmt: skip
        assert r["sharded_local"] == (True, [10 * me + i for i in range(4)])
        assert r["replicated_local"] == (True, [float(me)] * 4)
        assert r["sharded_global"] == (False, {4 * me + i: 4 * me + i for i in range(4)})
        assert r["keys"] == ([8, 2], True)
        assert r["prefetch"] == [([8, 1], [10.0 * s] * 4 + [10.0 * s + 1] * 4) for s in range(3)]
        rows = 5 if me == 0 else 3
        assert r["pad"] == [2.0 * (i + 100 * me) for i in range(rows)]
        assert r["metrics"] == [0.0, 1.0, 2.0]


def _errors():
    import jax
    import numpy as np

    import meshkit
    from meshkit._src.pmap.legacy import device_put_sharded, replicate, unreplicate

    messages = []
    mesh = meshkit.make_mesh({"data": -1})
    split = meshkit.global_array_from_local(np.zeros((4, 2), np.float32), mesh, "data")
    for call in (
        lambda: replicate({"x": split}),
        lambda: device_put_sharded(
            [np.zeros(2)] * 4, jax.devices()[4:] if jax.process_index() == 0 else jax.devices()[:4]
        ),
        lambda: unreplicate(
            meshkit.global_array_from_local(np.zeros((2, 4), np.float32), mesh, "_ data")
        ),
    ):
        try:
            call()
        except meshkit.MeshkitError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


def test_errors_across_processes_name_the_argument_and_the_fix(warm_cluster):
    results = warm_cluster.run(_errors, timeout=120)
    for me, (global_leaf, foreign, row_split) in enumerate(results):
        assert (
            "meshkit.replicate: the leaf at ['x'] is a global jax.Array split across processes "
            "(shape (8, 2)" in global_leaf
        )
        assert "Consider meshkit.gather(x) for its whole value first" in global_leaf
        assert f"devices holds no device of this process ({me})" in foreign
        assert "Consider including jax.local_devices()." in foreign
        assert (
            "meshkit.unreplicate: the first entry of the leaf at (the array) (shape (2, 8)"
            in row_split
        )
        assert "Consider meshkit.gather(x)[0]" in row_split
