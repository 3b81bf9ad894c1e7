"""The legacy helpers (flax.jax_utils, flax.training.common_utils, old jax) in one process.

References are numpy (stacking, reshaping, padding by hand) and, where it still exists,
`jax.pmap`: a device-axis array passes through ``jax.pmap(lambda x: x)`` unchanged and lays its
entries out as pmap does. The multi-process behaviour is in test_legacy_multiprocess.py.
"""

from __future__ import annotations

import re
import traceback
from unittest import mock

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import MeshkitError
from meshkit._src.pmap import legacy as _legacy
from meshkit._src.pmap.legacy import (
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
from meshkit.testing import strategies as mks

N = 8


@st.composite
def trees(draw, *, min_ndim=0, max_ndim=3, lead=None):
    """A dict of 1 to 3 arrays (float32, bfloat16, int32) of small shapes."""
    tree = {}
    for i in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(min_ndim, max_ndim))
        shape = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim))
        if lead is not None:
            shape = [lead, *shape]
        tree[f"a{i}"] = draw(mks.arrays(tuple(shape), draw(st.sampled_from(mks.DTYPES))))
    return tree


def assert_device_axis(y, value_per_entry, devices=None):
    """``y`` is a device-axis array over ``devices``, entry i (on device i) equal to the reference."""
    devices = list(jax.devices()) if devices is None else devices
    assert y.shape[0] == len(devices)
    mesh = device_mesh(devices)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(mesh.axis_names[0])), y.ndim)
    for s in y.addressable_shards:
        i = s.index[0].start or 0
        assert s.device == mesh.devices.flat[i]
        assert s.data.shape == (1, *y.shape[1:])
        np.testing.assert_array_equal(np.asarray(s.data)[0], value_per_entry(i))


# ---- replicate / device_put_replicated ---------------------------------------------------------


@settings(max_examples=30)
@given(tree=trees())
def test_replicate_puts_one_copy_per_device_like_pmap(tree):
    r = replicate(tree)
    through_pmap = jax.pmap(lambda t: t)(r)
    for key, x in tree.items():
        assert r[key].dtype == x.dtype
        assert r[key].shape == (N, *x.shape)
        assert_device_axis(r[key], lambda i, x=x: x)
        # The same layout and value as jax.pmap's own output of it.
        assert r[key].sharding.is_equivalent_to(through_pmap[key].sharding, r[key].ndim)
        np.testing.assert_array_equal(np.asarray(through_pmap[key]), np.stack([x] * N))


def test_replicate_puts_each_device_its_own_block_in_one_batched_call():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    blocks = []
    real = jax.make_array_from_callback

    def spy(shape, sharding, callback):
        def recorded(index):
            out = callback(index)
            blocks.append(out)
            return out

        return real(shape, sharding, recorded)

    with mock.patch.object(jax, "make_array_from_callback", side_effect=spy) as put:
        r = replicate({"x": x, "y": np.float32(2.0)})
    assert put.call_count == 2  # one batched put per leaf
    # Each device gets a (1, ...) block that views x: nothing stacked on the host.
    x_blocks = [b for b in blocks if b.shape == (1, 3, 4)]
    assert len(x_blocks) == N
    assert all(np.shares_memory(b, x) for b in x_blocks)
    assert r["y"].shape == (N,)


def test_replicate_accepts_scalars_device_arrays_and_replicated_global_arrays():
    on_device_3 = jax.device_put(np.arange(3, dtype=np.int32), jax.devices()[3])
    mesh = meshkit.make_mesh({"x": 8})
    replicated = jax.device_put(np.ones((2,), np.float32), NamedSharding(mesh, P()))
    split = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x")))
    r = replicate({"i": 3, "f": 1.5, "b": True, "d3": on_device_3, "rep": replicated, "s": split})
    assert r["i"].dtype == np.int32
    assert r["f"].dtype == np.float32
    assert r["b"].dtype == np.bool_
    assert_device_axis(r["i"], lambda i: 3)
    assert_device_axis(r["f"], lambda i: 1.5)
    assert_device_axis(r["d3"], lambda i: [0, 1, 2])
    assert_device_axis(r["rep"], lambda i: [1.0, 1.0])
    assert_device_axis(r["s"], lambda i: np.arange(8))


