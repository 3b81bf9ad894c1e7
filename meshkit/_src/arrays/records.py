"""The records processes exchange to agree on an assembly (`PartRecord`), and their comparison."""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from ..coord import agree as _agree
from ..coord import missing as _missing
from ..coord.node import Outcome
from ..core import env as _env
from ..core.errors import DivergenceError, MeshkitError

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


_SAME_CALLS = (
    "Every process must make the same calls in the same order (a process that stopped, "
    "crashed, or took another branch never arrives)."
)


def raise_absent(
    outcome: Outcome, what: str, timeout: float, *, arrive: str = "arrive",
    did: str = "; the others did", rule: str = _SAME_CALLS,
) -> None:  # fmt: skip
    """Raise naming the processes that did not come, or that stopped waiting for this one."""
    if outcome.missing:
        gone = _missing.did_not(outcome.missing, timeout=timeout, arrive=arrive) + did
    elif outcome.gave_up:
        gone = (
            f"{_missing.stopped_waiting(outcome.gave_up)} for this process (their {timeout:g} s "
            "ran out before it arrived)"
        )
    else:
        return
    raise MeshkitError(
        f"{what}: {gone}.\n{rule}\nConsider looking at those processes' output; "
        f"{_env.ENV_CHECK_TIMEOUT} sets the wait."
    )


def agree_on(tag: str, mine: str, what: str, **absent: str) -> dict[int, str] | None:
    """Agree on ``mine``: None if every process holds it, else each one's (`raise_absent` first)."""
    timeout = _env.check_timeout()
    outcome = _agree.check(tag, mine, mine, timeout=timeout, what=what)
    if outcome.agreed:
        return None
    raise_absent(outcome, what, timeout, **absent)
    return outcome.records


class LeafRecord(NamedTuple):
    """One array of a process's part, as the processes compare it (sent as a JSON list)."""

    path: str  # its pytree path, as messages show it
    dtype: str  # the dtype of the global array
    split: list[list[str]]  # the mesh axes that split each dimension
    global_shape: list[Any]  # with pad=True, "?" for the leading size (agreed separately)
    local_shape: list[int]  # this process's part: not compared (processes may differ)


@dataclass(frozen=True)
class PartRecord:
    """What one process tells the others about its part of an assembly."""

    status: str = "data"  # or "end" (its loader ended), "closed" (early), "error", "exit"
    tree: str | None = None  # the pytree structure of its part
    leaves: tuple[LeafRecord, ...] | None = None  # one per array, in flattening order
    block_rows: int | None = None  # with pad=True, the rows per block it needs (largest wins)
    message: str | None = None  # with status "error", the failure, for the others' messages
    replicas: dict[str, tuple[int, str]] | None = None  # shared: name -> (holder, digest)
    rows: int | None = None  # global_batches: the rows of its batch (not with pad="ragged")
    last: bool | None = None  # at a step of uneven rows: whether a shorter batch is its last
    steps: int | None = None  # with status "closed", the steps its caller took before it closed

    def wire(self) -> dict[str, Any]:
        """The JSON object sent: the fields that are set, in declaration order."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def read(cls, wire: dict[str, Any]) -> PartRecord:
        """The record another process sent (its `wire` form, parsed from JSON)."""
        values: dict[str, Any] = {f.name: wire.get(f.name) for f in fields(cls)}
        if values["leaves"] is not None:
            values["leaves"] = tuple(LeafRecord(*leaf) for leaf in values["leaves"])
        return cls(**values)


def summary(wire: dict[str, Any]) -> str:
    """What must be equal in every process: a record's JSON without local shapes and replicas."""
    compared = {k: v for k, v in wire.items() if k != "replicas"}
    if "leaves" in compared:
        compared["leaves"] = [leaf[:-1] for leaf in compared["leaves"]]  # not the local shape
    return json.dumps(compared, sort_keys=True)


def raise_failures(records: dict[int, PartRecord], what: str = WHAT) -> None:
    """Raise a `MeshkitError` naming the processes that reported a failure instead of data."""
    failed = {p: r for p, r in records.items() if r.status == "error"}
    ended = sorted(p for p, r in records.items() if r.status == "exit")
    if ended and not failed:
        raise MeshkitError(_missing.left_program(what, dict.fromkeys(ended)))
    if failed:
        lines = "\n".join(f"  process {p}: {r.message}" for p, r in sorted(failed.items()))
        raise MeshkitError(
            f"{what}: {_missing.processes(sorted(failed))} failed before the processes compared "
            f"their data:\n{lines}\nEvery process stops here too (the program cannot go on with "
            "some processes missing)."
        )


