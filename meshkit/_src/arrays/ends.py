"""The two ends of a `meshkit.global_batches` loop: where its source starts, and how it ends.

``start=`` opens the source at a `DataPosition` (`open_source`), checked and agreed before any
read. Where the data ends is decided from the step records. A process that leaves its loop says
once how (`leave`); one that closed waits for every process's word (`confirm`); one that goes on
hears of the close from its iterator's watch (`GlobalBatches._watch`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..coord import missing as _missing
from ..coord.node import Node
from ..core import env as _env
from ..core.data_position import (
    DataPosition,
    GlobalIterator,
    GlobalSource,
    LoaderIdentity,
    decode_state,
    encode_state,
)
from ..core.errors import DivergenceError, MeshkitError
from .records import PartRecord, agree_on

_WHAT = "meshkit.global_batches"

# Where the data ends.


def short(records: dict[int, PartRecord]) -> list[int]:
    """The processes whose batch at this step has fewer rows than another's (none: one size)."""
    rows = _leading_rows(records) or {}
    most = max(rows.values(), default=0)
    return sorted(p for p, n in rows.items() if n < most)


def short_batch(records: dict[int, PartRecord], step: int, *, pad: bool) -> DivergenceError | None:
    """The error for a batch at ``step`` shorter than another process's, or None if allowed.

    Only a loader's last batch (`PartRecord.last`) may be short; with ``pad=True`` it is padded.
    The processes it names: those outside a majority of equal rows (all, without one).
    """
    rows, fewer = _leading_rows(records) or {}, short(records)
    if not fewer:
        return None
    full = sorted(set(rows) - set(fewer))
    midstream = [p for p in fewer if records[p].last is False]
    if pad and not midstream:
        return None  # short last batches: padded
    groups = _missing.by_value({p: str(n) for p, n in rows.items()})  # processes by rows
    odd = _missing.outside_majority(groups.values())
    many = len(midstream) > 1
    if not midstream:  # pad=False, the short batches their loaders' last (or not known)
        head = f"{_WHAT}: at step {step}, {_rows_text(fewer, rows)} where {_rows_text(full, rows)}"
        said = (
            f"; {'each is its loader' if len(fewer) > 1 else 'it is the loader'}'s last batch"
            if all(records[p].last for p in fewer)
            else ""
        )
        message = (
            f"{head}{said}.\nWith pad=False every step needs batches of one size from every "
            "process.\nConsider pad=True (the last step is padded; the mask marks the real "
            "rows), or dropping the short last batch on every process (drop_remainder)."
        )
    else:
        message = _MIDSTREAM.format(
            what=_WHAT,
            step=step,
            each="; ".join(_rows_text(ps, rows) for ps in groups.values()),
            more=f"the loader{'s' * many} of {_processes(midstream)} ha{'ve' if many else 's'}",
            which="the batches alone do not tell which process's loader is wrong"
            if len(odd) == len(rows)
            else f"{_processes(odd)} differ{'s' if len(odd) == 1 else ''} from the others",
        )
    return DivergenceError(message, processes=odd, field="rows")


# Padding (pad=True, pad="ragged") would hide rows a loader lost or added, so it is not offered.
_MIDSTREAM = (
    "{what}: at step {step}, the processes' batches differ in rows before the end of their "
    "data: {each}; {more} more batches after it.\n"
    "Every process's loader must give batches of one size at every step but its last (a "
    "batch may be short only where its data ends: pad=True pads it there).\n"
    "A batch of another size before the end of the data comes from a loader that lost rows "
    "(a filter, an uneven shard, a skipped file) or added some (padding of its own, another "
    "batch size); {which}.\n"
    "Consider checking that the loaders make batches of one size on every process "
    "(meshkit.process_slice(mesh, axis, global_shape).local_shape[0] rows each) and pad none "
    "of their own."
)


def _processes(ps: list[int]) -> str:
    return f"process{'es' if len(ps) > 1 else ''} {_and([str(p) for p in ps])}"


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def _rows_text(ps: list[int], rows: dict[int, int]) -> str:
    """``process 1's batch has 56 rows`` / ``processes 0 and 2 have 64 rows``."""
    counts = [rows[p] for p in ps]
    if len(ps) == 1:
        return f"{_processes(ps)}'s batch has {counts[0]} rows"
    if len(set(counts)) == 1:
        return f"{_processes(ps)} have {counts[0]} rows"
    return f"the batches of {_processes(ps)} have {_and([str(n) for n in counts])} rows"


