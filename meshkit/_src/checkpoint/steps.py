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
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import MeshkitError
from ..core.tracebacks import public
from ..lifecycle import preemption as _preemption

__all__ = ["Latest", "keep_problem", "latest", "prune", "should_save", "step_of", "step_path"]

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


def keep_problem(where: Path, keep: object, what: str) -> str | None:
    """Why ``keep`` cannot apply to a save at ``where``, or None."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        return f"{what}: keep must be an int >= 1 (the latest steps to keep); got {keep!r}."
    if step_of(where) is None:
        return (
            f"{what}: keep= needs a step directory, <root>/step_<n>; got {where.name!r}.\n"
            "Consider meshkit.checkpoint.step_path(root, step) as the path."
        )
    return None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` latest complete steps under ``root``; what was deleted.

    The temporary directories of saves that never completed go too, unless they belong to a
    step newer than the latest complete one (a save still going on).

    Examples:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> for name in ("step_1", "step_2", "step_3", "step_2.orbax-checkpoint-tmp-1"):
        ...     (root / name).mkdir()
        >>> sorted(p.name for p in prune(root, 2))
        ['step_1', 'step_2.orbax-checkpoint-tmp-1']
    """
    complete = sorted(
        (step, e) for e in root.iterdir() if e.is_dir() and (step := step_of(e)) is not None
    )
    gone = [e for _, e in complete[:-keep]]
    newest = complete[-1][0] if complete else -1
    for e in root.iterdir():
        found = _TMP.fullmatch(e.name)
        if found and e.is_dir() and int(found.group(1)) <= newest:
            gone.append(e)
    for e in gone:
        shutil.rmtree(e, ignore_errors=True)
    return gone


@public
def should_save(step: int, *, every: int | None = None) -> bool:
    """Whether to save at ``step``: every ``every`` steps, and once after a preemption notice.

    Call it at every step, on every process, with the same increasing steps; it answers the
    same on every process. After a preemption notice (SIGTERM from a scheduler, to any of the
    processes) it is true at one step, the same on every process: the step after the last one
    any process asked about when the notice came (the processes agree on it once,
    `meshkit._src.coord.save_step`; the first step asked, when the notice came while they
    joined or restored). A `save` made then ends the program once it is complete, with status
    143 (``SystemExit(143)``): the scheduler starts the run again, and `latest` finds that
    step. Without a notice it costs no round trip; see the "Preemption and resume" docs.

    Notices are taken by `meshkit.init` (which turns SIGTERM into one; see "What meshkit.init
    installs"). In a process that never called it, ``should_save`` takes nothing over: it is
    true at the multiples of ``every`` only, and SIGTERM keeps the program's handler or
    Python's default.

    Args:
        step: the training step, increasing from call to call.
        every: save at every multiple of ``every`` (step 0 excepted); None: only after a notice.

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
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise MeshkitError(f"{what}: step must be an int >= 0; got {step!r}.")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise MeshkitError(
            f"{what}: every must be an int >= 1 (save at every multiple of it) or None; got "
            f"{every!r}."
        )
    notice = _preemption.reached_sync_point(step)
    return notice or (every is not None and step > 0 and step % every == 0)
