"""pmap_compat in one process with 8 CPU devices: differential tests and errors.

The reference is `jax.vmap` with the same ``axis_name`` (collectives work under vmap), which
computes on one device what pmap computes across devices; where `jax.pmap` still gives the
documented answer (non-negative axes) it is compared too.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pmap_cases  # tests/pmap_cases.py (pytest puts tests/ on sys.path), shared with 2 processes
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import MeshkitError
from meshkit._src.pmap.pmap import device_mesh, pmap_compat
from meshkit._src.runtime import dispatch as _dispatch
from meshkit.testing import strategies as mks

N = 8

# Per-device operations: (name, function of (x, axis name)); all keep the block's shape.
OPS = {
    "scale": lambda x, a: x * 2,
    "shift": lambda x, a: x + 1,
    "psum": lambda x, a: jax.lax.psum(x, a),
    "pmax": lambda x, a: jax.lax.pmax(x, a),
    "index": lambda x, a: x * jax.lax.axis_index(a).astype(x.dtype),
    "centre": lambda x, a: x - jax.lax.pmin(x, a),
}
# Operations whose result is the same on every device (so out_axes=None is allowed).
INVARIANT = {"psum", "pmax"}


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    """Arguments with in_axes (negative and None included), ops and out_axes per output."""
    n_args = draw(st.integers(1, 3))
    args, in_axes, ops, out_axes = [], [], [], []
    for _ in range(n_args):
        rank = draw(st.integers(0, 2))  # per-device rank
        shape = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
        dtype = draw(st.sampled_from(mks.DTYPES))
        mapped = draw(st.booleans()) or not args
        if mapped:
            axis = draw(st.integers(-(rank + 1), rank))
            full = list(shape)
            full.insert(axis % (rank + 1), N)
            in_axes.append(axis)
        else:
            full = list(shape)
            in_axes.append(None)
        args.append(draw(mks.arrays(tuple(full), dtype)))
        op = draw(st.sampled_from(sorted(OPS)))
        ops.append(op)
        choices = list(range(-(rank + 1), rank + 1))
        if op in INVARIANT or (not mapped and op in {"scale", "shift"}):
            choices.append(None)
        out_axes.append(draw(st.sampled_from(choices)))
    return {"args": args, "in_axes": tuple(in_axes), "ops": ops, "out_axes": tuple(out_axes)}


def _fn(ops: list[str]) -> Any:
    def f(*xs: Any) -> Any:
        return tuple(OPS[op](x, "i") for op, x in zip(ops, xs, strict=True))

    return f


@settings(max_examples=40)
@given(case=cases())
def test_matches_vmap_with_the_same_axis_name(case):
    f = _fn(case["ops"])
    ours = pmap_compat(f, "i", in_axes=case["in_axes"], out_axes=case["out_axes"])(*case["args"])
    ref = jax.vmap(
        f, in_axes=case["in_axes"], out_axes=case["out_axes"], axis_name="i", axis_size=N
    )(*case["args"])
    for got, want in zip(ours, ref, strict=True):
        assert got.shape == want.shape
        assert got.dtype == want.dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-2
        )


@settings(max_examples=20)
@given(case=cases())
def test_matches_jax_pmap_where_its_answer_is_documented(case):
    in_axes = tuple(a if a is None or a >= 0 else None for a in case["in_axes"])
    if all(a is None for a in in_axes):
        return
    args = [
        x if a is None or a >= 0 else np.moveaxis(x, a, 0)
        for x, a in zip(case["args"], case["in_axes"], strict=True)
    ]
    in_axes = tuple(
        (0 if b is not None and b < 0 else b) for b in case["in_axes"]
    )  # negative ones moved to 0
    out_axes = tuple(0 if a is None or a < 0 else a for a in case["out_axes"])
    f = _fn(case["ops"])
    ours = pmap_compat(f, "i", in_axes=in_axes, out_axes=out_axes)(*args)
    theirs = jax.pmap(f, "i", in_axes=in_axes, out_axes=out_axes)(*args)
    for got, want in zip(ours, theirs, strict=True):
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_outputs_are_pmap_shaped_global_arrays_and_feed_back_without_copies():
    f = pmap_compat(lambda x: x * 2, axis_name="batch")
    x = np.arange(16, dtype=np.float32).reshape(N, 2)
    y = f(x)
    assert y.shape == (N, 2)
    assert y.sharding.spec == P("batch")
    assert [s.device for s in y.addressable_shards] == list(device_mesh().devices)
    np.testing.assert_array_equal(np.asarray(y[3]), x[3] * 2)
    z = f(y)
    for a, b in zip(y.addressable_shards, z.addressable_shards, strict=True):
        assert a.device == b.device
    np.testing.assert_array_equal(np.asarray(z), x * 4)


def test_negative_out_axes_put_the_device_axis_last():
    x = np.arange(16, dtype=np.float32).reshape(N, 2)
    out = pmap_compat(lambda v: v, "i", out_axes=-1)(x)
    assert out.shape == (2, N)
    np.testing.assert_array_equal(np.asarray(out), x.T)


def test_out_axes_none_accepts_a_reduced_value():
    x = np.arange(N, dtype=np.float32)
    out = pmap_compat(lambda v: jax.lax.psum(v, "i"), "i", out_axes=None)(x)
    assert out.shape == ()
    assert float(out) == x.sum()


def test_out_axes_none_on_a_varying_value_is_refused():
    x = np.arange(N, dtype=np.float32)
    with pytest.raises(MeshkitError) as e:
        pmap_compat(lambda v: v * 2, "i", out_axes=None)(x)
    assert str(e.value) == (
        "meshkit.pmap_compat(<lambda>): out_axes=None for output (shape ()) promises the same "
        "value on every device, but it varies over the mapped axis 'i': it depends on a mapped "
        "argument or the device index.\njax.pmap would have returned device 0's value without a word. Consider "
        "reducing it first (jax.lax.pmean(x, 'i') or psum), or out_axes=0 to get every device's "
        "value."
    )


def test_keyword_arguments_are_mapped_on_axis_0():
    x = np.ones((N, 3), np.float32)
    out = pmap_compat(lambda a, b: a + b)(x, b=2 * x)
    np.testing.assert_array_equal(np.asarray(out), 3 * x)


def test_static_broadcasted_arguments_are_compiled_in():
    traces = []

    def f(x, power):
        traces.append(power)
        return x**power

    g = pmap_compat(f, static_broadcasted_argnums=1)
    x = np.full((N, 2), 2.0, np.float32)
    assert float(g(x, 3)[0, 0]) == 8.0
    assert float(g(x, 3)[0, 0]) == 8.0
    assert float(g(x, 2)[0, 0]) == 4.0
    assert traces == [3, 2]


def test_in_axes_none_broadcasts():
    x = np.arange(16, dtype=np.float32).reshape(N, 2)
    w = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    out = pmap_compat(lambda a, b: a @ b, in_axes=(0, None))(x, w)
    np.testing.assert_allclose(np.asarray(out), x @ w)


def test_fewer_entries_than_devices_use_the_first_devices():
    out = pmap_compat(lambda v: v + jax.lax.psum(1, "i"), "i")(np.zeros((4, 2), np.float32))
    assert out.shape == (4, 2)
    np.testing.assert_array_equal(np.asarray(out), np.full((4, 2), 4.0))
    assert [s.device for s in out.addressable_shards] == jax.devices()[:4]


def test_axis_size_when_nothing_is_mapped():
    f = pmap_compat(lambda: jax.lax.axis_index("i"), "i", axis_size=4, in_axes=())
    np.testing.assert_array_equal(np.asarray(f()), np.arange(4))


def test_the_steady_state_shortcut_falls_back_when_arguments_change():
    f = pmap_compat(lambda x: x + jax.lax.psum(1, "i"), "i")
    x = np.zeros((N, 2), np.float32)
    np.testing.assert_array_equal(np.asarray(f(x)), np.full((N, 2), N))
    assert f._steady  # the shortcut is armed after the first call
    y = f(f(x))  # earlier outputs go straight to jit
    np.testing.assert_array_equal(np.asarray(y), np.full((N, 2), 2 * N))
    fewer = f(np.zeros((4, 2), np.float32))  # jit refuses; the general path picks 4 devices
    np.testing.assert_array_equal(np.asarray(fewer), np.full((4, 2), 4))
    one_device = f(jax.device_put(x, jax.devices()[2]))
    np.testing.assert_array_equal(np.asarray(one_device), np.full((N, 2), N))
    with pytest.raises(MeshkitError, match="the mapped axis has size 9"):
        f(np.zeros((9, 2), np.float32))


def test_decorator_and_partial():
    @functools.partial(pmap_compat, axis_name="b")
    def mean(x):
        return jax.lax.pmean(x, "b")

    @pmap_compat
    def double(x):
        return 2 * x

    x = np.arange(N, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(mean(x)), np.full(N, x.mean()))
    np.testing.assert_array_equal(np.asarray(double(x)), 2 * x)
    assert mean.__wrapped__.__name__ == "mean"


def test_grad_of_pmap_and_pmap_of_grad():
    x = np.arange(16, dtype=np.float32).reshape(N, 2)
    inner = pmap_compat(lambda w: jnp.sum(w**2), "i")
    g = jax.grad(lambda w: inner(w).sum())(x)
    np.testing.assert_allclose(np.asarray(g), 2 * x)
    h = pmap_compat(jax.grad(lambda w: jnp.sum(w**2)))(x)
    np.testing.assert_allclose(np.asarray(h), 2 * x)


@pytest.mark.parametrize("make_keys", [jax.random.PRNGKey, jax.random.key], ids=["raw", "typed"])
def test_rng_keys_per_device(make_keys):
    keys = jax.random.split(make_keys(0), N)
    draw = lambda k: jax.random.normal(k, (3,))  # noqa: E731
    ours = pmap_compat(draw)(keys)
    # vmap's batched sampler may round differently in the last bit.
    np.testing.assert_allclose(np.asarray(ours), np.asarray(jax.vmap(draw)(keys)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(jax.pmap(draw)(keys)))


def test_axis_size_and_axis_index_groups_inside():
    x = np.arange(N, dtype=np.float32)
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]

    def f(v):
        return jax.lax.psum(v, "i", axis_index_groups=groups) * jax.lax.axis_size("i")

    ours = pmap_compat(f, "i")(x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(jax.pmap(f, "i")(x)))
    np.testing.assert_array_equal(np.asarray(ours), np.repeat([6.0, 22.0], 4) * N)


def test_nested_pmap_compat_runs_vectorized_on_each_outer_device():
    def inner_fn(v):
        return v * 10 + jax.lax.psum(v, "inner") + jax.lax.pmax(v, "outer")

    inner = pmap_compat(inner_fn, "inner")
    outer = pmap_compat(lambda x: inner(x) + jax.lax.axis_index("outer"), "outer")
    x = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    ref = jax.vmap(
        lambda x: jax.vmap(inner_fn, axis_name="inner")(x) + jax.lax.axis_index("outer"),
        axis_name="outer",
    )(x)
    for _ in range(2):  # the second call reuses the entry
        out = outer(x)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref))
    assert dict(out.sharding.mesh.shape) == {"outer": 2}
    both = pmap_compat(pmap_compat(lambda v: jax.lax.psum(v, ("o", "n")), "n"), "o")
    np.testing.assert_allclose(np.asarray(both(x)), np.broadcast_to(x.sum((0, 1)), x.shape))


def test_nested_pmap_compat_errors():
    same = pmap_compat(pmap_compat(lambda v: v, "i"), "i")
    with pytest.raises(MeshkitError, match="nested pmaps need different axis names"):
        same(np.ones((2, 4), np.float32))
    # The inner axis needs no devices of its own: 4 x 4 entries run on 4 devices.
    big = pmap_compat(pmap_compat(lambda v: jax.lax.psum(v, ("o", "n")), "n"), "o")
    np.testing.assert_array_equal(np.asarray(big(np.ones((4, 4), np.float32))), np.full((4, 4), 16))
    with pytest.raises(MeshkitError, match="the mapped axis has size 9, which requires 9 devices"):
        big(np.ones((9, 4), np.float32))


def test_donated_arguments_are_consumed():
    f = pmap_compat(lambda x: x * 2)
    g = pmap_compat(lambda x: x + 1, donate_argnums=0)
    y = f(np.ones((N, 4), np.float32))
    z = g(y)
    assert y.is_deleted()
    np.testing.assert_array_equal(np.asarray(z), np.full((N, 4), 3.0))


@pytest.mark.parametrize("case", sorted(pmap_cases.CASES))
def test_legacy_code_sees_what_jax_pmap_gives(case):
    """Each differential case (tests/pmap_cases.py): jax.pmap's observations, equal."""
    fn = pmap_cases.CASES[case]
    assert fn(pmap_compat) == fn(jax.pmap)


