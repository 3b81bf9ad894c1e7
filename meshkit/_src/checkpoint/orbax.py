"""`meshkit.checkpoint` with orbax: save, restore, targets and the saved data position."""

from __future__ import annotations

import contextlib
import hashlib
import json
import numbers
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..coord import agree as _agree
from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core import env as _env
from ..core import events as _events
from ..core.data_position import DataPosition
from ..core.errors import MeshkitError
from ..core.frames import public
from ..lifecycle import preemption as _preemption
from ..lifecycle import stragglers as _stragglers
from . import data as _data
from . import steps as _steps
from .restore_plan import arrange_like, plan_targets

# orbax's name for a checkpoint directory being written (renamed away when the save commits).
_TMP_MARK = ".orbax-checkpoint-tmp"
# orbax's step metadata file, which holds the checkpoint's custom metadata.
_STEP_METADATA = "_CHECKPOINT_METADATA"

_PROCESS_LOCAL = """\
{what}: {where} is a process-local array: shape {shape} on this process's {count} device{s} \
only, in a program of {n} processes. A checkpoint holds global arrays, each process writing the \
shards its devices hold; orbax refuses an array that one process holds whole ("Cannot serialize \
host local jax.Array"), as every process would write its own value to the same place.
Such arrays are what meshkit.pmap_compat returns by default (global_outputs=False) and what \
jax.pmap and meshkit.unreplicate return in a multi-process run.
Consider pmap_compat(..., global_outputs=True), whose outputs are global arrays (the same \
values); or make one from this process's entries: \
meshkit.global_array_from_local(x, meshkit.make_mesh({{"i": -1}}), "i"); or, for a value that \
is the same on every process, jax.device_get(x) (saved once, as a host array)."""


def _import_orbax(what: str) -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise MeshkitError(
            f"{what} needs orbax-checkpoint, which is not installed ({e}).\n"
            "Consider pip install 'meshkit[orbax]'."
        ) from None
    return ocp


def _digest(value: Any) -> str:
    data = np.ascontiguousarray(value)
    h = hashlib.blake2b(f"{data.dtype.str}{data.shape}".encode(), digest_size=8)
    h.update(memoryview(data).cast("B"))
    return h.hexdigest()


def _tree_entries(tree: Any, what: str) -> list[Any]:
    """The tree's entries in the agreement; a `MeshkitError` at the first leaf not savable."""
    if isinstance(tree, jax.Array | np.ndarray | numbers.Number):
        raise MeshkitError(
            f"{what}: expected a pytree of arrays (a dict, list, dataclass ...); got a single "
            f"{type(tree).__name__}.\nConsider saving {{'x': x}}."
        )
    n = _compat.distributed_state()[2]
    entries: list[Any] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = f"the leaf {jax.tree_util.keystr(path)}"
        if isinstance(leaf, jax.Array):
            text = f"a global array of shape {leaf.shape}, {leaf.dtype}"
            if isinstance(leaf.sharding, NamedSharding):
                text += f", spec {leaf.sharding.spec}"
            entries.append([where, "array", text])
            if n > 1 and leaf.is_fully_addressable:
                count = len(leaf.sharding.device_set)
                s = "s" if count != 1 else ""
                raise MeshkitError(
                    _PROCESS_LOCAL.format(
                        what=what, where=where, shape=leaf.shape, count=count, s=s, n=n
                    )
                )
        elif isinstance(leaf, numbers.Number) or hasattr(leaf, "__array__"):
            host = np.asarray(leaf)
            text = f"a host value of shape {host.shape}, {host.dtype}"
            if not (jax.numpy.issubdtype(host.dtype, jax.numpy.number) or host.dtype == np.bool_):
                raise MeshkitError(
                    f"{what}: {where} is an array of dtype {host.dtype}; a checkpoint holds "
                    "numbers (bool, int, float, complex).\nConsider saving it elsewhere (a JSON "
                    "file beside the checkpoint)."
                )
            entries.append([where, "host", f"{text}, contents digest {_digest(host)}"])
        else:
            raise MeshkitError(
                f"{what}: {where} is a {type(leaf).__name__}; a checkpoint holds jax.Array s, "
                "numpy arrays and numbers.\nConsider saving it elsewhere (a JSON file beside the "
                "checkpoint), or converting it to an array."
            )
    return entries


