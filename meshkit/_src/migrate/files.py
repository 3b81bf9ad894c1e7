"""The file system side of ``meshkit migrate``: atomic writes, and which modules are local.

``--fix`` computes every new text before it writes any, then writes each file through a
temporary file in the same directory and `os.replace`: a file is either rewritten whole or
left as it was, whatever fails (a read-only directory, a full disk) and whenever.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["FirstParty", "write_atomic"]


def write_atomic(path: Path, data: bytes) -> None:
    """Replace the file's content with ``data`` at once, keeping its permission bits.

    The bytes go to a temporary file next to the file (the link's target, for a symbolic
    link, so the link stays a link), which then replaces it: a reader sees the old content or
    the new, never a part. Owner and group are those of a new file of the user's.

    Args:
        path: an existing file.
        data: its new content.

    Raises:
        OSError: the file cannot be replaced (a read-only directory, a full disk); the file
            is unchanged and no temporary file is left.
    """
    target = Path(os.path.realpath(path))
    mode = stat.S_IMODE(target.stat().st_mode)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class FirstParty:
    """The top-level module names local to a file: isort's first-party section.

    A name is local when it is a module (``x.py``) or a package (a directory with
    ``__init__.py``) next to the file, next to the top package the file is in, or at the root
    of a directory given on the command line. Directories are listed once per run.

    Args:
        roots: the directories given on the command line.
    """

    def __init__(self, roots: Iterable[Path] = ()) -> None:
        self._listed: dict[Path, frozenset[str]] = {}
        self._roots = list(roots)

    def names(self, path: Path) -> frozenset[str]:
        """The top-level names local to the file at ``path``."""
        here = path.parent
        names = {n for root in self._roots for n in self._modules(root)}
        names |= self._modules(here)
        top = here
        while (top / "__init__.py").is_file() and top.parent != top:
            top = top.parent
        if top != here:
            names |= self._modules(top)
        return frozenset(names)

    def _modules(self, directory: Path) -> frozenset[str]:
        key = Path(os.path.abspath(directory))
        if key not in self._listed:
            found: set[str] = set()
            try:
                entries = list(os.scandir(key))
            except OSError:  # unreadable: nothing known there
                entries = []
            for entry in entries:
                name = entry.name
                with contextlib.suppress(OSError):
                    if name.endswith(".py") and entry.is_file():
                        found.add(name[:-3])
                    elif entry.is_dir() and (Path(entry.path) / "__init__.py").is_file():
                        found.add(name)
            self._listed[key] = frozenset(n for n in found if n.isidentifier())
        return self._listed[key]
