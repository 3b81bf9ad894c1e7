"""Spec trees matched to flax containers by keys, flax's own partition specs, one-line errors."""

from __future__ import annotations

import string
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import collectives as C
from meshkit._src.core.trees import broadcast_prefix
from meshkit._src.sharding.specs import SpecTreeError, align_specs, is_spec_leaf, plain_specs
from meshkit.testing import reference_spmd


@pytest.fixture
def mesh():
    return meshkit.make_mesh({"data": 4, "model": 2})


def _per_leaf(specs: Any, tree: Any) -> dict[str, Any]:
    """Each leaf's spec by its path, through meshkit's matching."""
    aligned = align_specs(plain_specs(specs), tree, where="specs")
    entries = broadcast_prefix(aligned, tree, is_leaf=is_spec_leaf)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return dict(zip(paths, entries, strict=True))


# ---- without flax: mappings of any registered type, prefixes, the messages -------------------


class KeyedBox(Mapping):
    """A mapping registered as a pytree node with dict keys (a stand-in for a user container)."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


jax.tree_util.register_pytree_with_keys(
    KeyedBox,
    lambda b: ([(jax.tree_util.DictKey(k), b[k]) for k in sorted(b)], tuple(sorted(b))),
    lambda keys, children: KeyedBox(dict(zip(keys, children, strict=True))),
)


class LeafMapping(KeyedBox):
    """A mapping JAX does not know: a single leaf to it."""


def test_a_dict_spec_matches_other_mappings_by_keys():
    tree = OrderedDict(w=np.ones((4, 2)), b=KeyedBox({"x": np.ones(4), "y": np.ones(8)}))
    specs = {"b": {"y": "data", "x": P()}, "w": P("data", "model")}
    aligned = align_specs(specs, tree, where="specs")
    assert type(aligned) is OrderedDict
    assert list(aligned) == ["w", "b"]
    assert type(aligned["b"]) is KeyedBox
    assert _per_leaf(specs, tree) == {
        "['w']": P("data", "model"),
        "['b']['x']": P(),
        "['b']['y']": "data",
    }


def test_a_spec_may_cover_a_whole_subtree_and_none_covers_none():
    tree = {"a": KeyedBox({"x": np.ones(4), "y": np.ones(4)}), "b": None, "c": (1.0, 2.0)}
    assert _per_leaf({"a": "data", "b": None, "c": P()}, tree) == {
        "['a']['x']": "data",
        "['a']['y']": "data",
        "['c'][0]": P(),
        "['c'][1]": P(),
    }


@pytest.mark.parametrize(
    ("specs", "tree", "message"),
    [
        (
            {"w": P(), "b": P()},
            KeyedBox({"kernel": 1.0, "bias": 2.0}),
            "in_specs[0]: the spec is a dict with keys {'b', 'w'} but the argument is a "
            "KeyedBox with keys {'bias', 'kernel'}: missing 'bias', 'kernel'; extra 'b', 'w'",
        ),
        (
            {"a": {"x": P()}},
            {"a": {"x": 1.0, "y": 2.0}},
            "in_specs[0]['a']: the spec is a dict with keys {'x'} but the argument is a dict "
            "with keys {'x', 'y'}: missing 'y'",
        ),
        (
            {"a": P(), "z": P()},
            OrderedDict(a=1.0),
            "in_specs[0]: the spec is a dict with keys {'a', 'z'} but the argument is an "
            "OrderedDict with keys {'a'}: extra 'z'",
        ),
        (
            {"a": P()},
            (1.0, 2.0),
            "in_specs[0]: the spec is a dict with keys {'a'} but the argument is a tuple of "
            "length 2",
        ),
        (
            {"a": P()},
            LeafMapping({"a": 1.0}),
            "in_specs[0]: the spec is a dict with keys {'a'} but the argument is a LeafMapping "
            "with keys {'a'}",
        ),
        (
            {"a": {"b": P()}},
            {"a": np.ones((2, 3))},
            "in_specs[0]['a']: the spec is a dict with keys {'b'} but the argument is a numpy "
            "array of shape (2, 3)",
        ),
        (
            (P(), P()),
            [1.0, 2.0],
            "in_specs[0]: the spec is a tuple of length 2 but the argument is a list of length 2",
        ),
        (
            {"a": (P(), P(), P())},
            {"a": (1.0, 2.0)},
            "in_specs[0]['a']: the spec is a tuple of length 3 but the argument is a tuple of "
            "length 2",
        ),
        (
            {"a": {"b": P()}},
            {"a": None},
            "in_specs[0]['a']: the spec is a dict with keys {'b'} but the argument is None",
        ),
    ],
)
def test_a_mismatch_is_one_line_naming_the_place_and_the_keys(specs, tree, message):
    with pytest.raises(SpecTreeError) as e:
        align_specs(specs, tree, where="in_specs[0]")
    assert str(e.value) == message
    assert "\n" not in str(e.value)
    assert "PyTreeDef" not in str(e.value)


def test_spmd_and_global_array_from_local_name_the_mismatch(mesh):
    f = meshkit.spmd(lambda t: t, mesh=mesh, in_specs=({"w": "data"},), out_specs="data")
    with pytest.raises(
        meshkit.MeshkitError,
        match=r"^meshkit\.spmd\(<lambda>\): in_specs\[0\]: the spec is a dict with keys "
        r"\{'w'\} but the argument is an OrderedDict with keys \{'kernel'\}: missing 'kernel'; "
        r"extra 'w'$",
    ):
        f(OrderedDict(kernel=np.ones(8)))
    with pytest.raises(
        meshkit.MeshkitError,
        match=r"^meshkit\.global_array_from_local: spec\['a'\]: the spec is a tuple of length 1 "
        r"but local is a list of length 1$",
    ):
        meshkit.global_array_from_local({"a": [np.ones(8)]}, mesh, {"a": ("data",)})


def test_out_specs_are_matched_to_the_outputs_by_keys(mesh):
    x = np.arange(32.0).reshape(8, 4)

    def f(t):
        return KeyedBox({"rows": t["x"], "total": C.psum(t["x"].sum(), ("data", "model"))})

    g = meshkit.spmd(
        f,
        mesh=mesh,
        in_specs=({"x": "data model"},),
        out_specs={"total": P(), "rows": "data model"},
    )
    out = g(OrderedDict(x=x))
    assert type(out) is KeyedBox
    np.testing.assert_array_equal(out["rows"], x)
    assert out["rows"].sharding == NamedSharding(mesh, P("data", "model"))
    assert float(out["total"]) == x.sum()
    expected = reference_spmd(
        f, mesh, ({"x": "data model"},), {"total": P(), "rows": "data model"}, {"x": x}
    )
    np.testing.assert_array_equal(expected["rows"], x)
    bad = meshkit.spmd(f, mesh=mesh, in_specs=({"x": "data model"},), out_specs={"rows": P()})
    with pytest.raises(meshkit.MeshkitError) as e:
        bad(OrderedDict(x=x))
    # Found while tracing: JAX may add a note of its own (not part of the message).
    assert str(e.value) == (
        "meshkit.spmd(f): out_specs: the spec is a dict with keys {'rows'} but the output is a "
        "KeyedBox with keys {'rows', 'total'}: missing 'total'"
    )


def test_a_mapping_as_all_of_in_specs_is_refused(mesh):
    with pytest.raises(
        meshkit.MeshkitError,
        match=r"got an OrderedDict with keys \{'w'\}.\nConsider in_specs=\(specs,\)",
    ):
        meshkit.spmd(lambda t: t, mesh=mesh, in_specs=OrderedDict(w="data"), out_specs="data")


# ---- flax: nnx.State, FrozenDict, nnx.get_partition_spec, linen's boxes -----------------------


class _Mlp:
    """A two-layer nnx MLP, its kernels split over 'model' (made in a test, flax imported)."""

    @staticmethod
    def make(mesh):
        nnx = require("flax.nnx", "flax")
        init = nnx.initializers.lecun_normal()

        class Mlp(nnx.Module):
            def __init__(self, rngs):
                self.l1 = nnx.Linear(
                    4, 8, rngs=rngs, kernel_init=nnx.with_partitioning(init, (None, "model"))
                )
                self.l2 = nnx.Linear(
                    8, 2, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("model", None))
                )

        with jax.set_mesh(mesh):
            return Mlp(nnx.Rngs(0))


def _double(tree):
    return jax.tree_util.tree_map(lambda x: 2 * x, tree)


def test_a_dict_spec_for_an_nnx_state(mesh):
    nnx = require("flax.nnx", "flax")
    _, state = nnx.split(_Mlp.make(mesh))
    # One spec for both biases: a spec covers the whole subtree under it.
    specs = {"l1": {"kernel": "_ model", "bias": P()}, "l2": {"kernel": "model _", "bias": P()}}
    f = meshkit.spmd(_double, mesh=mesh, in_specs=(specs,), out_specs=specs)
    out = f(state)
    assert type(out) is type(state)
    assert out["l1"]["kernel"].get_value().sharding.spec == P(None, "model")
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_flatten_with_path(out)[0],
        jax.tree_util.tree_flatten_with_path(state)[0],
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), 2 * np.asarray(b), err_msg=str(path))


def test_flax_partition_specs_are_accepted_as_they_come(mesh):
    nnx = require("flax.nnx", "flax")
    _, state = nnx.split(_Mlp.make(mesh))
    specs = nnx.get_partition_spec(state)  # a State of Params around PartitionSpecs
    f = meshkit.spmd(_double, mesh=mesh, in_specs=(specs,), out_specs=specs)
    out = f(state)
    kernel = out["l2"]["kernel"].get_value()
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2)
    np.testing.assert_array_equal(kernel, 2 * np.asarray(state["l2"]["kernel"].get_value()))
    assert f.calls == 1
    # The same specs place host copies of the parameters (global_array_from_local).
    host = jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(state))
    placed = meshkit.global_array_from_local(host, mesh, specs)
    assert type(placed) is dict
    assert placed["l1"]["kernel"].sharding == NamedSharding(mesh, P(None, "model"))
    assert placed["l1"]["bias"].sharding == NamedSharding(mesh, P())


def test_a_dict_spec_for_a_frozen_dict_and_linen_specs(mesh):
    flax = require("flax")
    nn = require("flax.linen", "flax")

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            return nn.Dense(8, kernel_init=init)(x)

    x = np.ones((8, 4), np.float32)
    abstract = jax.eval_shape(Dense().init, jax.random.key(0), x)  # linen Partitioned boxes
    params = flax.core.freeze(nn.unbox(Dense().init(jax.random.key(0), x)))
    plain = {"params": {"Dense_0": {"kernel": "_ model", "bias": P()}}}
    # A linen box stands for the spec of its names, whatever it holds.
    boxed = {
        "params": {"Dense_0": {"kernel": abstract["params"]["Dense_0"]["kernel"], "bias": P()}}
    }
    for specs in (plain, boxed, nn.get_partition_spec(abstract)):
        placed = meshkit.global_array_from_local(params, mesh, specs)
        assert type(placed) is type(params)
        kernel = placed["params"]["Dense_0"]["kernel"]
        assert kernel.sharding == NamedSharding(mesh, P(None, "model"))
    f = meshkit.spmd(_double, mesh=mesh, in_specs=(plain,), out_specs=plain)
    out = f(params)
    assert type(out) is type(params)
    np.testing.assert_array_equal(
        out["params"]["Dense_0"]["kernel"], 2 * np.asarray(params["params"]["Dense_0"]["kernel"])
    )


def test_a_mismatch_against_an_nnx_state_is_one_line(mesh):
    nnx = require("flax.nnx", "flax")
    _, state = nnx.split(_Mlp.make(mesh))
    f = meshkit.spmd(
        _double, mesh=mesh, in_specs=({"l1": {"w": P(), "b": P()}, "l2": P()},), out_specs=P()
    )
    with pytest.raises(meshkit.MeshkitError) as e:
        f(state)
    assert str(e.value) == (
        "meshkit.spmd(_double): in_specs[0]['l1']: the spec is a dict with keys {'b', 'w'} but "
        "the argument is a dict with keys {'bias', 'kernel'}: missing 'bias', 'kernel'; extra "
        "'b', 'w'"
    )
    g = meshkit.spmd(_double, mesh=mesh, in_specs=({"l1": P()},), out_specs=P())
    with pytest.raises(meshkit.MeshkitError) as e:
        g(state)
    assert str(e.value) == (
        "meshkit.spmd(_double): in_specs[0]: the spec is a dict with keys {'l1'} but the "
        "argument is an nnx.State with keys {'l1', 'l2'}: missing 'l2'"
    )


def test_a_flax_variable_holding_an_array_is_no_spec(mesh):
    nnx = require("flax.nnx", "flax")
    _, state = nnx.split(_Mlp.make(mesh))
    with pytest.raises(
        meshkit.MeshkitError,
        match=r"in_specs\[0\]\['l1'\]\['bias'\]\.value must be a PartitionSpec or a spec string",
    ):
        meshkit.spmd(_double, mesh=mesh, in_specs=(state,), out_specs=P())


# ---- properties: any mix of containers behaves as plain dicts ---------------------------------

_KEYS = st.sampled_from(list(string.ascii_lowercase[:5]))
_SPECS = st.sampled_from([P(), P("data"), "data", "_ model", None])


def _trees(depth: int = 3) -> st.SearchStrategy[Any]:
    leaf = st.integers(1, 3).map(lambda n: np.zeros((n,)))
    return st.recursive(leaf, lambda kids: st.dictionaries(_KEYS, kids, max_size=3), max_leaves=8)


@st.composite
def _prefix(draw: st.DrawFn, tree: Any) -> Any:
    """A plain-dict spec tree that is a prefix of the plain-dict ``tree``."""
    if not isinstance(tree, dict) or (draw(st.booleans()) and draw(st.booleans())):
        return draw(_SPECS.filter(lambda s: s is not None))
    return {k: draw(_prefix(v)) for k, v in tree.items()}


def _reference(specs: Any, tree: Any, path: str = "") -> dict[str, Any]:
    """Each leaf's spec by path, for plain dicts: the spec that covers it."""
    if not isinstance(tree, dict):
        return {path: specs}
    out: dict[str, Any] = {}
    for k in sorted(tree):
        sub = specs if not isinstance(specs, dict) else specs[k]
        out.update(_reference(sub, tree[k], f"{path}[{k!r}]"))
    return out