def test_replicate_narrows_64_bit_data_as_device_put_does():
    r = replicate(np.arange(3, dtype=np.float64))
    assert r.dtype == jax.device_put(np.arange(3, dtype=np.float64)).dtype == np.float32


def test_replicate_over_chosen_devices_in_any_order():
    chosen = jax.devices()[2:6]
    for order in (chosen, chosen[::-1]):
        r = replicate({"x": np.arange(2.0)}, devices=order)
        assert_device_axis(r["x"], lambda i: [0.0, 1.0], devices=chosen)


def test_device_put_replicated_matches_the_removed_jax_function():
    devices = jax.local_devices()
    x = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": [np.float32(1)]}
    y = device_put_replicated(x, devices)
    assert_device_axis(y["a"], lambda i: x["a"])
    assert_device_axis(y["b"][0], lambda i: 1.0)
    out = jax.pmap(lambda t: t["a"] * 2)(y)
    np.testing.assert_array_equal(np.asarray(out), np.stack([x["a"] * 2] * N))


@pytest.mark.parametrize("fn", [replicate, device_put_replicated])
def test_replicate_device_errors_name_the_argument_rule_and_fix(fn):
    name = fn.__name__
    with pytest.raises(
        MeshkitError,
        match=rf"(?s)meshkit.{name}: devices is empty; the result has one entry per device.*Consider devices=jax.local_devices\(\)",
    ):
        fn(np.ones(2), [])
    d0 = jax.devices()[0]
    with pytest.raises(
        MeshkitError,
        match=rf"(?s)meshkit.{name}: devices must be a sequence of devices; got a single device \({d0}\)\.\nConsider devices=\[{d0}\]",
    ):
        fn(np.ones(2), d0)
    with pytest.raises(
        MeshkitError,
        match=rf"(?s)meshkit.{name}: devices must be a sequence of devices; got int \(3\)",
    ):
        fn(np.ones(2), 3)
    with pytest.raises(
        MeshkitError,
        match=rf"(?s)meshkit.{name}: devices holds str \('cpu:0'\), not a device.\nConsider devices from jax.devices",
    ):
        fn(np.ones(2), ["cpu:0"])
    with pytest.raises(
        MeshkitError,
        match=rf"(?s)meshkit.{name}: devices lists {d0} more than once.*Consider removing the repeats",
    ):
        fn(np.ones(2), [d0, jax.devices()[1], d0])


def test_replicate_refuses_non_numeric_leaves():
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.replicate: the leaf at \['name'\] is of type str \('adam'\), not an array.\n.*Consider keeping strings",
    ):
        replicate({"w": np.ones(2), "name": "adam"})
    with pytest.raises(
        MeshkitError, match=r"(?s)the leaf at \['o'\] is of type array of dtype object"
    ):
        replicate({"o": np.array([None, 1], dtype=object)})


# ---- device_put_sharded ------------------------------------------------------------------------


@settings(max_examples=30)
@given(data=st.data())
def test_device_put_sharded_stacks_shards_one_per_device(data):
    count = data.draw(st.sampled_from([1, 2, 4, 8]))
    template = data.draw(trees())
    shards = [
        {k: data.draw(mks.arrays(v.shape, v.dtype.name)) for k, v in template.items()}
        for _ in range(count)
    ]
    as_jax = data.draw(st.booleans())
    if as_jax:  # single-device arrays on assorted devices travel device to device
        shards = [
            jax.tree.map(lambda a, i=i: jax.device_put(a, jax.devices()[(3 * i) % N]), s)
            for i, s in enumerate(shards)
        ]
    devices = jax.devices()[:count]
    y = device_put_sharded(shards, devices)
    for key in template:
        ref = np.stack([np.asarray(s[key]) for s in shards])
        assert y[key].dtype == ref.dtype
        assert_device_axis(y[key], lambda i, r=ref: r[i], devices=devices)
    if count == N:
        through = jax.pmap(lambda t: t)(y)
        for key in template:
            np.testing.assert_array_equal(
                np.asarray(through[key]), np.stack([np.asarray(s[key]) for s in shards])
            )


