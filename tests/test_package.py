"""The installed package: public names, docstrings and their examples, console script."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import meshkit
import meshkit.testing


def test_tests_run_against_the_installed_package():
    if os.environ.get("MESHKIT_EXPECT_INSTALLED") != "1":
        pytest.skip("only meaningful under nox, which installs meshkit into its own venv")
    assert "site-packages" in Path(meshkit.__file__).parts, meshkit.__file__


def test_typed_marker_ships():
    assert (Path(meshkit.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize("module", [meshkit, meshkit.testing])
def test_public_names_are_exported_and_documented(module):
    for name in module.__all__:
        obj = getattr(module, name)
        assert inspect.getdoc(obj), f"{module.__name__}.{name} has no docstring"


def _modules():
    for info in pkgutil.walk_packages(meshkit.__path__, "meshkit."):
        if info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


# Modules whose examples need an optional package (an extra); skipped without it, except in CI.
_EXAMPLES_NEED = {
    "meshkit.checkpoint": "orbax.checkpoint",
    "meshkit._src.checkpoint.orbax": "orbax.checkpoint",
}


def _runs_examples(module) -> bool:
    needs = _EXAMPLES_NEED.get(module.__name__)
    if needs is None or os.environ.get("MESHKIT_REQUIRE_EXTRAS") == "1":
        return True
    return importlib.util.find_spec(needs.split(".")[0]) is not None


def test_docstring_examples_run(tmp_path, monkeypatch):
    # The examples make directories with tempfile, as a user would: here they go under tmp_path.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=flags)
    examples = 0
    for module in filter(_runs_examples, _modules()):
        for test in finder.find(module, module.__name__):
            examples += len(test.examples)
            runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0
    assert examples >= 4  # init, make_mesh, describe, order_devices


def test_version_flag():
    out = subprocess.run(
        [sys.executable, "-m", "meshkit", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert out.stdout.strip() == f"meshkit {meshkit.__version__}"


def test_meshkit_info_shows_the_versions_the_preflight_compares():
    import importlib.metadata
    import platform

    import jax

    from meshkit._src.runtime import programs

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-m", "meshkit", "info"], capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "compared by the processes at meshkit.init (the preflight):" in text, text
    versions = (
        f"  python {platform.python_version()}, jax {jax.__version__}, "
        f"jaxlib {importlib.metadata.version('jaxlib')}, meshkit {meshkit.__version__}"
    )
    assert versions in text.splitlines(), text
    assert f"  {len(programs.settings())} jax.config settings:" in text, text
    for name in programs.settings():
        assert f"{name}=" in text, (name, text)
    assert "  a warning only where they differ: XLA_FLAGS=" in text, text


def test_console_script_and_module_entry():
    exe = shutil.which("meshkit")
    if exe is not None:
        out = subprocess.run([exe, "launch", "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0
        assert "--devices-per-process" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "meshkit", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "launch" in out.stdout
    assert "info" in out.stdout


def _fresh_python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd
    )


_NO_JAX = "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"


def test_the_launcher_and_the_command_import_no_jax(tmp_path):
    (tmp_path / "prog.py").write_text("print('ran')\n")
    out = _fresh_python(
        "import sys, contextlib\n"
        "import meshkit, meshkit.cli\n"
        "from meshkit._src.launch import launcher, rank_output, reaper, report, spawn, stop\n"
        "from meshkit._src.launch import supervise\n"
        "from meshkit._src.core import events\n"
        "meshkit.launch, meshkit.LaunchResult, meshkit.RankResult, meshkit.MeshkitError\n"
        f"{_NO_JAX}\n"
        "for argv in (['launch', '--help'], ['migrate', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(None):\n"
        "        meshkit.cli.main(argv)\n"
        f"{_NO_JAX}\n"
        "assert meshkit.cli.main(['launch', '-n', '2', '--platform', 'cpu', '--allow-unjoined', "
        "'prog.py']) == 0\n"
        f"{_NO_JAX}\n",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank0] ran", "[rank1] ran"], out.stdout


def test_the_lazy_face_gives_every_public_name():
    out = _fresh_python(
        "import sys\n"
        "import meshkit\n"
        f"{_NO_JAX}\n"
        "assert set(meshkit.__all__) <= set(dir(meshkit))\n"
        "scope = {}\n"
        "exec('from meshkit import *', scope)\n"
        "missing = set(meshkit.__all__) - set(scope)\n"
        "assert not missing, missing\n"
        "assert 'jax' in sys.modules\n"
        "assert scope['init'] is meshkit.init and scope['debug'] is meshkit.debug\n"
        "assert meshkit.barrier is meshkit.debug.barrier\n"
        "try:\n"
        "    meshkit.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert str(e) == \"module 'meshkit' has no attribute 'no_such_name'\", e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    assert out.returncode == 0, out.stderr


def test_a_name_that_leads_to_jax_loads_its_own_modules_only():
    # Debug mode needs no face imported to be wired: `init` and the first SPMD call decide it
    # from MESHKIT_DEBUG (tests/test_debug.py), so `meshkit.spmd` does not bring the face along.
    out = _fresh_python(
        "import sys\nimport meshkit\nmeshkit.spmd\nassert 'meshkit.debug' not in sys.modules\n"
    )
    assert out.returncode == 0, out.stderr