def _wrap(tree: Any, kinds: Iterator[str], nnx: Any, flax: Any) -> Any:
    if not isinstance(tree, dict):
        return tree
    kids = {k: _wrap(v, kinds, nnx, flax) for k, v in tree.items()}
    kind = next(kinds)
    if kind == "state":
        return nnx.State(kids)
    if kind == "frozen":
        return flax.core.FrozenDict(kids)
    if kind == "ordered":
        return OrderedDict(sorted(kids.items()))
    return kids


@given(data=st.data())
def test_any_mix_of_mapping_containers_matches_as_plain_dicts(data):
    nnx = require("flax.nnx", "flax")
    flax = require("flax")
    tree = data.draw(st.dictionaries(_KEYS, _trees(), min_size=1, max_size=3))
    specs = data.draw(_prefix(tree))
    kinds = iter(data.draw(st.lists(st.sampled_from(["state", "frozen", "ordered", "dict"]),
                                    min_size=64, max_size=64)))  # fmt: skip
    wrapped = _wrap(tree, kinds, nnx, flax)
    assert _per_leaf(specs, wrapped) == _reference(specs, tree)


@st.composite
def _broken(draw: st.DrawFn, tree: dict[str, Any]) -> tuple[Any, str, set[str], set[str]]:
    """A dict spec tree with one node's keys changed: (specs, its path, missing, extra)."""
    path: list[str] = []
    node = tree
    while True:
        inner = [k for k, v in node.items() if isinstance(v, dict) and v]
        if not inner or draw(st.booleans()):
            break
        path.append(draw(st.sampled_from(sorted(inner))))
        node = node[path[-1]]
    keys = set(node)
    drop = draw(st.sets(st.sampled_from(sorted(keys)), max_size=len(keys)))
    add = draw(st.sets(st.sampled_from(["p", "q", "r"]), max_size=2))
    if not drop and not add:
        add = {"p"}
    new_keys = (keys - drop) | add

    def rebuild(sub: Any, at: list[str]) -> Any:
        if not at:
            return {k: P() for k in new_keys}
        return {k: (rebuild(v, at[1:]) if k == at[0] else P()) for k, v in sub.items()}

    where = "".join(f"[{k!r}]" for k in path)
    return rebuild(tree, path), where, drop, add


