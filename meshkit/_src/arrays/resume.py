"""Where a `meshkit.global_batches` source stands: kept with every step, resumed at ``start=``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..coord import missing as _missing
from ..core.data_position import (
    DataPosition,
    GlobalIterator,
    GlobalSource,
    LoaderIdentity,
    decode_state,
    encode_state,
)
from ..core.errors import MeshkitError
from .records import agree_on

_WHAT = "meshkit.global_batches"
_GLOBAL = (
    "meshkit.loaders.grain_batches or hf_batches, whose position is global and resumes on any "
    "number of processes"
)


@dataclass(frozen=True)
class Opened:
    """A source opened at its start, and how its position is kept."""

    source: Iterator[Any]  # what the helper thread reads
    capture: Callable[[], Any] | None  # the source's position right after a read (None: not kept)
    first: Any  # the position before the first read
    identity: LoaderIdentity | None  # a meshkit loader's
    stateful: bool  # the source has get_state() / set_state()
    step: int  # the steps taken before this iterator (start.step)
    me: int
    processes: int

    def position(self, steps: int, state: Any) -> DataPosition:
        """The position after the caller's ``steps`` steps; ``state``: the source's then."""
        if self.identity is not None:
            per = self.identity.steps_per_epoch
            epoch, step = divmod(state, per) if per else (0, 0)
            return DataPosition(steps, self.identity, epoch, step, self.processes)
        if self.stateful:
            return DataPosition(steps, processes=self.processes, states={self.me: state})
        return DataPosition(steps, processes=self.processes)


def _state(source: Any) -> str:
    """``source.get_state()`` as JSON text; a state that cannot be saved says so (see save)."""
    state = source.get_state()
    try:
        return encode_state(state)
    except TypeError:
        return json.dumps({"unsavable": type(state).__name__})


def open_source(
    iterable: Iterable[Any], start: DataPosition | None, me: int, processes: int, tag: str
) -> Opened:
    """Open ``iterable`` at ``start`` (None: where it stands); a bad start fails everywhere."""
    if start is not None and not isinstance(start, DataPosition):
        raise MeshkitError(
            f"{_WHAT}: start must be a meshkit.DataPosition or None; got "
            f"{type(start).__name__}.\nConsider meshkit.checkpoint.data_position(path), or "
            "the position() of the iterator to resume."
        )
    loader = iterable.source if isinstance(iterable, GlobalIterator) else iterable
    step = 0 if start is None else start.step
    opened: Opened | None = None
    if isinstance(loader, GlobalSource):
        problem = None if start is None else _loader_problem(start, loader)
        if problem is None:
            at = None if start is None else start.loader_step
            if at is None and isinstance(iterable, GlobalIterator):
                it = iterable
            else:
                it = loader.iterate(at or 0)
            opened = Opened(
                it, lambda: it.step, it.step, loader.identity, False, step, me, processes
            )
    else:
        try:
            source = iter(iterable)
        except TypeError:
            raise MeshkitError(
                f"{_WHAT}: expected an iterable of per-process batches; got "
                f"{type(iterable).__name__}."
            ) from None
        stateful = callable(getattr(source, "get_state", None)) and callable(
            getattr(source, "set_state", None)
        )
        problem = None if start is None else _states_problem(start, source, stateful, me, processes)
        if problem is None:
            capture = (lambda: _state(source)) if stateful else None
            first = None if capture is None else capture()
            opened = Opened(source, capture, first, None, stateful, step, me, processes)
    if start is not None and processes > 1:
        _agree_on_start(start, problem, tag)
    if problem is not None:
        raise MeshkitError(problem)
    assert opened is not None
    return opened


def _loader_problem(start: DataPosition, loader: GlobalSource) -> str | None:
    identity = loader.identity
    if start.loader is None:
        return _kind_problem(start, f"a meshkit loader, {identity.describe()}")
    differ = identity.differences(start.loader)
    if differ:
        return (
            f"{_WHAT}: start= is the position of another loader: it was taken from "
            f"{start.loader.describe()}, and the loader given is {identity.describe()}; they "
            f"differ in {', '.join(differ)}. A position resumes the loader it was taken from "
            "(the same dataset length, global batch, seed and drop_remainder), so that the "
            "next global batch is the one the saved run would have taken.\n"
            "Consider building the loader as the saved run did (DataPosition.loader "
            "describes it), or start=None to start this loader from its beginning."
        )
    step = start.loader_step
    if step is None or step > len(loader):
        return (
            f"{_WHAT}: start= is at epoch {start.epoch}, step {start.epoch_step} of it, past "
            f"the end of {identity.describe()} ({len(loader)} global batches in "
            f"{identity.epochs} epochs).\nConsider epochs={(start.epoch or 0) + 1} or more."
        )
    return None


def _kind_problem(start: DataPosition, given: str) -> str:
    """``start`` is of another kind of source than ``given``."""
    if start.kind == "loader":
        assert start.loader is not None
        held = f"the position of a meshkit loader, {start.loader.describe()}"
        fix = f"Consider passing meshkit.loaders.{start.loader.describe()} as the saved run did."
    elif start.kind == "states":
        held = (
            "the states of a source with get_state()/set_state() (a grain DataLoader or "
            "IterDataset iterator)"
        )
        fix = "Consider passing the same kind of source as the saved run did."
    else:
        return (
            f"{_WHAT}: start= holds only a step count (step {start.step}): its batches came from "
            "an iterable without a position to save (no meshkit loader, no get_state()), so "
            "nothing says where to resume it.\nConsider " + _GLOBAL + "; or a source with "
            "get_state()/set_state(), such as a grain DataLoader's iterator; or start=None to "
            "start the data from its beginning."
        )
    return (
        f"{_WHAT}: start= holds {held}, and the iterable given is {given}: a position resumes "
        f"the kind of source it was taken from.\n{fix}"
    )


def _states_problem(
    start: DataPosition, source: Any, stateful: bool, me: int, processes: int
) -> str | None:
    """Apply ``start``'s state of this process to ``source``; the problem if it does not fit."""
    if start.kind != "states":
        return _kind_problem(start, f"a {type(source).__name__}")
    if not stateful:
        return (
            f"{_WHAT}: start= holds the states of a source with get_state()/set_state(); the "
            f"iterable given is a {type(source).__name__}, which has no set_state().\n"
            "Consider passing the same kind of source as the saved run did."
        )
    assert start.states is not None
    if start.processes != processes:
        return (
            f"{_WHAT}: start= holds per-process states of a source with get_state() (a grain "
            f"DataLoader or IterDataset iterator) from {start.processes} processes; this run "
            f"has {processes}. Each state is one process's place in its own part of the data, "
            "so it resumes only on as many processes, with the same layout.\n"
            f"Consider {_GLOBAL}; or resuming on {start.processes} processes."
        )
    text = start.states.get(me)
    if text is None:
        return (
            f"{_WHAT}: start= has no state for process {me} (it holds processes "
            f"{sorted(start.states)}). GlobalBatches.position() holds this process's state "
            "only; a position saved by meshkit.checkpoint.save(..., data=...) every process's."
            "\nConsider meshkit.checkpoint.data_position(path)."
        )
    try:
        state = decode_state(text)
    except (ValueError, KeyError, TypeError) as e:
        return f"{_WHAT}: start='s state for process {me} is not one meshkit saved ({e!r})."
    try:
        source.set_state(state)
    except Exception as e:  # the source's own check of the state (grain compares its setup)
        return (
            f"{_WHAT}: {type(source).__name__}.set_state refused the state of process {me} "
            f"saved at step {start.step}: {type(e).__name__}: {e}\n"
            "Consider building the source as the saved run did (the same data source, sampler "
            "and operations)."
        )
    return None


def _agree_on_start(start: DataPosition, problem: str | None, tag: str) -> None:
    """Raise on every process if one refused ``start``, they differ, or one did not come."""
    what = f"{_WHAT} (start=)"
    mine = json.dumps({"position": start.describe(), "problem": problem})
    said = agree_on(
        tag + "/start", mine, what, arrive="reach this call", did="",
        rule="Every process must resume its iterator at the same position.",
    )  # fmt: skip
    if said is None:
        return
    if problem is not None:
        raise MeshkitError(problem)
    records = {p: json.loads(v) for p, v in sorted(said.items())}
    for p, record in records.items():
        if record["problem"] is not None:
            raise MeshkitError(f"{what}: process {p} refused the position:\n{record['problem']}")
    positions = {p: r["position"] for p, r in records.items()}
    raise MeshkitError(
        f"{what}: the processes resume at different positions:\n"
        f"{_missing.lines(_missing.by_value(positions))}\n"
        "Every process must resume at the same position.\nConsider reading it from the same "
        "checkpoint on every process (meshkit.checkpoint.data_position(path))."
    )