def compare(records: dict[int, PartRecord], what: str = WHAT) -> None:
    """Raise a `DivergenceError` naming the processes outside a majority and where they differ."""
    raise_failures(records, what)
    trees = _missing.by_value({p: str(r.tree) for p, r in records.items()})
    if len(trees) > 1:
        raise DivergenceError(
            f"{what}: processes passed pytrees of different structure:\n"
            f"{_missing.lines(trees)}\n"
            "Every process must pass the same structure (same keys, same number of arrays).\n"
            "Consider building batches with the same code and keys on every process.",
            processes=_missing.outside_majority(trees.values()),
            field="structure",
        )
    first = min(records)
    for i, leaf in enumerate(records[first].leaves or ()):
        rows = {p: (r.leaves or ())[i] for p, r in records.items()}
        for field_name in ("dtype", "split", "global_shape"):
            seen = {p: getattr(x, field_name) for p, x in rows.items()}
            held = _missing.by_value({p: json.dumps(v) for p, v in seen.items()})
            if len(held) > 1:
                shown = _missing.by_value({p: _shown(x) for p, x in rows.items()})
                raise DivergenceError(
                    f"{what}: processes disagree on the {field_name.replace('_', ' ')} of "
                    f"{leaf.path}:\n"
                    f"{_missing.lines(shown)}\n"
                    "Processes must pass local arrays that fit together into one global array "
                    "(local shape = global shape / processes along each split dimension).\n"
                    + _fix(field_name, list(seen.values())),
                    processes=_missing.outside_majority(held.values()),
                    field=leaf.path,
                )
    _compare_replicas(records, what)


def _shown(leaf: LeafRecord) -> str:
    """``float32[32, 8] (global [?, 8], split over [('data',), ()])``: what a process passed."""
    shape = ", ".join(str(d) for d in leaf.global_shape)
    return (
        f"{leaf.dtype}{leaf.local_shape} (global [{shape}], "
        f"split over {[tuple(a) for a in leaf.split]})"
    )


def _fix(field_name: str, values: list[Any]) -> str:
    """The "Consider" line that fits what differs (``values``: each process's, of that field)."""
    if field_name == "dtype":
        return "Consider the same dtype on every process (cast in the loader: x.astype(...))."
    if field_name == "split":
        return "Consider the same spec for this array on every process."
    # With pad on, the leading size is "?" (agreed separately): what differs is beyond it.
    beyond = {json.dumps(v[1:]) for v in values}
    leading_only = len(beyond) == 1 and all(v and v[0] != "?" for v in values)
    if not leading_only:
        return (
            "Only the leading (batch) dimension may differ between processes, and only with "
            "padding; these arrays differ in another dimension, which padding cannot fix.\n"
            "Consider loaders that give every process arrays of the same trailing dimensions "
            "(the same features, sequence length or image size)."
        )
    uneven = (
        "pass pad=True"
        if pads()
        else "pad it first with meshkit.global_array_from_local(..., pad=True)"
    )
    return (
        "Consider the same batch size on every process; for an uneven last batch (the end of "
        f"the data), {uneven}."
    )


def _compare_replicas(records: dict[int, PartRecord], what: str) -> None:
    """Name the processes whose replicas of one block differ (``replicas``: their digests)."""
    owners: dict[str, dict[int, str]] = {}
    for p, r in sorted(records.items()):
        for name, (_, block_digest) in (r.replicas or {}).items():
            owners.setdefault(name, {})[p] = block_digest
    for name, digests in sorted(owners.items()):
        held = _missing.by_value(digests)
        if len(held) > 1:
            groups = " vs ".join(str(ps) for ps in held.values())
            path, _, start = name.rpartition("@")
            raise MeshkitError(
                f"{what}: processes {groups} hold the same block of {path} (starting at "
                f"{start}) as replicas, but passed different data for it.\n"
                "Processes in a replica group (meshkit.process_slice(...).replicas) must "
                "load identical data; consider seeding their loaders by shard_index, not by "
                "process index."
            )