def test_device_put_sharded_keeps_shard_order_whatever_the_device_order():
    devices = jax.devices()[::-1]
    y = device_put_sharded([np.full((2,), i, np.int32) for i in range(N)], devices)
    np.testing.assert_array_equal(np.asarray(y)[:, 0], np.arange(N))
    assert [s.device for s in y.addressable_shards] == list(jax.devices())


def test_device_put_sharded_errors():
    devices = jax.devices()
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.device_put_sharded: len\(shards\) == 3, but len\(devices\) == 8; shard i goes to the i-th device.*\nConsider device_put_sharded\(shards, devices\[:3\]\) or passing 8 shards",
    ):
        device_put_sharded([np.ones(2)] * 3, devices)
    shards = [{"x": np.ones((2,), np.float32)} for _ in range(N)]
    shards[5] = {"x": np.ones((3,), np.float32)}
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.device_put_sharded: shards\[5\] at \['x'\] is float32\[3\], but shards\[0\] is float32\[2\]; .*same shape and dtype.\nConsider padding or casting",
    ):
        device_put_sharded(shards, devices)
    shards[5] = {"x": np.ones((2,), np.int32)}
    with pytest.raises(
        MeshkitError,
        match=r"(?s)shards\[5\] at \['x'\] is int32\[2\], but shards\[0\] is float32\[2\]",
    ):
        device_put_sharded(shards, devices)
    shards[5] = {"x": np.ones((2,), np.float32), "y": np.ones(1)}
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.device_put_sharded: shards\[5\] has the pytree structure PyTreeDef\(\{'x': \*, 'y': \*\}\), but shards\[0\] has PyTreeDef\(\{'x': \*\}\)",
    ):
        device_put_sharded(shards, devices)
    jax_shards = [jax.device_put(np.ones((2,), np.float32), d) for d in devices]
    jax_shards[7] = jax.device_put(np.ones((4,), np.float32), devices[7])
    with pytest.raises(
        MeshkitError,
        match=r"(?s)shards\[7\] at \(the array\) is float32\[4\], but shards\[0\] is float32\[2\]",
    ):
        device_put_sharded(jax_shards, devices)
    with pytest.raises(MeshkitError, match=r"(?s)meshkit.device_put_sharded: devices is empty"):
        device_put_sharded([], [])


# ---- unreplicate -------------------------------------------------------------------------------


@settings(max_examples=30)
@given(tree=trees())
def test_unreplicate_inverts_replicate(tree):
    back = unreplicate(replicate(tree))
    for key, x in tree.items():
        assert isinstance(back[key], jax.Array)
        assert back[key].dtype == x.dtype
        assert back[key].shape == x.shape
        assert back[key].devices() == {jax.devices()[0]}
        np.testing.assert_array_equal(np.asarray(back[key]), x)


@settings(max_examples=20)
@given(tree=trees(lead=N))
def test_unreplicate_of_pmap_outputs_is_their_first_entry(tree):
    out = jax.pmap(lambda t: jax.tree.map(lambda a: a * 2, t))(tree)
    first = unreplicate(out)
    for key, x in tree.items():
        np.testing.assert_array_equal(np.asarray(first[key]), x[0] * 2)
        assert first[key].devices() == {jax.devices()[0]}


def test_unreplicate_reads_only_the_first_devices_shard():
    r = replicate({"a": np.ones((64, 64), np.float32), "b": np.arange(3, dtype=np.int32)})
    with mock.patch.object(_legacy, "_firsts", wraps=_legacy._firsts) as firsts:
        back = unreplicate(r)
    firsts.assert_called_once()  # one dispatch for every leaf of the first device
    (given,) = firsts.call_args.args
    assert [a.shape for a in given] == [(1, 64, 64), (1, 3)]
    assert all(a.devices() == {jax.devices()[0]} for a in given)
    np.testing.assert_array_equal(np.asarray(back["b"]), [0, 1, 2])


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_unreplicate_does_not_depend_on_the_device_count(count):
    devices = jax.devices()[:count]
    y = device_put_sharded([np.full((3,), 10 + i, np.float32) for i in range(count)], devices)
    first = unreplicate(y)
    assert first.devices() == {devices[0]}
    np.testing.assert_array_equal(np.asarray(first), [10.0, 10.0, 10.0])


