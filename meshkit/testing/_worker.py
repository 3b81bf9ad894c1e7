"""One rank of `meshkit.testing.run_in_processes`: import the function, call it, save.

Usage: ``python -m meshkit.testing._worker FILE QUALNAME OUT_DIR --init|--no-init``.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load_module(file: str) -> ModuleType:
    """Import the module at ``file`` under a private name, its folder first on ``sys.path``.

    The name differs from the one the test process gave it, so a module that is also a test
    file is imported as a plain module here (no pytest collection).
    """
    path = Path(file)
    sys.path.insert(0, str(path.parent))
    name = f"_meshkit_worker_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def attribute(module: ModuleType, qualname: str) -> Any:
    """``module.<qualname>``, following the dots of a qualified name."""
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: list[str]) -> None:
    """Load ``QUALNAME`` from ``FILE``, call it, pickle the result to ``OUT_DIR/rank<r>.pkl``."""
    file, qualname, out_dir, flag = argv
    if flag == "--init":
        import meshkit

        meshkit.init()
    value = attribute(load_module(file), qualname)()
    rank = os.environ.get("MESHKIT_PROCESS_ID", "0")
    tmp = Path(out_dir) / f".rank{rank}.pkl"
    tmp.write_bytes(pickle.dumps(value))
    tmp.rename(Path(out_dir) / f"rank{rank}.pkl")


if __name__ == "__main__":
    main(sys.argv[1:])
