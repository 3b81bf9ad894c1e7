"""The file system side of ``meshkit migrate``: which files, their text, atomic writes, locals.

A run reads the files named and the ``*.py`` and ``*.ipynb`` files under the directories named
(`discover`), each decoded as Python does (`decode`).

``--fix`` computes every new text before it writes any, then writes each file through a
temporary file in the same directory and `os.replace`: a file is either rewritten whole or
left as it was, whatever fails (a read-only directory, a full disk) and whenever.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
import stat
import tempfile
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", ".ipynb_checkpoints"})
_SUFFIXES = (".py", ".ipynb")


def discover(paths: Sequence[str], exclude: Sequence[str] = ()) -> tuple[list[Path], list[str]]:
    """Files named, and *.py and *.ipynb under directories named, sorted.

    Hidden directories (``.ipynb_checkpoints`` among them) and virtual environments are skipped.

    ``exclude``: fnmatch patterns; a file or directory whose path, as found, or name matches
    one is skipped (a file named on the command line too).
    """
    files: list[Path] = []
    missing: list[str] = []
    for given in paths:
        path = Path(given)
        if _excluded(path, exclude):
            continue
        if path.is_dir():
            files.extend(_walk(path, exclude))
        elif path.is_file():
            files.append(path)
        else:
            missing.append(given)
    seen: set[str] = set()
    unique = []
    for f in files:
        key = os.path.realpath(f)  # never raises: a symlink loop is reported when read
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique, missing


def _walk(root: Path, exclude: Sequence[str] = ()) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".")
            and d not in _SKIP_DIRS
            and not (here / d / "pyvenv.cfg").exists()
            and not _excluded(here / d, exclude)
        )
        for name in sorted(filenames):
            if name.endswith(_SUFFIXES) and not _excluded(here / name, exclude):
                yield here / name


def _excluded(path: Path, patterns: Sequence[str]) -> bool:
    text = path.as_posix()
    return any(fnmatch.fnmatch(text, p) or fnmatch.fnmatch(path.name, p) for p in patterns)


def decode(raw: bytes) -> tuple[str, str]:
    """The text and its encoding (a PEP 263 coding line, a BOM, or UTF-8)."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    text = raw.decode(encoding)
    if encoding == "utf-8-sig":
        text = text.removeprefix("\ufeff")
    return text, encoding


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