def test_unreplicate_of_other_layouts_and_host_arrays():
    mesh = meshkit.make_mesh({"x": 8})
    ref = np.arange(32, dtype=np.float32).reshape(16, 2)
    two_per_device = jax.device_put(ref, NamedSharding(mesh, P("x")))
    split_rows = jax.device_put(ref.reshape(2, 16), NamedSharding(mesh, P(None, "x")))
    whole = jax.device_put(ref, NamedSharding(mesh, P()))
    single = jax.device_put(ref, jax.devices()[5])
    grid = meshkit.make_mesh({"a": 2, "b": 4})
    on_grid = jax.device_put(ref, NamedSharding(grid, P("b")))
    out = unreplicate(
        {"two": two_per_device, "rows": split_rows, "whole": whole, "one": single, "np": ref,
         "grid": on_grid}
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out["grid"]), ref[0])
    np.testing.assert_array_equal(np.asarray(out["two"]), ref[0])
    np.testing.assert_array_equal(np.asarray(out["rows"]), ref.reshape(2, 16)[0])
    np.testing.assert_array_equal(np.asarray(out["whole"]), ref[0])
    np.testing.assert_array_equal(np.asarray(out["one"]), ref[0])
    assert out["one"].devices() == {jax.devices()[5]}
    assert isinstance(out["np"], np.ndarray)
    assert np.shares_memory(out["np"], ref)


def test_unreplicate_of_typed_keys_gives_one_key():
    keys = shard_prng_key(jax.random.key(3))
    k = unreplicate(keys)
    assert k.shape == ()
    assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
        jax.random.key_data(k), jax.random.key_data(jax.random.split(jax.random.key(3), N)[0])
    )


def test_unreplicate_errors():
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.unreplicate: the leaf at \['step'\] has shape \(\), so it has no leading \(device\) axis.*\nConsider replicated values only",
    ):
        unreplicate({"w": np.ones((N, 2)), "step": 3})
    with pytest.raises(
        MeshkitError, match=r"(?s)meshkit.unreplicate: the leaf at \['s'\] has shape \(\)"
    ):
        unreplicate({"s": jax.numpy.float32(1)})
    with pytest.raises(
        MeshkitError, match=r"(?s)meshkit.unreplicate: the leaf at \['name'\] is of type str"
    ):
        unreplicate({"name": "abc"})


# ---- shard -------------------------------------------------------------------------------------


@settings(max_examples=40)
@given(tree=trees(max_ndim=2), per_device=st.integers(1, 3))
def test_shard_reshapes_like_numpy(tree, per_device):
    batch = {k: np.concatenate([v[None]] * (N * per_device)) for k, v in tree.items()}
    out = shard(batch)
    for key, x in batch.items():
        assert isinstance(out[key], np.ndarray)
        np.testing.assert_array_equal(out[key], x.reshape(N, per_device, *x.shape[1:]))
        assert np.shares_memory(out[key], x)  # a view: nothing copied


def test_shard_keeps_jax_arrays_as_jax_arrays_and_feeds_pmap():
    x = jax.numpy.arange(16.0).reshape(16, 1)
    out = shard({"x": x, "y": np.arange(16)})
    assert isinstance(out["x"], jax.Array)
    assert out["x"].shape == (8, 2, 1)
    summed = jax.pmap(lambda t: t["x"].sum() + t["y"].sum())(out)
    np.testing.assert_array_equal(np.asarray(summed), np.arange(16).reshape(8, 2).sum(1) * 2)