def test_compiled_reports_argument_mismatches_as_jax_does():
    f = pmap_compat(lambda x, s: x * s, "i", static_broadcasted_argnums=1)
    x = np.ones((N, 2), np.float32)
    compiled = f.lower(x, 3.0).compile()
    np.testing.assert_array_equal(np.asarray(compiled(x)), 3 * x)  # statics left out, as jit
    np.testing.assert_array_equal(np.asarray(compiled(x, 3.0)), 3 * x)  # or given again
    with pytest.raises(TypeError, match="compiled for static arguments") as e:
        compiled(x, 4.0)
    assert isinstance(e.value, MeshkitError)
    with pytest.raises(TypeError) as e:
        compiled(np.ones((N, 3), np.float32))
    assert str(e.value) == (
        "meshkit.pmap_compat(<lambda>): Argument types differ from the types for which this "
        "computation was compiled.\n  args[0]: compiled for float32[8, 2], called with "
        "float32[8, 3]\nConsider lowering again for these arguments, or calling the pmapped "
        "function itself (it compiles per signature)."
    )
    with pytest.raises(TypeError, match="Function compiled with input pytree does not match"):
        compiled([x])


def test_lower_under_another_context_mesh():
    f = pmap_compat(lambda x: jax.lax.psum(x, "i"), "i")
    x = np.ones((N, 2), np.float32)
    with jax.set_mesh(jax.make_mesh((2, 4), ("a", "b"))):
        out = f.lower(x).compile()(x)
    np.testing.assert_array_equal(np.asarray(out), np.full((N, 2), N))


