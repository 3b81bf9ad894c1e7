"""Canonical texts of what processes compare: no memory address, no id(), no default repr.

The strongest check is across interpreters: two fresh processes build the same flax
`TrainState`, optax chain, `functools.partial` and `jax.tree_util.Partial` and must print the
same texts, where Python's own texts differ in their addresses.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from meshkit._src.core import canonical

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def scale(x, k):
    return x * k


def shift(x, k):
    return x + k


class _Opaque:
    """An object with Python's default repr (an address)."""


@dataclasses.dataclass(frozen=True)
class _Config:
    width: int
    act: object


class _Colour(enum.Enum):
    RED = 1


def test_a_partial_in_a_tree_is_named_by_its_function_not_its_address():
    tree = (jax.tree_util.Partial(scale, k=2.0), np.ones(3))
    text = canonical.structure(jax.tree_util.tree_structure(tree))
    assert "0x" in str(jax.tree_util.tree_structure(tree))  # what the processes compared before
    assert not _ADDRESS.search(text)
    assert f"test_canonical.scale:{scale.__code__.co_firstlineno}" in text
    assert text.endswith("((), {'k': *}), *)")


def test_functions_differ_by_name_and_definition_site():
    texts = {
        canonical.value(scale),
        canonical.value(shift),
        canonical.value(lambda x: x),
        canonical.value(lambda x: x + 1),  # another lambda on another line
        canonical.value(functools.partial(scale, k=2.0)),
        canonical.value(functools.partial(scale, k=3.0)),
    }
    assert len(texts) == 6
    # The same function gives the same text every time.
    assert canonical.value(functools.partial(scale, k=2.0)) == canonical.value(
        functools.partial(scale, k=2.0)
    )


def test_short_names_never_show_a_repr():
    assert canonical.function_name(scale) == "scale"
    assert canonical.function_name(functools.partial(functools.partial(scale, 1), k=2)) == "scale"
    assert canonical.function_name(_Opaque()) == "_Opaque"  # a callable object: its type


def test_static_values():
    assert canonical.value(_Opaque()) == "test_canonical._Opaque"
    assert canonical.value(_Config(3, scale)) == (
        f"test_canonical._Config(width=3, act=test_canonical.scale:{scale.__code__.co_firstlineno})"
    )
    assert canonical.value(_Colour.RED) == "test_canonical._Colour.RED"
    assert canonical.value(np.float32) == "numpy.float32"
    assert canonical.value(np.dtype("int8")) == "dtype(int8)"
    a, b = np.arange(4), np.arange(4) + 1
    assert canonical.value(a) != canonical.value(b)
    assert canonical.value(a).startswith("int64[4]#")
    # A repr of its own is kept, its addresses taken out.
    assert canonical.value(range(3)) == "range:range(0, 3)"
    assert canonical.value(jax.numpy.ones((2, 3))) == "jax.Array float32[2, 3]"


def test_a_self_referencing_value_ends():
    loop: list[object] = []
    loop.append(loop)
    assert canonical.value(loop).count("list(") <= 9


def test_long_containers_are_counted_and_digested():
    text = canonical.value(list(range(1000)))
    assert "936 more #" in text
    assert canonical.value(list(range(1000))) != canonical.value([*range(999), -1])


_trees = st.recursive(
    st.sampled_from([None, 1.0, np.zeros(2)]),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["a", "b", "c", "x"]), inner, max_size=3),
        inner.map(lambda t: jax.tree_util.Partial(scale, t)),
    ),
    max_leaves=8,
)


@given(_trees, _trees)
def test_structures_are_equal_exactly_when_jax_says_so(a, b):
    # Every function here is one definition, so equal treedefs must give equal texts and the
    # texts must tell unequal treedefs apart.
    da, db = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    ta, tb = canonical.structure(da), canonical.structure(db)
    assert (ta == tb) == (da == db)
    assert not _ADDRESS.search(ta)


_PROGRAM = textwrap.dedent(
    """
    import functools
    import jax, jax.numpy as jnp, optax
    import flax.linen as nn
    from flax import nnx
    from flax.training import train_state
    from meshkit._src.core import canonical

    def loss(x, k):
        return x * k

    model = nn.Dense(3)
    params = model.init(jax.random.key(0), jnp.ones((1, 2)))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    graph, nnx_state = nnx.split(linear)
    trees = [state, nnx_state, jax.tree_util.Partial(loss, k=2.0), (graph, 1)]
    for tree in trees:
        print(canonical.structure(jax.tree_util.tree_structure(tree)))
    print(canonical.value(functools.partial(loss, k=2.0)))
    print(canonical.value(model.apply))
    print(str(jax.tree_util.tree_structure(state)))  # Python's own text, for contrast
    """
)


def test_two_interpreters_give_the_same_texts_for_real_training_states():
    from conftest import require

    require("flax", "the flax TrainState and nnx cases")
    require("optax", "the optax transformation in the TrainState")
    runs = [
        subprocess.run(
            [sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=120
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr
    ours = [r.stdout.splitlines()[:-1] for r in runs]
    pythons = [r.stdout.splitlines()[-1] for r in runs]
    assert ours[0] == ours[1]
    assert "0x" in pythons[0]  # Python's own text: the addresses that made processes disagree
    for line in ours[0]:
        assert not _ADDRESS.search(line), line
    assert ours[0][0].startswith("flax.training.train_state.TrainState[")
    assert "optax." in ours[0][0]


class _Unhashable:
    """A pytree node whose static data is a list (JAX allows it outside jit)."""

    def __init__(self, x, meta):
        self.x, self.meta = x, meta


jax.tree_util.register_pytree_node(
    _Unhashable, lambda n: ((n.x,), n.meta), lambda meta, children: _Unhashable(children[0], meta)
)


def test_a_structure_with_unhashable_static_data_still_gets_its_text():
    a = canonical.structure(jax.tree_util.tree_structure(_Unhashable(1.0, ["a", 1])))
    b = canonical.structure(jax.tree_util.tree_structure(_Unhashable(1.0, ["a", 2])))
    assert a == "test_canonical._Unhashable[list('a', 1)](*)"
    assert a != b