def test_shard_errors():
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.shard: the leaf at \['x'\] has shape \(10, 3\); its leading \(batch\) dimension of size 10 does not split over this process's 8 local devices \(shard reshapes it to \(8, 10 // 8, \.\.\.\)\).\nConsider a batch size divisible by 8, meshkit.pad_shard_unpad",
    ):
        shard({"x": np.ones((10, 3))})
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.shard: the leaf at \['lr'\] is a scalar \(shape \(\)\); .*\nConsider meshkit.replicate",
    ):
        shard({"x": np.ones((8, 3)), "lr": 0.1})


# ---- shard_prng_key ----------------------------------------------------------------------------


@pytest.mark.parametrize("make", [jax.random.PRNGKey, jax.random.key], ids=["raw", "typed"])
def test_shard_prng_key_splits_like_flax_and_places_one_key_per_device(make):
    key = make(7)
    keys = shard_prng_key(key)
    want = jax.random.split(key, N)
    assert keys.dtype == want.dtype
    assert keys.shape == want.shape
    mesh = device_mesh()
    assert keys.sharding.is_equivalent_to(NamedSharding(mesh, P(mesh.axis_names[0])), keys.ndim)
    raw = (
        jax.random.key_data
        if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
        else np.asarray
    )
    for s in keys.addressable_shards:
        i = s.index[0].start
        assert s.device == jax.devices()[i]
        assert s.data.shape == (1, *want.shape[1:])
        np.testing.assert_array_equal(np.asarray(raw(s.data))[0], np.asarray(raw(want))[i])
    # pmap uses each device's own key, as with flax's keys.
    draws = jax.pmap(lambda k: jax.random.uniform(k, (2,)))(keys)
    np.testing.assert_array_equal(
        np.asarray(draws), np.stack([jax.random.uniform(k, (2,)) for k in want])
    )


def test_shard_prng_key_accepts_a_host_raw_key():
    keys = shard_prng_key(np.asarray(jax.random.PRNGKey(1)))
    np.testing.assert_array_equal(
        np.asarray(keys), np.asarray(jax.random.split(jax.random.PRNGKey(1), N))
    )


def test_shard_prng_key_errors():
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.shard_prng_key: prng_key is an array of 4 typed keys \(shape \(4,\)\); it splits one key into one per device.\nConsider prng_key\[0\]",
    ):
        shard_prng_key(jax.random.split(jax.random.key(0), 4))
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.shard_prng_key: prng_key has dtype uint32 and shape \(4, 2\); a key is a typed key .*\nConsider jax.random.key\(seed\), or prng_key\[0\]",
    ):
        shard_prng_key(jax.random.split(jax.random.PRNGKey(0), 4))
    with pytest.raises(MeshkitError, match=r"(?s)prng_key has dtype float32 and shape \(2,\)"):
        shard_prng_key(np.zeros(2, np.float32))


# ---- prefetch_to_device ------------------------------------------------------------------------


class Counting:
    """An iterator of sharded batches that counts how many were taken from it."""

    def __init__(self, count, fail_at=None):
        self.taken, self.count, self.fail_at = 0, count, fail_at

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken == self.fail_at:
            raise KeyError("shard-00017 is missing")
        if self.taken == self.count:
            raise StopIteration
        self.taken += 1
        return {"x": np.full((N, 2), self.taken - 1, np.float32), "n": [np.arange(N)]}


@pytest.mark.parametrize("size", [0, 1, 2, 5])
def test_prefetch_to_device_places_elements_and_stays_bounded(size):
    source = Counting(6)
    seen = []
    for k, element in enumerate(prefetch_to_device(source, size), start=1):
        # The one handed out plus at most `size` ahead have been taken.
        assert source.taken == min(k + size, 6)
        assert_device_axis(element["x"], lambda i, k=k: [k - 1, k - 1])
        assert_device_axis(element["n"][0], lambda i: i)
        seen.append(int(np.asarray(element["x"])[0, 0]))
    assert seen == list(range(6))


def test_prefetch_to_device_over_chosen_devices():
    devices = jax.devices()[4:]
    elements = [np.full((4, 3), k, np.float32) for k in range(2)]
    out = list(prefetch_to_device(iter(elements), 1, devices))
    assert len(out) == 2
    for k, element in enumerate(out):  # each element, in order, on the devices chosen
        assert_device_axis(element, lambda i, k=k: [float(k)] * 3, devices=devices)


