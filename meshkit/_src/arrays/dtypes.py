"""64-bit data in a 32-bit JAX: the cast, and the `DtypeWarning` shown once per dtype.

A narrowing is noted while a process's part is prepared and issued by the caller of the
assembly (`warn_notes`), at the user's line, once the part is known to be sound: a call that
fails before leaves the warning to the next one.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from .entry_point import who

__all__ = ["DtypeWarning", "Note", "cast", "note_narrowing", "warn_notes"]


class DtypeWarning(UserWarning):
    """64-bit data was narrowed to 32 bits because JAX's ``jax_enable_x64`` is off.

    Issued once per process and dtype. Pass ``dtype=`` to choose the type explicitly (no
    warning), or enable x64.
    """


DtypeWarning.__module__ = "meshkit"  # shown under the name users import it by


_warned_dtypes: set[tuple[str, str]] = set()  # (from, to) narrowings warned of
Note = tuple[tuple[str, str], str]  # a narrowing's key and its warning's text


def cast(path: str, value: np.ndarray, dtype: Any, notes: list[Note] | None) -> np.ndarray:
    """``value`` in the dtype JAX will use; a narrowing to 32 bits is noted once per dtype.

    ``notes`` None: narrow silently, as `jax.jit` does with host arguments (`meshkit.spmd`).
    """
    wanted = value.dtype if dtype is None else np.dtype(dtype)
    target = np.dtype(jax.dtypes.canonicalize_dtype(wanted))
    if target != wanted and notes is not None:
        note_narrowing(path, wanted, target, dtype is not None, notes)
    return value if value.dtype == target else value.astype(target)


def note_narrowing(
    path: str, wanted: np.dtype, target: np.dtype, given: bool, notes: list[Note]
) -> None:
    """Note a narrowing to 32 bits, unless this process has shown it for this dtype already.

    Marked as shown only when `warn_notes` issues it: a call that fails after preparing (a
    check, a transfer) leaves the warning to the next call.
    """
    key = (str(wanted), str(target))
    if key not in _warned_dtypes and all(k != key for k, _ in notes):
        source = "dtype=" if given else f"the data at {path}"
        notes.append(
            (
                key,
                f"{who()}: {source} is {wanted}, but JAX's 64-bit mode is off, so the "
                f"global array is {target}. (Shown once per dtype.)\nConsider "
                f"dtype={target.name!r} to say so, or jax.config.update('jax_enable_x64', "
                "True) to keep 64 bits.",
            )
        )


def warn_notes(notes: list[Note], stacklevel: int) -> None:
    """Issue the dtype notes of an assembly as `DtypeWarning` s at the user's line, once each."""
    for key, text in notes:
        if key not in _warned_dtypes:
            _warned_dtypes.add(key)
            warnings.warn(text, DtypeWarning, stacklevel=stacklevel + 1)