def _leading_rows(records: dict[int, PartRecord]) -> dict[int, int] | None:
    """Rows of each process with data at this step; None if under two, or one is unsaid."""
    rows = {}
    for p, r in records.items():
        if r.status != "data":
            continue  # ended: padding only
        if r.rows is None:
            return None
        rows[p] = r.rows
    return rows if len(rows) > 1 else None


def uneven_end(ended: list[int], going: list[int], step: int, pad: bool) -> str:
    """The message for loaders that yielded different numbers of batches."""
    had = f"after {step - 1} batch{'es' if step != 2 else ''}" if step > 1 else "without a batch"
    more = f"a {_missing.ordinal(step)}" if step > 1 else "one"
    ended_text = (
        f"the loaders of {_processes(ended)}" if len(ended) > 1 else f"{_processes(ended)}'s loader"
    )
    going_text = f"those of {_processes(going)}" if len(going) > 1 else f"{_processes(going)}'s"
    head = (
        f"{_WHAT}: the processes' loaders yielded different numbers of batches: {ended_text} "
        f"ended {had}, while {going_text} yielded {more}.\n"
    )
    if pad:
        return head + (
            "With pad=True a process whose loader has ended contributes padding, shaped like "
            "its earlier batches; a loader that yielded no batch has none to copy.\n"
            "Consider giving every process at least one row, or a loader that yields a batch "
            "of 0 rows (same keys and dtypes) when its shard is empty."
        )
    return head + (
        "With pad=False every step needs a batch from every process, and the batches the "
        "longer loaders still hold would be dropped unseen.\n"
        "Consider pad=True (the processes whose loaders ended contribute padding, which the "
        "mask marks, until every loader has ended), or loaders that yield the same number of "
        "batches (drop the last, short batch everywhere, or stop after a fixed number of steps "
        "with itertools.islice)."
    )


# Loops left early: how a process left (`leave`), with the steps its caller took then.
CLOSED = "closed"  # it closed its iterator
ENDED = "ended"  # its data ended (for every process: the end is agreed)
TOOK = "took"  # it took a step past a process that closed
ASKS = "asks"  # it asked for a step past a process that closed
FAILED = "failed"  # its loop failed (a loader's error, a check)


def _key(tag: str) -> str:
    return f"meshkit/closes/{tag}/"


def _read(node: Node, tag: str) -> dict[int, tuple[str, int]]:
    """How each process that said so left its loop: (how, steps its caller took)."""
    out = {}
    for k, v in node.service.dir_get(_key(tag)):
        how, _, steps = v.partition(" ")
        out[int(k.rsplit("/", 1)[1])] = (how, int(steps))
    return out


def posted(node: Node, tag: str) -> dict[int, int]:
    """The step counts posted so far by processes that closed ``tag``'s iterator early."""
    return {p: k for p, (how, k) in _read(node, tag).items() if how == CLOSED}


def leave(node: Node, tag: str, how: str, steps: int) -> None:
    """Say once how this process left ``tag``'s loop; the last to say it marks all as said."""
    node.service.set(_key(tag) + str(node.me), f"{how} {steps}", overwrite=True)
    if node.service.increment(f"meshkit/closes-count/{tag}", 1) == node.n:
        node.service.set(f"meshkit/closes-all/{tag}", "1", overwrite=True)


def confirm(node: Node, tag: str, timeout: float) -> dict[int, tuple[str, int]]:
    """What each process said (`leave`) once all have, or when ``timeout`` runs out."""
    node.read(f"meshkit/closes-all/{tag}", time.monotonic() + timeout)
    return _read(node, tag)


def _did(how: str, steps: int) -> str:
    return {
        CLOSED: f"closed its iterator after step {steps}",
        ENDED: f"reached the end of its data after step {steps}",
        TOOK: f"took step {steps}",
        ASKS: f"asks for step {steps + 1}",
    }.get(how, f"failed at step {steps + 1}")


def left_error(
    said: dict[int, tuple[str, int]], n: int, me: int, timeout: float
) -> MeshkitError | None:
    """The error of ``me``, which closed, from what the processes said; None if all agree."""
    mine = said[me][1]
    ahead = {p: hk for p, hk in said.items() if hk[0] not in (CLOSED, ENDED)}
    if ahead:
        groups = _missing.by_value({p: _did(*hk) for p, hk in ahead.items()})
        others = ", ".join(f"{_missing.processes(ps)} {did}" for did, ps in groups.items())
        return _steps_differ(
            f"this process (process {me}) closed its iterator after step {mine}, but {others}",
            sorted(ahead),
        )
    others = {p: k for p, (_, k) in said.items() if k != mine}  # closed or ended after other steps
    if others:
        return _steps_differ(
            f"{_after(others)}, this process (process {me}) after step {mine}", sorted(others)
        )
    missing = sorted(set(range(n)) - set(said))
    if not missing:
        return None
    return MeshkitError(
        f"{_WHAT}: this process (process {me}) closed its iterator after step {mine}, and "
        f"{_missing.processes(missing)} did not leave the loop within {timeout:g} s (no "
        "close, no end of data, no further step asked for).\n"
        "Every process must leave its loop after the same step.\nConsider looking at those "
        f"processes' output; {_env.ENV_CHECK_TIMEOUT} sets the wait."
    )


