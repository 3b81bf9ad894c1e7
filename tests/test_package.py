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


def test_docstring_examples_run():
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