@contextlib.contextmanager
def _agreement(what: str, tag: str, doing: str) -> Iterator[list[Any]]:
    """Agree on the block's entries and `MeshkitError`; raise any process's on every process.

    Entries are ``[where, kind, words]``. One barrier, before orbax is called, so that no process
    is left waiting inside orbax.
    """
    entries: list[Any] = []
    problem = None
    try:
        yield entries
    except MeshkitError as e:
        problem = str(e)
    if _compat.distributed_state()[2] > 1:
        mine = json.dumps({"entries": entries, "problem": problem}, sort_keys=True)
        timeout = _env.check_timeout()
        outcome = _agree.check(_channel.scoped(tag, what), mine, mine, timeout=timeout, what=what)
        if not outcome.agreed and (outcome.missing or outcome.gave_up):
            gone = (
                f"{_missing.stopped_waiting(outcome.gave_up)} for this process (their wait ran "
                "out before it arrived)"
                if not outcome.missing
                else _missing.did_not(outcome.missing, timeout=timeout, arrive="reach this call")
                + " (the others did)"
            )
            raise MeshkitError(
                f"{what}: {gone}.\nEvery process must {doing}, in the same order.\n"
                f"Consider looking at those processes' output; {_env.ENV_CHECK_TIMEOUT} sets the "
                "wait."
            ) from None
        if not outcome.agreed and problem is None:  # a process with a problem raises its own
            records = {p: json.loads(v) for p, v in sorted(outcome.records.items())}
            for p, record in records.items():
                if record["problem"] is not None:
                    raise MeshkitError(
                        f"{what}: process {p} refused the call:\n{record['problem']}"
                    )
            raise MeshkitError(_difference(what, records, doing))
    if problem is not None:  # raised afresh, as on the other processes
        raise MeshkitError(problem) from None


_SHARED_VALUES = (
    "Consider computing what differs from values every process shares (host values are written "
    "by process 0 alone: any other process's would be lost)."
)
_SHARED_PATH = (
    "Consider a path every process computes the same way, on a filesystem they all see (not "
    "tempfile.mkdtemp() in each process)."
)


def _difference(what: str, records: dict[int, dict[str, Any]], doing: str) -> str:
    """The message naming the first entry where the processes' records differ."""
    rows = {p: [(i, json.dumps(e)) for i, e in enumerate(r["entries"])] for p, r in records.items()}
    _, held = _missing.differences(rows)[0]
    (mine, (p, *_)), (theirs, (q, *_)) = list(held.items())[:2]
    if _missing.ABSENT in (mine, theirs):
        count = {p: sum(e[1] != "path" for e in r["entries"]) for p, r in records.items()}
        return (
            f"{what}: process {p} has {count[p]} leaves, process {q} has {count[q]}.\n"
            f"Every process must {doing}."
        )
    x, y = json.loads(mine), json.loads(theirs)
    fix = {"path": _SHARED_PATH, "data": _data.DATA_FIX}.get(x[1], _SHARED_VALUES)
    return (
        f"{what}: processes {p} and {q} differ at {x[0]}: {x[-1]} on process {p}, {y[-1]} on "
        f"process {q}.\nEvery process must {doing}.\n{fix}"
    )


@public
def check_savable(tree: Any) -> None:
    """Check that every process can save ``tree`` with orbax, and that they save the same tree.

    `save`'s check, for orbax's own ``CheckpointManager.save``. Every process must call it; they
    agree on the verdict (one barrier), so all go on or all raise.

    Args:
        tree: the pytree to save.

    Raises:
        MeshkitError: a process-local array, a leaf that is not an array or a number, or
            processes that differ (naming the first leaf that differs).

    Examples:
        >>> import numpy as np, meshkit
        >>> meshkit.checkpoint.check_savable({"w": meshkit.replicate(np.ones(3)), "step": 1})
    """
    what = "meshkit.checkpoint.check_savable"
    with _agreement(what, "checkpoint/check", "save the same tree") as entries:
        entries += _tree_entries(tree, what)


