"""Whose code a stack frame runs: meshkit's own, a library's, or the user's."""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from types import FrameType

import jax

from . import caches as _caches

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_TESTING = os.path.join(_PACKAGE, "testing") + os.sep
# Frames in these directories are not the user's: JAX's and the standard library's.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f or "")) + os.sep
                      for f in (jax.__file__, contextlib.__file__))  # fmt: skip
# Installed packages: frames there are a library's, for `user_place`.
_INSTALLED_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep
                         for k in ("purelib", "platlib")})  # fmt: skip


def meshkit_file(name: str) -> bool:
    """Whether a code object's file is one of meshkit's own modules (not its testing helpers)."""
    return name.startswith(_PACKAGE) and not name.startswith(_TESTING)


def library_file(name: str) -> bool:
    """Whether a frame's file belongs to meshkit, jax or the standard library."""
    return meshkit_file(name) or name.startswith(_LIBRARY_DIRS) or name.startswith("<")


def in_meshkit(frame: FrameType | None) -> bool:
    """Whether a frame of meshkit's own modules is on the stack from ``frame`` outward."""
    while frame is not None and not meshkit_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` outward that runs the user's code; None if there is none."""
    while frame is not None and library_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def user_place(frame: FrameType | None) -> str | None:
    """Where the user's own code is, from ``frame`` outward: ``train.py:95 in <module>``."""
    first = user_frame(frame)
    seen = first
    while seen is not None:
        name = seen.f_code.co_filename
        if not name.startswith(_INSTALLED_DIRS) and not library_file(name):
            return place(seen)
        seen = seen.f_back
    return None if first is None else place(first)


def user_stacklevel() -> int:
    """The `warnings.warn` ``stacklevel`` that points at the user's line from the caller's."""
    frame: FrameType = sys._getframe(1)
    level = 1
    while frame.f_back is not None and library_file(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level


def short_path(path: str) -> str:
    """``path`` relative to the working directory when inside it."""
    return _short_in(path, os.getcwd())


@_caches.cached(maxsize=1024)
def _short_in(path: str, cwd: str) -> str:
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path, cwd)
        if not rel.startswith(".."):
            return rel
    return path


def place(frame: FrameType | None) -> str:
    """``train.py:28 in main``: where a frame is, as messages name a place; "?" for None."""
    if frame is None:
        return "?"
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