def test_lower_for_shapes_only():
    # Lowered from shapes alone (no data), as jax.pmap's lower takes them: the output's shape
    # and dtype are known, and the compiled program runs on data afterwards.
    f = pmap_compat(lambda x: jax.lax.psum(x, "i"), "i")
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    for abstract in (
        jax.ShapeDtypeStruct((N, 2), np.float32),
        jax.core.ShapedArray((N, 2), np.float32),
    ):
        lowered = f.lower(abstract)
        assert (lowered.out_info.shape, lowered.out_info.dtype) == ((N, 2), np.float32)
        compiled = lowered.compile()
        assert "all-reduce" in compiled.as_text()
        np.testing.assert_array_equal(np.asarray(compiled(x)), np.broadcast_to(x.sum(0), (N, 2)))


def test_devices_keep_the_order_given():
    devices = jax.devices()[:6]
    devices = [devices[i] for i in (5, 2, 0, 4, 1, 3)]
    f = pmap_compat(lambda x: x * 2 + jax.lax.axis_index("i"), "i", devices=devices)
    out = f(np.zeros(6, np.float32))
    theirs = jax.pmap(lambda x: x * 2 + jax.lax.axis_index("i"), "i", devices=devices)(
        np.zeros(6, np.float32)
    )
    assert [
        s.device for s in sorted(out.addressable_shards, key=lambda s: s.index[0].start)
    ] == devices
    assert list(out.sharding.mesh.devices.flat) == list(theirs.sharding.mesh.devices.flat)
    np.testing.assert_array_equal(np.asarray(out), np.arange(6))


