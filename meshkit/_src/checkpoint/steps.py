"""Checkpoints by step: ``<root>/step_<n>``, and the latest complete one to resume from.

`meshkit.checkpoint.save` writes a checkpoint into a new directory, which appears only once every
process has written its part (orbax's temporary directory, renamed). With one directory per
step, ``<root>/step_<n>``, the latest *complete* checkpoint is the ``step_<n>`` directory with the
highest ``n``: a save cut short leaves only orbax's temporary directory, which `latest` skips (a
``sorted(glob(...))[-1]`` would pick it). Resuming after a restart (``meshkit launch
--max-restarts``) is then two lines::

    found = meshkit.checkpoint.latest(root)
    state, start = (restore(found.path, mesh), found.step + 1) if found else (init(), 0)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import MeshkitError
from ..core.tracebacks import public

__all__ = ["Latest", "latest", "step_of", "step_path"]

_STEP = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class Latest:
    """The latest complete checkpoint under a root.

    Attributes:
        step: its step number.
        path: its directory, ``<root>/step_<step>``.
    """

    step: int
    path: Path


def step_path(root: str | os.PathLike[str], step: int) -> Path:
    """``<root>/step_<step>``, the directory `latest` finds.

    Examples:
        >>> str(step_path("/ckpt", 12))
        '/ckpt/step_12'
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise MeshkitError(f"meshkit.checkpoint.step_path: step must be an int >= 0; got {step!r}.")
    return Path(os.fspath(root)) / f"step_{step}"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step of a ``step_<n>`` directory, or None for any other name.

    Examples:
        >>> step_of("/ckpt/step_12"), step_of("/ckpt/final")
        (12, None)
    """
    found = _STEP.fullmatch(Path(os.fspath(path)).name)
    return int(found.group(1)) if found else None


@public
def latest(root: str | os.PathLike[str]) -> Latest | None:
    """The complete checkpoint with the highest step under ``root``, or None if there is none.

    Only directories named ``step_<n>`` count (`step_path`); orbax's temporary directories of a
    save that never finished do not. Every process sees the same files, so every process gets
    the same answer (``root`` must be on a filesystem they share, as for `save`).

    Args:
        root: the directory holding ``step_<n>`` checkpoints; it need not exist yet.

    Returns:
        The step and directory of the latest checkpoint, or None (no ``root``, or no complete
        checkpoint in it).

    Examples:
        >>> import tempfile, numpy as np, meshkit
        >>> root = tempfile.mkdtemp()
        >>> meshkit.checkpoint.latest(root) is None
        True
        >>> for step in (2, 10, 4):
        ...     meshkit.checkpoint.save(meshkit.checkpoint.step_path(root, step), {"step": step})
        >>> found = meshkit.checkpoint.latest(root)
        >>> found.step, found.path.name
        (10, 'step_10')
    """
    if not isinstance(root, str | os.PathLike):
        raise MeshkitError(
            f"meshkit.checkpoint.latest: root must be a str or os.PathLike; got "
            f"{type(root).__name__}."
        )
    where = Path(os.path.abspath(os.fspath(root)))
    if not where.is_dir():
        return None
    steps = [step for e in where.iterdir() if e.is_dir() and (step := step_of(e)) is not None]
    return Latest(max(steps), where / f"step_{max(steps)}") if steps else None
