"""Which public function an assembly's messages name; 64-bit data in a 32-bit JAX (`DtypeWarning`).

A narrowing is noted while a part is prepared and warned at the user's line once the call succeeds.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

WHAT = "meshkit.global_array_from_local"  # the default
# (the public function messages name, whether it takes pad=): set by global_batches' helper
# thread, and around spmd's assembly of host arguments.
_caller: contextvars.ContextVar[tuple[str, bool]] = contextvars.ContextVar(
    "meshkit_caller", default=(WHAT, True)
)


def who() -> str:
    """The public meshkit function the current assembly runs for, for messages."""
    return _caller.get()[0]


def pads() -> bool:
    """Whether that function takes ``pad=`` (the fixes for an uneven batch suggest it)."""
    return _caller.get()[1]


@contextlib.contextmanager
def calling(name: str, *, pads: bool) -> Iterator[None]:
    """Name ``name`` in the messages of assemblies inside the block."""
    token = _caller.set((name, pads))
    try:
        yield
    finally:
        _caller.reset(token)


class DtypeWarning(UserWarning):
    """64-bit data was narrowed to 32 bits because JAX's ``jax_enable_x64`` is off.

    Issued once per process and dtype. Pass ``dtype=`` to choose the type explicitly (no
    warning), or enable x64.
    """


DtypeWarning.__module__ = "meshkit"  # shown under the name users import it by

_warned_dtypes: set[tuple[str, str]] = set()  # (from, to) narrowings warned of
Note = tuple[tuple[str, str], str]  # a narrowing's key and its warning's text


def cast(path: str, value: np.ndarray, dtype: Any, notes: list[Note] | None) -> np.ndarray:
    """``value`` in the dtype JAX will use; a narrowing is noted (``notes`` None: silently)."""
    wanted = value.dtype if dtype is None else np.dtype(dtype)
    target = np.dtype(jax.dtypes.canonicalize_dtype(wanted))
    key = (str(wanted), str(target))
    if target != wanted and notes is not None and key not in {*_warned_dtypes, *dict(notes)}:
        source = "dtype=" if dtype is not None else f"the data at {path}"
        notes.append(
            (
                key,
                f"{who()}: {source} is {wanted}, but JAX's 64-bit mode is off, so the "
                f"global array is {target}. (Shown once per dtype.)\nConsider "
                f"dtype={target.name!r} to say so, or jax.config.update('jax_enable_x64', "
                "True) to keep 64 bits.",
            )
        )
    return value if value.dtype == target else value.astype(target)


def warn_notes(notes: list[Note], stacklevel: int) -> None:
    """Issue the dtype notes of an assembly as `DtypeWarning` s at the user's line, once each."""
    for key, text in notes:
        if key not in _warned_dtypes:
            _warned_dtypes.add(key)
            warnings.warn(text, DtypeWarning, stacklevel=stacklevel + 1)
