"""The house rules: packages import downward only, no import cycles, modules stay readable.

meshkit's implementation lives in ``meshkit/_src/<package>/``, one package per concept, stacked
in layers (``docs/architecture.md`` draws them). A module may import from its own package and
from packages on lower layers, never from a sibling on its own layer or from above; imports under
``TYPE_CHECKING`` and inside functions count too. The public faces (``meshkit/*.py``,
``meshkit/cli``, ``meshkit/testing``) stand on top and may import anything below them.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

import meshkit

PACKAGE = Path(meshkit.__file__).parent

# Lowest first. Packages on one line share a layer and must not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("core",),
    ("lifecycle",),
    ("coord", "launch", "migrate"),
    ("debug",),
    ("runtime",),
    ("sharding",),
    ("arrays", "checkpoint", "loaders"),
    ("spmd",),
    ("pmap",),
]
LAYER = {package: level for level, names in enumerate(LAYERS) for package in names}
FACES = len(LAYERS)

MAX_FLAT_FILES = 10
MAX_MODULE_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every meshkit module ``name`` imports, wherever the import stands in the file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                full = f"{prefix}.{alias.name}"
                found.add(full if full in modules else prefix)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> tuple[int, str]:
    """(layer, package) of a module: faces are the top layer."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "_src":
        return LAYER[parts[2]], parts[2]
    return FACES, "faces"


def test_every_package_has_a_layer():
    packages = {p.name for p in (PACKAGE / "_src").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYER), "add new packages to LAYERS (and docs/architecture.md)"


def test_packages_import_downward_only():
    wrong = []
    for source, targets in sorted(_graph().items()):
        level, package = _layer(source)
        for target in sorted(targets):
            to_level, to_package = _layer(target)
            if to_package == package:
                continue
            if to_level >= level:
                wrong.append(f"{source} ({package}, layer {level}) imports {target} "
                             f"({to_package}, layer {to_level})")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = itertools.count()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = next(counter)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_at_most_ten_files_flat_in_the_package():
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= MAX_FLAT_FILES, flat


@pytest.mark.parametrize("module", sorted(_modules()))
def test_modules_stay_readable(module):
    lines = len(_modules()[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines; split it by idea"


COMPAT = "meshkit._src.core.compat"  # the one module that touches JAX's internals


def _jax_internals(path: Path) -> list[str]:
    """What ``path`` reaches of ``jax._src`` or ``jaxlib``: imports, ``import_module``, ``jax._src``."""
    private = ("jax._src", "jaxlib")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and node.attr == "_src":
            if isinstance(node.value, ast.Name) and node.value.id == "jax":
                names = ["jax._src"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else ""
            callee = node.func.id if isinstance(node.func, ast.Name) else callee
            if callee in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [
            f"line {getattr(node, 'lineno', '?')}: {n}" for n in names if n.startswith(private)
        ]
    return sorted(set(found))


def test_only_compat_touches_jax_internals():
    wrong = {
        module: hits
        for module, path in sorted(_modules().items())
        if module != COMPAT and (hits := _jax_internals(path))
    }
    assert not wrong, f"move these into {COMPAT}, with the reason and the JAX versions: {wrong}"


def test_compat_names_each_internal_it_imports():
    """Each ``_module("jax._src....name")`` of compat is listed, with its reason, up top."""
    path = _modules()[COMPAT]
    tree = ast.parse(path.read_text())
    listed = ast.get_docstring(tree) or ""
    imported = {
        node.args[0].value.rpartition(".")[2]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "_module"
        and isinstance(node.args[0], ast.Constant)
        and str(node.args[0].value).startswith("jax._src")
    }
    assert imported, "compat imports no JAX internals: is the check still looking?"
    missing = sorted(name for name in imported if not re.search(rf"\b{name}\b", listed))
    assert not missing, f"{COMPAT}'s docstring does not list {missing}"