@public
def save(
    path: str | os.PathLike[str], tree: Any, *, keep: int | None = None, data: Any = None
) -> None:
    """Save ``tree`` to the new directory ``path``, in every process; return once it is complete.

    Each process writes the blocks its devices hold, process 0 the host values; ``path`` appears
    only once every process has written its part.

    Args:
        path: a new directory, on a filesystem every process sees.
        tree: a pytree of ``jax.Array`` s, numpy arrays and numbers.
        keep: with ``path`` a `step_path`, keep only the ``keep`` latest steps beside it.
        data: the `meshkit.GlobalBatches` that fed the step (or a `meshkit.DataPosition`), whose
            position is saved with it (`data_position`).

    Raises:
        MeshkitError: what `check_savable` finds, ``path`` exists, a bad ``keep`` or ``data``;
            on every process, before anything is written.
        SystemExit: status 143, after the save at a preemption sync point (`should_save`).

    Examples:
        >>> import numpy as np, meshkit, tempfile
        >>> path = tempfile.mkdtemp() + "/step_1"
        >>> meshkit.checkpoint.save(path, {"w": meshkit.replicate(np.ones(3)), "step": 1})
    """
    what = "meshkit.checkpoint.save"
    ocp = _import_orbax(what)
    since = _stragglers.clock()
    where = _steps.abs_path(path, what)
    with _agreement(what, "checkpoint/save", "save the same tree") as entries:
        entries += [["the directory", "path", str(where)], ["keep=", "keep", str(keep)]]
        entries += _tree_entries(tree, what)
        if where.exists():
            raise MeshkitError(
                f"{what}: {where} exists already; a checkpoint goes to a new directory, so that "
                "an earlier one is never overwritten by a save that may not finish.\n"
                "Consider one directory per step (f'{root}/step_{step}'), or orbax's "
                "CheckpointManager, which numbers the steps and keeps the last few."
            )
        if keep is not None:
            _steps.check_keep(where, keep, what)
        shared = _data.share(data, where, what)
        entries.append(shared.entry)  # the data position's common part, compared with the rest
    with _preemption.saving(), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(where, tree, **shared.metadata())  # a preemption deadline waits
        checkpointer.wait_until_finished()
    step, spent = _steps.step_of(where), _stragglers.checkpointed("saving", since)
    _events.emit(_events.SAVED, step=step, **spent)  # for meshkit launch's report
    if keep is not None and _compat.distributed_state()[1] == 0:
        _steps.prune(where.parent, keep)
    _preemption.saved(step)  # after a preemption sync point: SystemExit(143)


def _check_complete(where: Path, what: str) -> None:
    """A `MeshkitError` unless ``where`` holds a complete StandardCheckpointer checkpoint."""
    if _TMP_MARK in where.name:
        raise MeshkitError(
            f"{what}: {where} is a checkpoint that was never completed (orbax's temporary "
            "directory: a save whose process failed, or one still being written).\n"
            f"Consider the last complete checkpoint beside it (a directory without "
            f"'{_TMP_MARK}' in its name); orbax's CheckpointManager lists only complete steps."
        )
    if not where.is_dir():
        missing = where
        while not missing.parent.exists() and missing.parent != missing:
            missing = missing.parent  # the first part of the path that is not there
        tmp = sorted(p.name for p in missing.parent.glob(missing.name + _TMP_MARK + "*"))
        why = f"; only {tmp[0]!r} is there, a save of it that never completed" if tmp else ""
        raise MeshkitError(
            f"{what}: there is no checkpoint at {where}{why}.\n"
            "Consider the path given to save (orbax's CheckpointManager: "
            "manager.directory / str(step) / 'default', or targets(manager.item_metadata(step)))."
        )
    if not (where / "_METADATA").exists():
        items = sorted(p.name for p in where.iterdir() if (p / "_METADATA").exists())
        hint = (
            f"Consider {str(where / items[0])!r}, the item directory inside it."
            if items
            else "Consider the directory given to meshkit.checkpoint.save or to orbax's save."
        )
        raise MeshkitError(
            f"{what}: {where} is not a checkpoint of orbax's StandardCheckpointer (it has no "
            f"_METADATA file).\n{hint}"
        )


@public
def targets(source: Any, mesh: Mesh, specs: Any = None) -> Any:
    """The restore targets of a checkpoint on ``mesh``, checked: what orbax's restore takes.

    Arrays become ``jax.ShapeDtypeStruct`` s with a ``NamedSharding(mesh, spec)``; host values stay
    host values. Every process must call it; they agree on the verdict (one barrier).

    Args:
        source: the checkpoint's directory, its metadata (``manager.item_metadata(step)``), or an
            abstract tree like it.
        mesh: the mesh to restore onto, with devices of every process.
        specs: None (as saved), one spec for every array, or a pytree prefix of specs.

    Returns:
        A pytree shaped like the checkpoint's.

    Raises:
        MeshkitError: an array that cannot be laid out on ``mesh``, a mesh that leaves out a
            process, ``specs`` that do not fit, no complete checkpoint.

    Examples:
        >>> import numpy as np, meshkit, tempfile
        >>> path = tempfile.mkdtemp() + "/c"
        >>> meshkit.checkpoint.save(path, {"w": meshkit.replicate(np.ones(3, np.float32))})
        >>> meshkit.checkpoint.targets(path, meshkit.make_mesh({"x": -1}), "x")["w"].shape
        (8, 3)
    """
    return _targets(source, mesh, specs, "meshkit.checkpoint.targets")