def test_devices_not_a_sequence_are_named():
    one = jax.devices()[0]
    with pytest.raises(MeshkitError, match=r"devices must be a sequence of devices; got a single"):
        pmap_compat(lambda x: x, devices=one)
    with pytest.raises(MeshkitError, match=r"devices must be a sequence of devices; got int"):
        pmap_compat(lambda x: x, devices=3)


def test_lower_and_compile():
    f = pmap_compat(lambda x: jax.lax.psum(x, "i"), "i")
    lowered = f.lower(np.ones((N, 2), np.float32))
    assert "all-reduce" in lowered.compile().as_text()


def test_inputs_from_anywhere():
    f = pmap_compat(lambda x: x * 2, "i")
    x = np.arange(16, dtype=np.float32).reshape(N, 2)
    expected = x * 2
    one_device = jax.device_put(x, jax.devices()[5])
    from_jax_pmap = jax.pmap(lambda v: v)(x)
    explicit = jax.device_put(x, NamedSharding(jax.make_mesh((N,), ("q",)), P("q")))
    auto = jax.device_put(x, NamedSharding(meshkit.make_mesh({"data": N}), P("data")))
    for arg in (x, 3.0 * np.ones((N,), np.float32), one_device, from_jax_pmap, explicit, auto):
        want = np.asarray(arg) * 2
        np.testing.assert_array_equal(np.asarray(f(arg)), want)
    with jax.set_mesh(jax.make_mesh((2, 4), ("a", "b"))):
        np.testing.assert_array_equal(np.asarray(f(x)), expected)


