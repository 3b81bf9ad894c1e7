"""`meshkit migrate` on flax-style programs: host reads of values that may be numpy, out_axes None.

The golden cases `wmt_tohost` and `imagenet_out_axes` (tests/golden/migrate, run by
test_migrate's golden tests) are also run here, before and after ``--fix``: a rewrite must give
what the legacy program gave, on numpy batches as on pmap outputs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshkit
from meshkit._src.migrate.scan import scan_source

GOLDEN = Path(__file__).resolve().parent / "golden" / "migrate"


def load(name: str):
    """A golden file as a module (its own name, so two versions can live side by side)."""
    path = GOLDEN / name
    module_name = "golden_" + name.replace(".", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[module_name]
    return module


def findings(name: str) -> dict[int, list]:
    out: dict[int, list] = {}
    for f in scan_source((GOLDEN / name).read_text(), name):
        out.setdefault(f.line, []).append(f)
    return out


# ---- a helper that reads pmap outputs and numpy alike (wmt's tohost) --------------------------


def test_a_read_of_a_value_that_may_be_numpy_is_rewritten():
    found = findings("wmt_tohost.py")
    # tohost(x): x is a pmap output in one call, shard of a numpy batch in another.
    # first_or_zeros: one branch is a pmap output, the other np.zeros. scores: device arrays only.
    for line in (11, 33, 28):
        assert [(f.code, f.fixable, f.note, f.edit.new) for f in found[line]] == [
            ("MK010", True, "", "meshkit.local_from_global")
        ] * len(found[line])
    assert len(found[28]) == 2


def test_the_fixed_helper_runs_on_numpy_batches_and_on_pmap_outputs():
    fixed_text = (GOLDEN / "wmt_tohost.fixed.py").read_text()
    assert "return meshkit.local_from_global(x).reshape(" in fixed_text
    assert "return meshkit.local_from_global(out)  #" in fixed_text
    legacy, fixed = load("wmt_tohost.py"), load("wmt_tohost.fixed.py")
    n = jax.local_device_count()
    inputs = np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3)
    scale = np.float32(2.0)
    stacked = inputs.reshape(n, 2, 3)
    results = []
    for module in (legacy, fixed):
        ((pred, seen),) = module.predict(scale, [{"inputs": inputs}])
        assert isinstance(seen, np.ndarray)
        assert isinstance(pred, np.ndarray)
        np.testing.assert_array_equal(seen, inputs)  # tohost of a numpy batch
        np.testing.assert_array_equal(pred, 2 * inputs)  # tohost of a pmap output
        for host in module.scores(scale, stacked):
            assert isinstance(host, np.ndarray)
            np.testing.assert_array_equal(host, 2 * stacked)
        zeros = module.first_or_zeros(scale, stacked, False)  # the numpy branch
        warm = module.first_or_zeros(scale, stacked, True)  # the pmap output
        assert isinstance(zeros, np.ndarray)
        assert isinstance(warm, np.ndarray)
        np.testing.assert_array_equal(zeros, 0 * stacked)
        np.testing.assert_array_equal(warm, 2 * stacked)
        results.append((pred, seen, zeros, warm))
    for a, b in zip(*results, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        np.testing.assert_array_equal(b, a)


def test_local_from_global_gives_numpy_back_uncopied_where_np_array_copied():
    batch = meshkit.shard({"inputs": np.ones((jax.local_device_count() * 2, 3), np.float32)})
    x = batch["inputs"]
    assert isinstance(x, np.ndarray)  # shard of numpy stays numpy
    assert meshkit.local_from_global(x) is x  # the one difference from np.array(x): no copy
    assert not np.shares_memory(np.array(x), x)


def test_a_parameter_passed_numpy_too_is_rewritten():
    src = (
        "import jax\nimport numpy as np\n\n"
        "p = jax.pmap(lambda x: x * 2)\n\n"
        "def tohost(x):\n    return np.array(x)\n\n"
        "def run(b):\n    return tohost(p(b)), tohost(p(b) + 1)\n"
    )
    for text in (src, src + "\ndef other(b):\n    return tohost(np.ones(3))\n"):
        (read,) = [f for f in scan_source(text) if f.code == "MK010"]
        assert (read.line, read.fixable, read.note) == (7, True, "")
        assert read.edit.new == "meshkit.local_from_global"


# ---- out_axes with None entries (imagenet's train step) ---------------------------------------


def test_out_axes_with_none_entries_are_rewritten_and_none_outputs_are_not_reads():
    found = findings("imagenet_out_axes.py")
    assert [(f.code, f.fixable) for f in found[21]] == [("MK001", True), ("MK004", True)]
    assert found[21][0].edit.new == "meshkit.pmap_compat"
    assert [(f.code, f.fixable) for f in found[24]] == [("MK001", True), ("MK004", True)]
    assert 33 not in found  # int(state.step): state is output 0, out_axes None
    assert [f.code for f in found[34]] == ["MK010"]  # metrics: output 1, per device
    assert 35 not in found  # float(p_total(...)): out_axes=None


def test_the_fixed_train_step_gives_the_legacy_numbers():
    legacy, fixed = load("imagenet_out_axes.py"), load("imagenet_out_axes.fixed.py")
    n = jax.local_device_count()
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(n, 4)).astype(np.float32) for _ in range(3)]
    results = []
    for module in (legacy, fixed):
        state = module.State(jnp.int32(0), jnp.float32(1.0))
        results.append(module.train(state, batches))
    (s0, steps0, losses0, total0), (s1, steps1, losses1, total1) = results
    assert steps0 == steps1 == [1, 2, 3]
    np.testing.assert_allclose(np.asarray(s1.w), np.asarray(s0.w), rtol=1e-6)
    for a, b in zip(losses0, losses1, strict=True):
        assert b.shape == (n,)
        np.testing.assert_allclose(b, a, rtol=1e-6)
    assert total1 == pytest.approx(total0, rel=1e-6)


@pytest.mark.parametrize(
    ("out_axes", "reads"),
    [
        ("(None, 0)", ["out[1][0]", "np.asarray(m)"]),
        ("(0, None)", ["out[0][0]", "int(s.sum())"]),
        ("None", []),
        ("{'a': 0}", ["out[0][0]", "out[1][0]", "int(s.sum())", "np.asarray(m)"]),
        ("[None, None]", []),
    ],
)
def test_which_outputs_are_per_device_follows_out_axes(out_axes, reads):
    src = (
        "import jax\nimport numpy as np\n\n"
        f"p = jax.pmap(lambda x: (x, x), out_axes={out_axes})\n\n"
        "def run(b):\n"
        "    out = p(b)\n"
        "    s, m = out\n"
        "    return out[0][0], out[1][0], int(s.sum()), np.asarray(m)\n"
    )
    found = [f for f in scan_source(src) if f.code == "MK010"]
    assert [f.message.split("`")[1] for f in found] == reads