def _targets(source: Any, mesh: Any, specs: Any, what: str, like: Any = None) -> Any:
    with _agreement(what, "checkpoint/restore", "restore the same way") as entries:
        if isinstance(source, str | os.PathLike):
            where = _steps.abs_path(source, what)
            entries.append(["the directory", "path", str(where)])
            ocp = _import_orbax(what)
            _check_complete(where, what)
            with ocp.StandardCheckpointer() as checkpointer:
                source = checkpointer.metadata(where)
        source = getattr(source, "item_metadata", source)  # orbax's StepMetadata holds a tree
        if hasattr(source, "tree") and hasattr(source, "custom_metadata"):  # orbax's TreeMetadata
            source = source.tree
        tree, found = plan_targets(source, mesh, specs, what)
        entries += found
        if like is not None:
            tree = arrange_like(tree, like, what)
            entries.append(["like=", "structure", str(jax.tree_util.tree_structure(like))])
    return tree


@public
def restore(
    path: str | os.PathLike[str], mesh: Mesh, specs: Any = None, *, like: Any = None
) -> Any:
    """Read the checkpoint at ``path`` onto ``mesh``: global arrays laid out by ``specs``.

    The mesh and process count may differ from the save's; everything is checked first (`targets`).

    Args:
        path: a directory written by `save` or orbax's ``StandardCheckpointer``.
        mesh: the mesh to restore onto, with devices of every process.
        specs: as in `targets`.
        like: a template of the saved tree: the result takes its structure (optax, flax ``nnx``,
            dataclasses). Default: dicts and lists.

    Returns:
        The checkpoint's tree: global ``jax.Array`` s on ``mesh``, host values as saved.

    Raises:
        MeshkitError: as `targets`; an unfinished save; a ``like`` that does not match.

    Examples:
        >>> import numpy as np, meshkit, tempfile
        >>> path = tempfile.mkdtemp() + "/c"
        >>> mesh = meshkit.make_mesh({"data": 2, "model": 4})
        >>> w = meshkit.global_array_from_local(np.ones((8, 8), np.float32), mesh, "data model")
        >>> meshkit.checkpoint.save(path, {"w": w, "step": 1})
        >>> meshkit.checkpoint.restore(path, meshkit.make_mesh({"data": 8, "model": 1}))["step"]
        1
    """
    what = "meshkit.checkpoint.restore"
    ocp = _import_orbax(what)
    since = _stragglers.clock()
    where = _steps.abs_path(path, what)
    tree = _targets(where, mesh, specs, what, like)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(where, tree)
    # For meshkit launch's report of a restart: which step, and what the restore cost.
    spent = _stragglers.checkpointed("restoring", since)
    _events.emit(_events.RESTORED, step=_steps.step_of(where), **spent)
    return restored


@public
def data_position(path: str | os.PathLike[str], *, missing_ok: bool = False) -> DataPosition | None:
    """The `meshkit.DataPosition` saved with the checkpoint at ``path`` (``save(data=...)``).

    Reads the metadata only; pass it to ``meshkit.global_batches(..., start=position)``.

    Args:
        path: a checkpoint directory written by `save`.
        missing_ok: return None for a checkpoint saved without ``data=`` instead of raising.

    Returns:
        A `meshkit.DataPosition`, or None (none saved, with ``missing_ok``).

    Raises:
        MeshkitError: no complete checkpoint at ``path``; none saved (unless ``missing_ok``).

    Examples:
        >>> import numpy as np, meshkit, tempfile
        >>> path = tempfile.mkdtemp() + "/c"
        >>> meshkit.checkpoint.save(path, {"step": 1}, data=meshkit.DataPosition(step=1))
        >>> meshkit.checkpoint.data_position(path).step
        1
    """
    what = "meshkit.checkpoint.data_position"
    ocp = _import_orbax(what)
    where = _steps.abs_path(path, what)
    if not isinstance(missing_ok, bool):
        raise MeshkitError(f"{what}: missing_ok must be True or False; got {missing_ok!r}.")
    _check_complete(where, what)
    value = None
    if (where / _STEP_METADATA).is_file():
        value = _data.from_metadata(ocp.metadata.get_step_metadata(where).custom_metadata)
    if value is not None:
        return DataPosition._read(value, what)
    if missing_ok:
        return None
    raise MeshkitError(
        f"{what}: the checkpoint at {where} was saved without a data position (no data= "
        "given to meshkit.checkpoint.save), so nothing says which batch comes next.\n"
        "Consider meshkit.checkpoint.save(path, tree, data=batches) with the "
        "meshkit.global_batches iterator that fed the step; for this checkpoint, "
        "data_position(path, missing_ok=True) gives None, and start=None starts the data "
        "from its beginning."
    )