@given(data=st.data())
def test_a_key_mismatch_is_always_one_line_naming_the_keys(data):
    nnx = require("flax.nnx", "flax")
    flax = require("flax")
    tree = data.draw(st.dictionaries(_KEYS, _trees(), min_size=1, max_size=3))
    specs, where, missing, extra = data.draw(_broken(tree))
    kinds = iter(data.draw(st.lists(st.sampled_from(["state", "frozen", "ordered", "dict"]),
                                    min_size=64, max_size=64)))  # fmt: skip
    wrapped = _wrap(tree, kinds, nnx, flax)
    with pytest.raises(SpecTreeError) as e:
        align_specs(specs, wrapped, where="in_specs[0]")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"in_specs[0]{where}: the spec is a dict with keys ")
    parts = {}
    for part in message.rsplit(": ", 1)[1].split("; "):
        word, _, names = part.partition(" ")
        parts[word] = set(names.split(", "))
    assert parts.get("missing", set()) == {repr(k) for k in missing}
    assert parts.get("extra", set()) == {repr(k) for k in extra}


def test_the_reference_simulation_takes_dict_specs_for_an_nnx_state(mesh):
    nnx = require("flax.nnx", "flax")
    state = nnx.State({"w": np.arange(16.0).reshape(8, 2), "b": np.ones(2)})

    def f(t):
        return {"w": C.psum(t["w"], "data"), "b": t["b"] + 1}

    out = reference_spmd(f, mesh, ({"w": "data model", "b": P()},), {"w": "_ model", "b": P()},
                         state)  # fmt: skip
    np.testing.assert_allclose(out["w"], np.arange(16.0).reshape(4, 2, 2).sum(0))
    g = meshkit.spmd(f, mesh=mesh, in_specs=({"w": "data model", "b": P()},),
                     out_specs={"w": "_ model", "b": P()})  # fmt: skip
    got = g(state)
    np.testing.assert_allclose(got["w"], out["w"])
    np.testing.assert_allclose(jnp.asarray(got["b"]), out["b"])
