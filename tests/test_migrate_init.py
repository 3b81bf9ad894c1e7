"""`meshkit migrate --fix` adds the `meshkit.init()` a rewritten program's entry point needs.

A legacy script run as one process per host never joined: `jax.pmap` ran on the local devices
of each. Rewritten to `pmap_compat` it must join, or `meshkit launch` fails the run (its
processes never joined) and a collective would wait for ever. The CLI case is the golden
``entry_point`` of `tests/test_migrate.py`.
"""

from __future__ import annotations

import ast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshkit._src.migrate.fix import add_init

INIT = "meshkit.init()  # meshkit migrate: join this program's processes (before any JAX work)"


def _inits(source: str) -> int:
    return sum(
        1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "meshkit.init"
    )


@pytest.mark.parametrize(
    ("source", "expected", "line"),
    [
        (
            "import jax\n\nif __name__ == '__main__':\n    main()\n",
            f"import jax\nimport meshkit\n\nif __name__ == '__main__':\n    {INIT}\n    main()\n",
            5,
        ),
        (  # the comparison the other way round, on one line
            'import meshkit\nif "__main__" == __name__: main()\n',
            f'import meshkit\nif "__main__" == __name__:\n    {INIT}\n    main()\n',
            3,
        ),
    ],
)
def test_init_goes_first_in_the_main_block(source, expected, line):
    assert add_init(source) == (expected, line)


@pytest.mark.parametrize(
    "source",
    [
        "import jax\nx = jax.device_count()\n",  # no entry point: a library, or a plain script
        "def run():\n    if __name__ == '__main__':\n        main()\n",  # not at the top level
        "import meshkit\nif __name__ == '__main__':\n    meshkit.init()\n    main()\n",
        "from meshkit import init as join\nif __name__ == '__main__':\n    join()\n",
        "import jax\nif __name__ == '__main__':\n    jax.distributed.initialize()\n",
        "if __name__ != '__main__':\n    main()\n",
    ],
)
def test_nothing_is_added_without_an_entry_point_or_where_the_program_joins(source):
    assert add_init(source) == (source, None)


_STATEMENTS = st.sampled_from(
    ["main()", "print(jax.device_count())", "x = 1", "for i in range(2):\n    step(i)", "pass"]
)


@given(
    before=st.lists(_STATEMENTS, max_size=3),
    body=st.lists(_STATEMENTS, min_size=1, max_size=3),
    quote=st.sampled_from(["'", '"']),
)
def test_property_one_init_first_in_the_block_and_idempotent(before, body, quote):
    """Against the reference (the block with the call prepended): one call, first in the block,
    everything else kept in order; a second run adds nothing."""
    indented = "".join("    " + line + "\n" for s in body for line in s.splitlines())
    source = (
        "import jax\n\n"
        + "".join(s + "\n" for s in before)
        + f"\nif __name__ == {quote}__main__{quote}:\n"
        + indented
    )
    new, line = add_init(source)
    assert line is not None
    assert new.splitlines()[line - 1] == "    " + INIT
    assert _inits(new) == 1
    guard = next(n for n in ast.parse(new).body if isinstance(n, ast.If))
    reference = ast.parse(source)
    ref_guard = next(n for n in reference.body if isinstance(n, ast.If))
    assert ast.dump(guard.body[0]) == ast.dump(ast.parse("meshkit.init()").body[0])
    assert [ast.dump(s) for s in guard.body[1:]] == [ast.dump(s) for s in ref_guard.body]
    assert add_init(new) == (new, None)
