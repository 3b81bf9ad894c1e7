"""`meshkit migrate` on JAX's 2025-26 API moves (MK013 to MK017): what is fixed, what is told.

The golden case `jax_api` (tests/golden/migrate) holds every rule; here, the messages of what
cannot be fixed, and a fixed program run on this JAX against the legacy one.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from meshkit._src.migrate.fix import fix_source
from meshkit._src.migrate.scan import scan_source

LEGACY = """\
import jax
import numpy as np
from jax.experimental.shard_map import shard_map
from jax.sharding import Mesh, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("x",))


def total(a):
    with mesh:
        f = shard_map(lambda b: jax.lax.psum(b, "x"), mesh, P("x"), P(), check_rep=False)
        return f(a)
"""


def fixed(src: str) -> str:
    found = scan_source(src)
    new = fix_source(src, [f.edit for f in found if f.fixable and f.edit])
    compile(new, "fixed.py", "exec")
    return new


def test_the_fixed_shard_map_and_mesh_context_run_on_this_jax_without_warnings():
    new = fixed(LEGACY)
    assert 'jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"),' in new
    assert "out_specs=P(), check_vma=False)" in new
    assert "with jax.set_mesh(mesh):" in new
    assert "jax.experimental" not in new
    assert scan_source(new) == []
    a = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    old_ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # what the legacy code gets
        exec(compile(LEGACY, "legacy.py", "exec"), old_ns)
        want = np.asarray(old_ns["total"](a))
    new_ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fixed code uses no deprecated API
        exec(compile(new, "fixed.py", "exec"), new_ns)
        got = np.asarray(new_ns["total"](a))
    np.testing.assert_array_equal(got, want)


def test_check_rep_through_kwargs_is_reported_with_where_to_rename_it():
    src = (
        "import jax\nfrom jax.sharding import PartitionSpec as P\n\n"
        "opts = dict(check_rep=False)\n\n"
        "def f(mesh, a):\n"
        "    return jax.shard_map(lambda b: b, mesh=mesh, in_specs=P(), out_specs=P(), **opts)(a)\n"
    )
    (finding,) = scan_source(src)
    assert (finding.code, finding.line, finding.fixable, finding.edit) == ("MK014", 7, False, None)
    assert finding.message == "check_rep in keywords passed with **"
    assert finding.note == (
        "not fixed: check_rep is passed through **opts: the codemod cannot rename a key it does "
        "not see written at the call; rename it to check_vma where opts is built"
    )


@pytest.mark.parametrize(
    ("code", "note"),
    [
        (
            "from jax.experimental.shard_map import shard_map\n"
            "f = shard_map(g, mesh, P(), P(), **kw)\n",
            "not fixed: arguments passed with * or **; name them for jax.shard_map, then edit",
        ),
        (
            "from jax.experimental.shard_map import shard_map\n"
            "f = shard_map(g, mesh, P(), P(), auto=frozenset({'y'}))\n",
            "not fixed: auto= has no one-to-one replacement (jax.shard_map's axis_names= names "
            "the manual axes, the complement)",
        ),
        (
            "import jax\nif True:\n    jax.cloud_tpu_init()\n",
            "not fixed: not a call standing alone as a statement with others in its block; "
            "remove it by hand (JAX initializes TPUs itself)",
        ),
        (
            "import jax\nok = jax.cloud_tpu_init() or True\n",
            "not fixed: not a call standing alone as a statement with others in its block; "
            "remove it by hand (JAX initializes TPUs itself)",
        ),
    ],
)
def test_what_cannot_be_mapped_is_reported_not_rewritten(code, note):
    src = "import jax\nfrom jax.sharding import PartitionSpec as P\n" + code
    found = [f for f in scan_source(src) if f.note]
    assert [f.note for f in found][:1] == [note]
    assert not found[0].fixable


def test_with_a_mesh_is_found_by_what_made_it_and_by_annotations_only():
    src = (
        "import jax\nimport meshkit\nfrom jax.sharding import Mesh\n\n"
        "def run(a, m: Mesh, lock):\n"
        "    made = meshkit.make_mesh({'x': -1})\n"
        "    with made, m, lock:\n"
        "        return a\n"
    )
    new = fixed(src)
    assert "with jax.set_mesh(made), jax.set_mesh(m), lock:" in new
    assert [f.code for f in scan_source(src)] == ["MK015", "MK015"]


def test_stated_jax_facts_hold_for_the_installed_jax():
    import inspect

    import jax

    assert not hasattr(jax, "cloud_tpu_init")  # MK016
    assert not hasattr(jax.sharding, "use_mesh")  # MK015
    assert callable(jax.set_mesh)
    params = inspect.signature(jax.shard_map).parameters  # MK013, MK014
    assert "check_vma" in params
    assert "check_rep" not in params
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in ("mesh", "out_specs"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    with pytest.warns(DeprecationWarning, match="jax.set_mesh"), mesh:  # MK015
        pass
