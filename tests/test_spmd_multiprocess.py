"""meshkit.spmd and collectives on 2 processes x 4 CPU devices, against the reference.

The functions starting with an underscore run inside the launched processes; each process
imports this file again.
"""

from __future__ import annotations

import pytest

from meshkit.testing import run_in_processes

pytestmark = pytest.mark.multiprocess


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _check_one_mesh(axes, kind, x):
    import warnings

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit
    from meshkit import collectives as C
    from meshkit.testing import assert_spmd_matches_reference

    mesh = meshkit.make_mesh(axes, axis_types=kind)
    names = tuple(mesh.axis_names)
    outer, inner = names[0], names[-1]
    spec = P(names[:-1], inner)
    cases = {
        "psum outer": (lambda a: C.psum(a, outer), P(None, inner)),
        "psum all": (lambda a: C.psum(a, names), P()),
        "all_gather outer tiled": (lambda a: C.all_gather(a, outer, tiled=True), P(None, inner)),
        "all_gather tuple": (lambda a: C.all_gather(a, (inner, outer)), P(None, None, inner)),
        "ppermute outer": (lambda a: C.ppermute(a, outer, [(0, 1), (1, 0)]), spec),
        "shift across all": (lambda a: C.shift(a, names, 3), spec),
    }
    checked = []
    for name, (f, out_spec) in cases.items():
        assert_spmd_matches_reference(f, mesh, spec, out_spec, x)
        checked.append(f"{kind}:{name}")
    # A global array laid out differently: one reshard across processes, warned once.
    other = jax.make_array_from_callback(
        x.shape, NamedSharding(mesh, P(inner, names[:-1])), lambda idx: x[idx]
    )
    f = meshkit.spmd(lambda a: C.psum(a, outer), mesh=mesh, in_specs=spec, out_specs=P(None, inner))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(other)
    assert [w.category for w in caught] == [meshkit.ReshardWarning], caught
    expected = x.reshape(mesh.shape[outer], -1, x.shape[1]).sum(0)
    assert out.shape == expected.shape
    assert out.addressable_shards, "this process holds no shard"
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
    checked.append(f"{kind}:reshard")
    return checked


def _collectives_across_processes():
    import jax
    import numpy as np

    rng = np.random.default_rng(0)  # the same host data in every process
    checked = []
    for axes, kind in (({"data": -1, "model": 4}, "auto"), ({"rows": 4, "cols": 2}, "explicit")):
        x = rng.integers(-8, 8, size=(8, 4)).astype(np.float32)
        checked += _check_one_mesh(axes, kind, x)
    return {"process": jax.process_index(), "checked": checked}


def test_collectives_match_the_reference_across_processes():
    results = run_in_processes(_collectives_across_processes, num_processes=2, timeout=240)
    assert [r["process"] for r in results] == [0, 1]
    assert results[0]["checked"] == results[1]["checked"]
    assert len(results[0]["checked"]) == 14
