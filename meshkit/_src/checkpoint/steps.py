"""Checkpoints by step: ``<root>/step_<n>``, the latest complete one, pruning, `should_save`."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import MeshkitError
from ..core.frames import public
from ..lifecycle import preemption as _preemption

_STEP = re.compile(r"step_(\d+)")
_TMP = re.compile(r"step_(\d+)\.orbax-checkpoint-tmp.*")  # a save not complete (yet)


@dataclass(frozen=True)
class Latest:
    """The latest complete checkpoint under a root.

    Attributes:
        step: its step number.
        path: its directory, ``<root>/step_<step>``.
    """

    step: int
    path: Path


def _below(value: object, least: int) -> bool:
    """Whether ``value`` is not an int >= ``least`` (bools are not ints here)."""
    return isinstance(value, bool) or not isinstance(value, int) or value < least


def abs_path(path: object, what: str, name: str = "path") -> Path:
    """``path`` made absolute; a `MeshkitError` unless it is a str or os.PathLike."""
    if not isinstance(path, str | os.PathLike):
        raise MeshkitError(
            f"{what}: {name} must be a str or os.PathLike; got {type(path).__name__}."
        )
    return Path(os.path.abspath(os.fspath(path)))


def step_path(root: str | os.PathLike[str], step: int) -> Path:
    """``<root>/step_<step>``, the directory `latest` finds.

    Examples:
        >>> str(step_path("/ckpt", 12))
        '/ckpt/step_12'
    """
    if _below(step, 0):
        raise MeshkitError(f"meshkit.checkpoint.step_path: step must be an int >= 0; got {step!r}.")
    return Path(os.fspath(root)) / f"step_{step}"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step of a ``step_<n>`` directory, or None for any other name."""
    found = _STEP.fullmatch(Path(os.fspath(path)).name)
    return int(found.group(1)) if found else None


def _complete(root: Path) -> list[tuple[int, Path]]:
    return sorted(
        (step, e) for e in root.iterdir() if e.is_dir() and (step := step_of(e)) is not None
    )


@public
def latest(root: str | os.PathLike[str]) -> Latest | None:
    """The complete ``step_<n>`` checkpoint with the highest step under ``root``, or None.

    Args:
        root: the directory of ``step_<n>`` checkpoints (`step_path`); it need not exist.

    Returns:
        The step and directory of the latest complete checkpoint, or None.

    Examples:
        >>> import tempfile, meshkit
        >>> root = tempfile.mkdtemp()
        >>> for step in (2, 10, 4):
        ...     meshkit.checkpoint.save(meshkit.checkpoint.step_path(root, step), {"step": step})
        >>> meshkit.checkpoint.latest(root).step
        10
    """
    where = abs_path(root, "meshkit.checkpoint.latest", "root")
    found = _complete(where) if where.is_dir() else []
    return Latest(*found[-1]) if found else None


def check_keep(where: Path, keep: object, what: str) -> None:
    """A `MeshkitError` unless ``keep`` can apply to a save at ``where``."""
    if _below(keep, 1):
        raise MeshkitError(
            f"{what}: keep must be an int >= 1 (the latest steps to keep); got {keep!r}."
        )
    if step_of(where) is None:
        raise MeshkitError(
            f"{what}: keep= needs a step directory, <root>/step_<n>; got {where.name!r}.\n"
            "Consider meshkit.checkpoint.step_path(root, step) as the path."
        )


def prune(root: Path, keep: int) -> None:
    """Delete all but the ``keep`` latest steps, and unfinished saves older than them."""
    complete = _complete(root)
    gone = [e for _, e in complete[:-keep]]
    newest = complete[-1][0] if complete else -1
    for e in root.iterdir():
        found = _TMP.fullmatch(e.name)
        if found and e.is_dir() and int(found.group(1)) <= newest:
            gone.append(e)
    for e in gone:
        shutil.rmtree(e, ignore_errors=True)


@public
def should_save(step: int, *, every: int | None = None) -> bool:
    """Whether to save at ``step``: every ``every`` steps, and once after a preemption notice.

    Call it at every step on every process. After a notice it is true at one step, the same on
    every process, and `save` then ends the program with status 143 (docs/preemption.md).

    Args:
        step: the training step, increasing from call to call.
        every: save at every multiple of ``every`` (not step 0); None: only after a notice.

    Returns:
        Whether to save at ``step``.

    Raises:
        MeshkitError: ``step`` not an int >= 0, ``every`` not an int >= 1.

    Examples:
        >>> import meshkit
        >>> [s for s in range(1, 10) if meshkit.checkpoint.should_save(s, every=4)]
        [4, 8]
    """
    what = "meshkit.checkpoint.should_save"
    if _below(step, 0):
        raise MeshkitError(f"{what}: step must be an int >= 0; got {step!r}.")
    if every is not None and _below(every, 1):
        raise MeshkitError(
            f"{what}: every must be an int >= 1 (save at every multiple of it) or None; got "
            f"{every!r}."
        )
    notice = _preemption.reached_sync_point(step)
    return notice or (every is not None and step > 0 and step % every == 0)