def test_prefetch_to_device_delivers_earlier_elements_then_the_iterators_error():
    it = prefetch_to_device(Counting(10, fail_at=3), 2)
    got = [int(np.asarray(next(it)["x"])[0, 0]) for _ in range(3)]
    assert got == [0, 1, 2]
    with pytest.raises(KeyError, match="shard-00017 is missing") as info:
        next(it)
    assert "in __next__" in "".join(traceback.format_exception(info.value))


def test_prefetch_to_device_errors():
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.prefetch_to_device: size=-1; size is how many elements are placed ahead of the one in use, an int >= 0.\nConsider size=2",
    ):
        prefetch_to_device(iter([]), -1)
    with pytest.raises(MeshkitError, match=r"(?s)size=2.5"):
        prefetch_to_device(iter([]), 2.5)
    with pytest.raises(MeshkitError, match=r"(?s)meshkit.prefetch_to_device: devices is empty"):
        prefetch_to_device(iter([]), 2, [])
    bad = prefetch_to_device(iter([{"x": np.ones((8, 2))}, {"x": np.ones((16, 2))}]), 0)
    next(bad)
    shown = re.escape(", ".join(str(d) for d in jax.devices()[:4]) + ", ...")
    with pytest.raises(
        MeshkitError,
        match=rf"(?s)meshkit.prefetch_to_device: the leaf at \['x'\] of element 1 has shape \(16, 2\); its leading dimension must have one entry per local device \(8: {shown}\).\nConsider meshkit.shard\(batch\) on each element first",
    ):
        next(bad)


# ---- pad_shard_unpad ---------------------------------------------------------------------------


@settings(max_examples=25)
@given(b=st.integers(1, 20), features=st.integers(1, 3), min_batch=st.sampled_from([None, 1, 4]))
def test_pad_shard_unpad_matches_the_unpadded_computation(b, features, min_batch):
    x = np.arange(b * features, dtype=np.float32).reshape(b, features)
    labels = np.arange(b, dtype=np.int32)
    seen = []

    @jax.pmap
    def per_device(batch):
        return {"y": batch["x"] * 2 + batch["labels"][:, None], "n": batch["labels"] * 0 + 1}

    def wrapped(w, batch):
        seen.append(jax.tree.map(np.shape, batch))
        out = per_device(batch)
        return jax.tree.map(lambda a: a * w, out)

    out = pad_shard_unpad(wrapped)(3, {"x": x, "labels": labels}, min_device_batch=min_batch)
    per = max(-(-b // N), min_batch or 0)
    assert seen == [{"x": (N, per, features), "labels": (N, per)}]
    assert isinstance(out["y"], np.ndarray)
    np.testing.assert_array_equal(out["y"], (x * 2 + labels[:, None]) * 3)
    np.testing.assert_array_equal(out["n"], np.full(b, 3))


def test_pad_shard_unpad_pads_with_zeros_and_honours_static_arguments():
    calls = []

    def wrapped(scale, x, *, mask, note):
        calls.append((scale, x.copy(), mask.copy(), note))
        return x * scale

    f = pad_shard_unpad(wrapped, static_argnums=(-2,), static_argnames="note")
    out = f(2.0, np.arange(1, 11, dtype=np.float32), mask=np.ones(10, bool), note="eval")
    scale, x, mask, note = calls[0]
    assert (scale, note) == (2.0, "eval")
    assert x.shape == (8, 2)
    assert mask.shape == (8, 2)
    np.testing.assert_array_equal(x.reshape(-1)[10:], np.zeros(6))
    np.testing.assert_array_equal(mask.reshape(-1), [True] * 10 + [False] * 6)
    np.testing.assert_array_equal(out, np.arange(1, 11) * 2.0)
    raw = pad_shard_unpad(lambda x: x, static_argnums=(), static_return=True)(np.ones(3))
    assert raw.shape == (8, 1)


def test_pad_shard_unpad_errors():
    f = pad_shard_unpad(lambda p, x, y: x)
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.pad_shard_unpad: the batched arguments of <lambda> have different batch \(leading\) sizes:\n  args\[1\]\['a'\]: 4\n  args\[1\]\['b'\]: 5\n  args\[2\]: 4\n.*\nConsider static_argnums= / static_argnames= for arguments that are not batched",
    ):
        f(None, {"a": np.ones(4), "b": np.ones(5)}, np.ones(4))
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.pad_shard_unpad: args\[2\] is a scalar, but arguments that are not static are batches.*\nConsider static_argnums=",
    ):
        f(None, np.ones(4), 0.5)
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.pad_shard_unpad: <lambda> got no batched argument \(all are static: static_argnums=\(0,\), static_argnames=\[\]\)",
    ):
        pad_shard_unpad(lambda p: p)(1)
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.pad_shard_unpad: the output at \['loss'\] has shape \(8,\); outputs are unsharded from \(devices, per-device batch, ...\).*\nConsider static_return=True",
    ):
        pad_shard_unpad(lambda x: {"loss": x.sum(1)}, static_argnums=())(np.ones(8))