def test_every_call_passes_the_dispatch_choke_point():
    f = pmap_compat(lambda x: x, "i")
    seen = []
    with _dispatch.observing(lambda site, args: seen.append((site.kind, site.name))):
        f(np.ones((N,), np.float32))
        f(np.ones((N,), np.float32))
    assert seen == [("pmap_compat", "<lambda>")] * 2
    assert f.calls == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: pmap_compat(lambda x: x)(np.ones((9, 2))),
            "meshkit.pmap_compat(<lambda>): the mapped axis has size 9, which requires 9 devices, "
            "but only 8 are available on this process (jax.local_devices(): 8).\nEach process "
            "maps one entry per local device; consider a mapped size of at most the local device "
            "count (meshkit.shard(batch) reshapes a batch that way).",
        ),
        (
            lambda: pmap_compat(lambda x, y: x)(np.ones((8, 2)), np.ones((4, 2))),
            "meshkit.pmap_compat(<lambda>): the mapped arguments have different sizes along "
            "their mapped axes:\n  args[0]: shape (8, 2), mapped axis 0 of size 8\n  args[1]: "
            "shape (4, 2), mapped axis 0 of size 4\nEvery mapped axis must have one entry per "
            "device; consider in_axes=None for an argument every device gets whole.",
        ),
        (
            lambda: pmap_compat(lambda x: jax.lax.psum(x, "j"), "i")(np.ones((8, 2))),
            "Found an unbound axis name: j. To fix this, please call psum under `jax.shard_map`.\n"
            "meshkit.pmap_compat(<lambda>): a collective names the axis 'j', which is not bound "
            "here; the function maps the axis 'i'.\nConsider naming 'i' in the collective.",
        ),
        (
            lambda: pmap_compat(lambda x: x, in_axes=2)(np.ones((8, 2))),
            "meshkit.pmap_compat(<lambda>): in_axes=2 for args[0], which has rank 2 (valid: -2 "
            "to 1, or None for an argument every device gets whole).",
        ),
        (
            lambda: pmap_compat(lambda x, s: x, static_broadcasted_argnums=1)(np.ones(8), s=3),
            "meshkit.pmap_compat(<lambda>): pmapped function has static_broadcasted_argnums=(1,) "
            "but was called with only 1 positional argument (and keywords ['s']). All static "
            "broadcasted arguments must be passed positionally, as with jax.pmap.",
        ),
        (
            lambda: pmap_compat(lambda x, s: x, static_broadcasted_argnums=1)(np.ones(8), [1]),
            "meshkit.pmap_compat(<lambda>): Non-hashable static arguments are not supported, as "
            "this can lead to unexpected cache-misses. Static argument (index 1) of type <class "
            "'list'> for function <lambda> is non-hashable.\nThe static_broadcasted_argnums "
            "values key the compilation cache; consider a tuple instead of a list, a frozen "
            "dataclass, or passing it as an array argument.",
        ),
        (
            lambda: pmap_compat(lambda x, y: x, in_axes=(0,))(np.ones(8), np.ones(8)),
            "meshkit.pmap_compat(<lambda>): in_axes is not a pytree prefix of the positional "
            "arguments: at pmap in_axes[0], in_axes has a tuple of length 1 where the arguments "
            "have a tuple of length 2.\nConsider one in_axes entry per positional argument (None "
            "for an argument every device gets whole).",
        ),
        (
            lambda: pmap_compat(lambda x: x, "i", out_axes=3)(np.ones(8)),
            "meshkit.pmap_compat(<lambda>): out_axes=3 for output, which has rank 0 per device "
            "(1 with the mapped axis; valid: -1 to 0).",
        ),
        (
            lambda: pmap_compat(lambda x: x, axis_name=("a", "b")),
            "meshkit.pmap_compat(<lambda>): axis_name must be a string (or None); got ('a', "
            "'b').\nMesh axes are named by strings; consider axis_name='batch'.",
        ),
        (
            lambda: pmap_compat(lambda x: x, in_axes="0"),
            "meshkit.pmap_compat(<lambda>): pmap in_axes must be an int, None, or (nested) "
            "container with those types as leaves, but got '0'.\nConsider ints (the mapped "
            "dimension) or None (an argument every device gets whole), in a tuple with one entry "
            "per positional argument.",
        ),
    ],
    ids=[
        "too-many",
        "sizes",
        "unbound",
        "in-axes-range",
        "static-kw",
        "static-unhashable",
        "in-axes-length",
        "out-axes-range",
        "axis-name",
        "in-axes-type",
    ],
)
def test_errors_are_named(call, message):
    with pytest.raises(MeshkitError) as e:
        call()
    assert str(e.value) == message


