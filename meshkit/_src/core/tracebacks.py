"""Tracebacks of meshkit's errors show the user's frames, not meshkit's own.

`public` marks an entry point: a `MeshkitError` leaving it loses meshkit's frames, as JAX
hides its own (``MESHKIT_TRACEBACK_FILTERING=off`` keeps them). Other exceptions keep theirs.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from . import env as _env
from .errors import MeshkitError
from .frames import meshkit_file

ENV_TRACEBACK_FILTERING = "MESHKIT_TRACEBACK_FILTERING"

P = ParamSpec("P")
R = TypeVar("R")


def public(fn: Callable[P, R]) -> Callable[P, R]:
    """Mark ``fn`` as a public entry point: its `MeshkitError` s show the user's frames."""

    @functools.wraps(fn)
    def entry_point(*args: P.args, **kwargs: P.kwargs) -> R:
        __tracebackhide__ = True  # pytest: this frame is never the interesting one
        try:
            return fn(*args, **kwargs)
        except MeshkitError as e:
            if filtering():
                # Replaced in place, then re-raised bare: a bare raise adds no frame of its own.
                e.with_traceback(filtered(e.__traceback__))
            raise

    return entry_point


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