def _after(closers: dict[int, int]) -> str:
    """``"process 0 after step 2"``, ``"processes 0,2 after step 2, process 3 after step 4"``."""
    groups = _missing.by_value({p: str(k) for p, k in closers.items()})
    return ", ".join(f"{_missing.processes(ps)} after step {k}" for k, ps in groups.items())


def _steps_differ(said: str, processes: list[int]) -> DivergenceError:
    return DivergenceError(
        f"{_WHAT}: the processes left their loops at different steps: {said}.\nEvery process "
        "must take the same number of batches from its global_batches: a loop that stops early "
        "(break, close(), the end of a with block) must stop after the same step on every "
        "process.\nConsider deciding when to stop from a value every process has (the step "
        "number, a value computed on global arrays), not from one process's own data or clock.",
        processes=processes,
        field="steps",
    )


def went_on(closers: dict[int, int], me: int, steps: int, *, took: bool) -> DivergenceError | None:
    """The error of ``me``, which took ``steps`` steps, if it goes on past ``closers``' close.

    ``took``: it took its last step already (else it asks for step ``steps + 1``).
    """
    early = {p: k for p, k in closers.items() if k < steps + (0 if took else 1)}
    if not early:
        return None
    who = _missing.processes(sorted(early))
    if took:
        doing = (
            f"took step {steps} already: its computations at that step wait for "
            f"{who}, which will not join them"
        )
    else:
        doing = f"asks for step {steps + 1}, which {who} will not take"
    return _steps_differ(
        f"{_after(early)} closed {'its iterator' if len(early) == 1 else 'their iterators'}, "
        f"but this process (process {me}) {doing}",
        sorted(early),
    )


# Where the source starts (start=).
_GLOBAL = (
    "meshkit.loaders.grain_batches or hf_batches, whose position is global and resumes on any "
    "number of processes"
)


@dataclass(frozen=True)
class Opened:
    """A source opened at its start, and how its position is kept."""

    source: Iterator[Any]  # what the helper thread reads
    capture: Callable[[], Any] | None  # the source's position right after a read (None: not kept)
    identity: LoaderIdentity | None  # a meshkit loader's
    step: int  # the steps taken before this iterator (start.step)
    me: int
    processes: int

    def position(self, steps: int, state: Any) -> DataPosition:
        """The position after the caller's ``steps`` steps; ``state``: the source's then."""
        if self.identity is not None:
            per = self.identity.steps_per_epoch
            epoch, step = divmod(state, per) if per else (0, 0)
            return DataPosition(steps, self.identity, epoch, step, self.processes)
        if self.capture is not None:  # the source has get_state() / set_state()
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
    stateful = False
    if isinstance(loader, GlobalSource):
        problem = None if start is None else _loader_problem(start, loader)
    else:
        try:
            loader = iter(iterable)
        except TypeError:
            raise MeshkitError(
                f"{_WHAT}: expected an iterable of per-process batches; got "
                f"{type(iterable).__name__}."
            ) from None
        stateful = callable(getattr(loader, "get_state", None)) and callable(
            getattr(loader, "set_state", None)
        )
        problem = None if start is None else _states_problem(start, loader, stateful, me, processes)
    if start is not None and processes > 1:
        _agree_on_start(start, problem, tag)
    if problem is not None:
        raise MeshkitError(problem)
    step = 0 if start is None else start.step
    if isinstance(loader, GlobalSource):
        at = None if start is None else start.loader_step
        it = (
            iterable
            if at is None and isinstance(iterable, GlobalIterator)
            else loader.iterate(at or 0)
        )
        return Opened(it, lambda: it.step, loader.identity, step, me, processes)
    source = loader
    return Opened(source, (lambda: _state(source)) if stateful else None, None, step, me, processes)


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
    if start.kind != "states" or not stateful:
        has = ", which has no set_state()" if start.kind == "states" else ""  # not stateful
        return _kind_problem(start, f"a {type(source).__name__}{has}")
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
    if said is None or problem is not None:
        return  # agreed, or this process's own problem is raised (by open_source)
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