def test_exported():
    assert meshkit.pmap_compat is pmap_compat


@pytest.mark.parametrize("case", sorted(pmap_cases.JAX_ERRORS))
def test_errors_keep_jax_pmaps_classes_and_phrases(case):
    call, phrase = pmap_cases.JAX_ERRORS[case]
    with pytest.raises((ValueError, TypeError, IndexError, NameError)) as theirs:
        call(jax.pmap)
    with pytest.raises(type(theirs.value)) as ours:
        call(pmap_compat)
    assert isinstance(ours.value, MeshkitError)
    assert phrase in str(theirs.value)
    assert phrase in str(ours.value)
    assert "meshkit.pmap_compat" in str(ours.value)  # meshkit's explanation is there too


@pytest.mark.parametrize("error", [ValueError, NotImplementedError, AssertionError, TypeError])
@pytest.mark.parametrize("out_axes", [0, None])
def test_users_exceptions_propagate_unchanged_after_one_trace(error, out_axes):
    traced = []

    def f(x):
        traced.append(x.shape)
        raise error("from the user's function")

    with pytest.raises(error) as e:
        pmap_compat(f, "i", out_axes=out_axes)(np.ones((N, 2), np.float32))
    assert type(e.value) is error
    assert str(e.value).startswith("from the user's function")  # JAX may add a note
    assert traced == [(2,)]


def test_each_signature_is_traced_once():
    traced = []

    def step(x, scale):
        traced.append((x.shape, scale))
        return x * scale + jax.lax.psum(x, "i"), jax.lax.psum(x, "i")

    f = pmap_compat(step, "i", out_axes=(0, None), static_broadcasted_argnums=1)
    x = np.ones((N, 2), np.float32)
    out, _ = f(x, 2.0)  # host data, then the analysis of out_axes=None: one trace
    for _ in range(3):
        out, _ = f(out, 2.0)  # earlier outputs: the steady state
        f(x, 2.0)
    assert traced == [((2,), 2.0)]
    f(np.ones((N, 3), np.float32), 2.0)
    f(x, 3.0)
    f(jax.device_put(x, jax.devices()[1]), 3.0)  # placed differently: same signature once placed
    assert traced == [((2,), 2.0), ((3,), 2.0), ((2,), 3.0)]
    # jax.pmap traces as often.
    theirs = []
    g = jax.pmap(lambda x: theirs.append(x.shape) or x, "i")
    for _ in range(3):
        g(x)
    assert theirs == [(2,)]


@settings(max_examples=40)
@given(program=pmap_cases.programs())
def test_random_programs_match_jax_pmap(program):
    """Values, shapes, dtypes, layouts and host reads of every output, as jax.pmap gives them."""
    assert pmap_cases.run_program(pmap_compat, program) == pmap_cases.run_program(jax.pmap, program)
