"""meshkit's public surface: every public name, and its parameters, as committed.

``tests/public_api.txt`` lists each public name of the public modules with its signature (and,
for classes, their public methods and properties). A change to it is a change users see: make
it on purpose, then rewrite the file with ``python tests/test_public_api.py --write``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

PUBLIC_MODULES = (
    "meshkit",
    "meshkit.checkpoint",
    "meshkit.collectives",
    "meshkit.debug",
    "meshkit.loaders",
    "meshkit.testing",
    "meshkit.testing.strategies",
    "meshkit.cli",
)
SNAPSHOT = Path(__file__).with_name("public_api.txt")


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"


def _members(cls: type) -> list[str]:
    rows = []
    for name, value in sorted(vars(cls).items()):
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(value, property):
            rows.append(f"  .{name}: property")
        elif isinstance(value, (staticmethod, classmethod)):
            rows.append(f"  .{name}{_signature(value.__func__)}")
        elif inspect.isfunction(value):
            rows.append(f"  .{name}{_signature(value)}")
    return rows


def _public_names(module: object) -> list[str]:
    """``__all__``, and any other name without an underscore that the module itself defines."""
    names = set(getattr(module, "__all__", ()))
    for name, value in vars(module).items():
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__:
            names.add(name)
    return sorted(names)


def surface() -> list[str]:
    """One line per public name (and per public member of a public class)."""
    rows = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in _public_names(module):
            value = getattr(module, name)
            where = f"{module_name}.{name}"
            if inspect.ismodule(value):
                rows.append(f"{where}: module {value.__name__}")
            elif inspect.isclass(value):
                init = value.__init__ if "__init__" in vars(value) else None
                bases = ", ".join(b.__name__ for b in value.__bases__)
                rows.append(f"{where}: class({bases}){_signature(init) if init else ''}")
                rows.extend(_members(value))
            elif callable(value):
                rows.append(f"{where}{_signature(value)}")
            elif isinstance(value, (str, int, float, tuple)):
                rows.append(f"{where} = {value!r}")
            else:
                rows.append(f"{where}: {type(value).__name__}")
    return rows


def test_the_public_surface_is_as_committed():
    expected = SNAPSHOT.read_text().splitlines()
    now = surface()
    gone = [row for row in expected if row not in now]
    new = [row for row in now if row not in expected]
    changes = [f"- {row}" for row in gone] + [f"+ {row}" for row in new]
    assert not changes, (
        "the public surface changed (- as committed, + now):\n" + "\n".join(changes)
        + "\nIf that is meant, run: python tests/test_public_api.py --write"
    )  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        SNAPSHOT.write_text("\n".join(surface()) + "\n")
    else:
        print("\n".join(surface()))
