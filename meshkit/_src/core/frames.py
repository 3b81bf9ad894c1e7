"""Whose code a stack frame runs (meshkit's own, a library's, or the user's), and on which thread.

The program's thread is the one that called `meshkit.init` (the main thread before that): calls
pair up across processes in its order (Ray Train runs the program in a worker thread), and only
the main thread may take signals.

`public` marks an entry point: a `MeshkitError` leaving it loses meshkit's frames, as JAX
hides its own (``MESHKIT_TRACEBACK_FILTERING=off`` keeps them). Other exceptions keep theirs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import threading
import types
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import jax

from . import caches as _caches
from . import env as _env
from .errors import MeshkitError

ENV_TRACEBACK_FILTERING = "MESHKIT_TRACEBACK_FILTERING"
P = ParamSpec("P")
R = TypeVar("R")

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


def in_meshkit(frame: types.FrameType | None) -> bool:
    """Whether a frame of meshkit's own modules is on the stack from ``frame`` outward."""
    while frame is not None and not meshkit_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None


def user_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The first frame from ``frame`` outward that runs the user's code; None if there is none."""
    while frame is not None and library_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def user_place(frame: types.FrameType | None) -> str | None:
    """Where the user's own code is, from ``frame`` outward: ``train.py:95 in <module>``."""
    first = seen = user_frame(frame)
    while seen is not None and seen.f_code.co_filename.startswith(_INSTALLED_DIRS):
        seen = user_frame(seen.f_back)
    return None if first is None else place(seen or first)


def user_stacklevel() -> int:
    """The `warnings.warn` ``stacklevel`` that points at the user's line from the caller's."""
    frame: types.FrameType = sys._getframe(1)
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


def place(frame: types.FrameType | None) -> str:
    """``train.py:28 in main``: where a frame is, as messages name a place; "?" for None."""
    if frame is None:
        return "?"
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def public(fn: Callable[P, R]) -> Callable[P, R]:
    """Mark ``fn`` as a public entry point: its `MeshkitError` s show the user's frames."""

    @functools.wraps(fn)
    def entry_point(*args: P.args, **kwargs: P.kwargs) -> R:
        __tracebackhide__ = True  # pytest: this frame is never the interesting one
        try:
            return fn(*args, **kwargs)
        except MeshkitError as e:
            hide_frames(e)
            raise  # bare: a bare raise adds no frame of its own

    return entry_point


def hide_frames(e: BaseException) -> None:
    """Drop meshkit's frames from ``e``'s traceback in place (unless filtering is off).

    For an entry point that cannot afford `public`'s wrapper frame: it catches `MeshkitError`
    itself, calls this, and re-raises bare.
    """
    if filtering():
        e.with_traceback(filtered(e.__traceback__))


def filtered(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the frames of meshkit's own modules (the others, in their order)."""
    kept = []
    while tb is not None:
        if not meshkit_file(tb.tb_frame.f_code.co_filename):
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for entry in reversed(kept):
        out = types.TracebackType(out, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return out


def filtering() -> bool:
    """Whether meshkit's frames are hidden (``MESHKIT_TRACEBACK_FILTERING``, on by default)."""
    on, off = "hide meshkit's frames, the default", "show every frame"
    return bool(_env.flag(ENV_TRACEBACK_FILTERING, where="meshkit", on=on, off=off, blank=True))


_thread: threading.Thread | None = None


def adopt_program_thread() -> None:
    """Make the calling thread the program's thread (at `meshkit.init`; the first call wins)."""
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.current_thread()


def program_thread() -> threading.Thread:
    """The thread whose calls pair up with the other processes' without a channel."""
    thread = _thread
    return thread if thread is not None and thread.is_alive() else threading.main_thread()


def is_program_thread() -> bool:
    return threading.current_thread() is program_thread()