# ---- get_metrics -------------------------------------------------------------------------------


@settings(max_examples=20)
@given(steps=st.integers(1, 4), tree=trees(max_ndim=1))
def test_get_metrics_stacks_unreplicated_steps_on_the_host(steps, tree):
    per_step = [jax.tree.map(lambda a, s=s: a + s, tree) for s in range(steps)]
    out = get_metrics([replicate(m) for m in per_step])
    for key, x in tree.items():
        assert isinstance(out[key], np.ndarray)
        assert out[key].dtype == x.dtype
        np.testing.assert_array_equal(out[key], np.stack([m[key] for m in per_step]))


def test_get_metrics_of_pmap_step_outputs():
    step = jax.pmap(lambda x: {"loss": jax.lax.pmean(x.sum(), "i"), "acc": x[0]}, axis_name="i")
    batches = [np.arange(16, dtype=np.float32).reshape(8, 2) + s for s in range(3)]
    out = get_metrics([step(b) for b in batches])
    np.testing.assert_allclose(out["loss"], [b.sum() / 8 for b in batches])
    np.testing.assert_array_equal(out["acc"], [b[0, 0] for b in batches])


def test_get_metrics_errors():
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.get_metrics: device_metrics is empty; it stacks one pytree per step.\nConsider",
    ):
        get_metrics([])
    a = replicate({"loss": np.float32(1)})
    b = replicate({"loss": np.float32(1), "acc": np.float32(0)})
    with pytest.raises(
        MeshkitError,
        match=r"(?s)meshkit.get_metrics: device_metrics\[1\] has the pytree structure PyTreeDef\(\{'acc': \*, 'loss': \*\}\), but device_metrics\[0\] has PyTreeDef\(\{'loss': \*\}\).*\nConsider returning the same metrics",
    ):
        get_metrics([a, b])
    with pytest.raises(
        MeshkitError, match=r"(?s)meshkit.get_metrics: the leaf at \['lr'\] has shape \(\)"
    ):
        get_metrics([{"lr": 0.1}])


# ---- with pmap_compat --------------------------------------------------------------------------


def test_legacy_outputs_feed_pmap_compat_without_copies():
    params = replicate({"w": np.full((3,), 2.0, np.float32)})
    batch = shard({"x": np.arange(48, dtype=np.float32).reshape(16, 3)})
    step = meshkit.pmap_compat(lambda p, b: (b["x"] * p["w"]).sum(), axis_name="batch")
    losses = step(params, batch)
    np.testing.assert_allclose(
        np.asarray(losses), (np.arange(48).reshape(8, 2, 3) * 2.0).sum((1, 2))
    )
    placed = jax.pmap(lambda x: x)(batch["x"])
    copied = AssertionError("copied")
    with (
        mock.patch.object(jax, "device_put", side_effect=copied),
        mock.patch.object(jax, "make_array_from_callback", side_effect=copied),
    ):
        again = step(params, {"x": placed})
    np.testing.assert_allclose(np.asarray(again), np.asarray(losses))
    np.testing.assert_allclose(float(unreplicate(losses)), float(np.asarray(losses)[0]))
