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
