"""`meshkit migrate --fix`: where `import meshkit` (and `import jax`) goes.

With the third-party imports of the leading import block, at its alphabetical place; with none,
after the standard library group; with no import, after the docstring and `__future__`; never
above a line that sets up the environment.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from meshkit._src.migrate.fix import fix_source
from meshkit._src.migrate.imports import import_group
from meshkit._src.migrate.scan import scan_source
from meshkit.cli import main


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["migrate", *args])
    return code, out.getvalue(), err.getvalue()


def fix(src: str, first_party: tuple[str, ...] = ()) -> str:
    edits = [f.edit for f in scan_source(src) if f.fixable and f.edit]
    assert edits, "nothing to fix"
    new = fix_source(src, edits, first_party)
    compile(new, "fixed.py", "exec")
    return new


@pytest.mark.parametrize(
    ("module", "relative", "expected"),
    [
        ("__future__", False, "__future__"),
        ("os.path", False, "stdlib"),
        ("jax.numpy", False, "third-party"),
        ("mylib.io", False, "first-party"),  # named local below
        ("json", False, "first-party"),  # a local json.py shadows the standard library's
        ("", True, "first-party"),  # from . import x
        ("sibling", True, "first-party"),
    ],
)
def test_import_groups(module, relative, expected):
    assert import_group(module, relative=relative, first_party={"mylib", "json"}) == expected


def test_meshkit_goes_between_third_party_imports_not_after_local_ones():
    src = (
        "import os\n"
        "\n"
        "import jax\n"
        "import numpy as np\n"
        "\n"
        "import mylib\n"
        "from . import helpers\n"
        "\n"
        "step = jax.pmap(f)\n"
        "other = jax.jit(f)\n"
    )
    assert fix(src, ("mylib",)) == (
        "import os\n"
        "\n"
        "import jax\n"
        "import meshkit\n"
        "import numpy as np\n"
        "\n"
        "import mylib\n"
        "from . import helpers\n"
        "\n"
        "step = meshkit.pmap_compat(f)\n"
        "other = jax.jit(f)\n"
    )


def test_without_first_party_names_an_unknown_module_is_third_party():
    src = "import jax\n\nimport mylib\n\nstep = jax.pmap(jax.jit(f))\n"
    # mylib sorts after meshkit, and nothing says it is local: meshkit goes before it, taking
    # the blank line that opens the group.
    assert (
        fix(src)
        == "import jax\n\nimport meshkit\nimport mylib\n\nstep = meshkit.pmap_compat(jax.jit(f))\n"
    )
    assert fix(src, ("mylib",)) == (
        "import jax\nimport meshkit\n\nimport mylib\n\nstep = meshkit.pmap_compat(jax.jit(f))\n"
    )


def test_before_the_first_third_party_import_that_sorts_after_it_comments_stay():
    src = (
        "import sys\n"
        "\n"
        "import flax\n"
        "import matplotlib.pyplot as plt\n"
        "# optimizers\n"
        "import optax\n"
        "from jax import pmap\n"
        "\n"
        "step = pmap(f)\n"
    )  # the only jax import goes: nothing uses it any more
    assert fix(src) == (
        "import sys\n"
        "\n"
        "import flax\n"
        "import matplotlib.pyplot as plt\n"
        "import meshkit\n"
        "# optimizers\n"
        "import optax\n"
        "\n"
        "step = meshkit.pmap_compat(f)\n"
    )


def test_first_of_the_group_takes_its_opening_blank_line():
    src = "import os\n\nimport numpy as np\nfrom flax import jax_utils\n\nx = jax_utils.replicate(1)\n"
    assert fix(src) == (
        "import os\n\nimport meshkit\nimport numpy as np\n\nx = meshkit.replicate(1)\n"
    )


def test_with_no_third_party_import_after_the_stdlib_group_before_local_ones():
    src = (
        '"""Doc."""\n'
        "\n"
        "import os\n"
        "import sys\n"
        "\n"
        "from . import helpers\n"
        "from flax.jax_utils import replicate\n"
        "\n"
        "x = replicate(1)\n"
    )
    assert fix(src) == (
        '"""Doc."""\n'
        "\n"
        "import os\n"
        "import sys\n"
        "\n"
        "import meshkit\n"
        "\n"
        "from . import helpers\n"
        "\n"
        "x = meshkit.replicate(1)\n"
    )


def test_with_no_import_after_the_docstring_and_future_imports():
    src = (
        '"""Doc."""\n'
        "\n"
        "from __future__ import annotations\n"
        "\n"
        "from flax.jax_utils import replicate\n"
        "x = replicate(1)\n"
    )
    assert fix(src) == (
        '"""Doc."""\n'
        "\n"
        "from __future__ import annotations\n"
        "\n"
        "import meshkit\n"
        "\n"
        "x = meshkit.replicate(1)\n"
    )


def test_jax_and_meshkit_both_go_in_alphabetical_order():
    # from jax import tree_map, device_put_replicated: both rewritten, the import dropped, and
    # both jax (for jax.tree.map) and meshkit added in the third-party group.
    src = (
        "import os\n"
        "\n"
        "import numpy as np\n"
        "from jax import device_put_replicated, tree_map\n"
        "\n"
        "x = tree_map(f, device_put_replicated(y, d))\n"
    )
    assert fix(src) == (
        "import os\n"
        "\n"
        "import jax\n"
        "import meshkit\n"
        "import numpy as np\n"
        "\n"
        "x = jax.tree.map(f, meshkit.device_put_replicated(y, d))\n"
    )


def test_an_import_already_there_is_not_added_again():
    src = "import jax\nimport meshkit.cli\n\nstep = jax.pmap(f)\nx = jax.jit(f)\n"
    assert (
        fix(src)
        == "import jax\nimport meshkit.cli\n\nstep = meshkit.pmap_compat(f)\nx = jax.jit(f)\n"
    )
    src = "import jax.numpy\nimport meshkit as mk\nfrom jax import tree_map\n\nx = tree_map(f, y)\n"
    # `import jax.numpy` binds jax: no `import jax`; `import meshkit as mk` binds no meshkit.
    assert fix(src) == "import jax.numpy\nimport meshkit as mk\n\nx = jax.tree.map(f, y)\n"


def test_never_above_a_line_that_sets_up_the_environment():
    src = (
        "import os\n"
        "\n"
        'os.environ["JAX_PLATFORMS"] = "cpu"  # read when jax is imported\n'
        "import jax\n"
        "\n"
        "step = jax.pmap(f)\n"
        "other = jax.jit(f)\n"
    )
    assert fix(src) == (
        "import os\n"
        "\n"
        'os.environ["JAX_PLATFORMS"] = "cpu"  # read when jax is imported\n'
        "import jax\n"
        "import meshkit\n"
        "\n"
        "step = meshkit.pmap_compat(f)\n"
        "other = jax.jit(f)\n"
    )
    src = 'import sys\nsys.path.insert(0, "vendor")\nfrom flax.jax_utils import replicate\nx = replicate(1)\n'
    assert fix(src) == (
        'import sys\nsys.path.insert(0, "vendor")\n\nimport meshkit\n\nx = meshkit.replicate(1)\n'
    )


def test_only_the_leading_import_block_counts():
    # An import after code (a notebook's later cell, a lazy import) is not the group: meshkit
    # must be bound before the code runs.
    src = "import jax\n\nstep = jax.pmap(jax.jit(f))\n\nimport optax\n"
    assert fix(src) == (
        "import jax\nimport meshkit\n\nstep = meshkit.pmap_compat(jax.jit(f))\n\nimport optax\n"
    )


def test_cli_finds_first_party_modules_next_to_the_file(tmp_path, monkeypatch):
    # alocal sorts before meshkit: as a third-party import meshkit would go after it.
    (tmp_path / "alocal.py").write_text("X = 1\n")
    (tmp_path / "apkg").mkdir()
    (tmp_path / "apkg" / "__init__.py").write_text("")
    src = "import jax\nimport alocal\nimport apkg\n\nstep = jax.pmap(jax.jit(f))\n"
    (tmp_path / "train.py").write_text(src)
    (tmp_path / "alone").mkdir()
    (tmp_path / "alone" / "train.py").write_text(src)  # no alocal or apkg next to this one
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("--fix", "--concise", "train.py", "alone/train.py")
    assert (code, err) == (0, "")
    assert (tmp_path / "train.py").read_text() == (
        "import jax\nimport meshkit\nimport alocal\nimport apkg\n\nstep = meshkit.pmap_compat(jax.jit(f))\n"
    )
    assert (tmp_path / "alone" / "train.py").read_text() == (
        "import jax\nimport alocal\nimport apkg\nimport meshkit\n\nstep = meshkit.pmap_compat(jax.jit(f))\n"
    )


def test_cli_first_party_names_from_packages_and_the_scanned_root(tmp_path, monkeypatch):
    # src/mypkg/sub/train.py imports its own top package and a module at the scanned root.
    sub = tmp_path / "src" / "mypkg" / "sub"
    sub.mkdir(parents=True)
    (tmp_path / "src" / "mypkg" / "__init__.py").write_text("")
    (sub / "__init__.py").write_text("")
    (tmp_path / "src" / "atools.py").write_text("")
    src = "import jax\n\nimport atools\nimport mypkg.core\n\nstep = jax.pmap(jax.jit(f))\n"
    (sub / "train.py").write_text(src)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("--fix", "--concise", "src")
    assert (code, err) == (0, "")
    assert (sub / "train.py").read_text() == (
        "import jax\nimport meshkit\n\nimport atools\nimport mypkg.core\n\n"
        "step = meshkit.pmap_compat(jax.jit(f))\n"
    )
