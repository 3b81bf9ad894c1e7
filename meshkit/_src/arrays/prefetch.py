"""The helper thread of `meshkit.global_batches`: each step read, agreed and assembled ahead.

To spare the coordinator, steady steps are agreed in windows of up to `width_cap` steps; a
window that is not all data of equal records falls back to per-step agreements.
"""

from __future__ import annotations

import functools
import itertools
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

from ..core.errors import MeshkitError
from ..lifecycle import progress as _progress
from . import assembly as _assembly
from . import ends as _ends
from .blocks import Prepared
from .records import PartRecord, raise_failures, summary

_WHAT = "meshkit.global_batches"
# Batches read ahead for a window are held on the host: at most this many bytes of them.
AHEAD_BYTES = 64 << 20


END = object()  # put in the caller's queue: the data ended for every process at this step
# An exception put in the caller's queue is raised by its next `next()`.
# One read of a loader: ("data", batch, state), ("end", None, state) or ("error", what it
# raised, None); state: the source's position right after the read (`Opened.capture`).
_Pulled = tuple[str, Any, Any]


_Read = tuple[Prepared, dict[int, PartRecord], Any]  # a step read ahead: prepared, its records


@dataclass
class Ahead:
    """The helper's side of one `meshkit.global_batches` iterator (run by its thread)."""

    opened: _ends.Opened  # this process's loader
    assembly: _assembly.Assembly
    prepare: Callable[[Any], Prepared]  # checks and plans a batch (`blocks.prepare`)
    ragged: bool
    prefetch: int  # assembled steps waiting for the caller, at most (a slot is taken first)
    stop: threading.Event  # set when the iterator is closed
    release: Callable[[], None]  # tells the others' helpers that this one stops
    hear: Callable[[dict[int, int]], None] | None  # takes early closers (None: stop_together off)
    assembled: int = 0  # steps assembled (a resumed iterator starts at its position's)
    _ahead: deque[_Pulled] = field(default_factory=deque)
    _template: Any = None

    def __post_init__(self) -> None:
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()  # steps, END, exceptions
        self._slots = threading.Semaphore(self.prefetch)
        self.put = self._items.put

    def get(self) -> Any:
        """The caller's next item, its slot freed."""
        item = self._items.get()
        self._slots.release()
        return item

    def run(self) -> None:
        """Read, agree and assemble until the data ends, the iterator closes or a step fails."""
        width, alone = 1, 0  # the next window's size; steps still to agree one by one
        agreed: deque[Any] = deque()  # steps (`_Read`), then END or an exception
        pulled: list[_Pulled] = []  # the window being read: its reads, and the steps prepared
        steps: list[_Read] = []
        try:
            while True:
                if agreed and self._slots.acquire(blocking=False):
                    if not self._place(agreed.popleft()):
                        return
                    continue
                ending = agreed and not isinstance(agreed[-1], tuple)  # the loop's end is agreed
                if width > 1 and not alone and not ending and len(agreed) < width:
                    if self.stop.is_set():
                        self.release()  # the others' helpers wait for this one's next agreement
                        return
                    if not self._read(pulled, steps, width):
                        continue  # one more batch read into the window
                    at = self.assembled + len(agreed) + 1  # the window's first step
                    try:
                        outcome = self._agree(pulled, steps, width, at)
                    except Exception as e:
                        outcome = [e]
                    pulled, steps = [], []
                    agreed.extend(outcome)  # after the steps agreed before
                    if outcome:
                        width = min(2 * width, self._width_cap)
                    else:  # the window's steps are agreed one by one, as they always were
                        alone, width = width, 1
                    continue
                taken = False  # a slot, waited for until the iterator is closed
                while not (taken or self.stop.is_set()):
                    taken = self._slots.acquire(timeout=0.1)
                if not taken:
                    self.release()
                    return
                if not agreed:
                    step, steady = self._one()
                    if step is None:
                        return  # closed while the loader ran
                    agreed.append(step)
                    alone = max(0, alone - 1)
                    grow = steady and self.assembly.multi and not alone
                    width = min(2, self._width_cap) if grow else 1
                if not self._place(agreed.popleft()):
                    return
        except BaseException as e:  # the caller raises it at its next step
            self.put(e)

    def _read(self, pulled: list[_Pulled], steps: list[_Read], width: int) -> bool:
        """Read one more batch into a window (none when full); whether the window is read.

        A read without data, or a batch that does not prepare (no step for it), ends the window.
        """
        if len(steps) < len(pulled) or len(pulled) >= width:
            return True
        status, local, state = one = self._next()
        pulled.append(one)
        if status != "data":
            return True
        self._template = local
        try:
            prepared = self.prepare(local)
        except Exception:  # raised again by its own step, which agrees on it alone
            return True
        record = self.assembly.record(prepared, "data", self._rows(prepared, "data"))
        steps.append((prepared, {self.opened.me: record}, state))
        return len(pulled) >= width

    def _place(self, step: Any) -> bool:
        """Hand an agreed step to the caller; False: the loop ends (the end of data, a failure)."""
        self.put(self._finish(*step) if isinstance(step, tuple) else step)
        return isinstance(step, tuple)

    @functools.cached_property
    def _width_cap(self) -> int:
        """The most steps one window holds: the process count (at least 32), within `AHEAD_BYTES`.

        Two windows may be on the host at once; a step costs 2N / W requests at the coordinator.
        """
        leaves = jax.tree_util.tree_leaves(self._template)
        # a jax.Array's nbytes, not a copy to the host
        batch = sum(x.nbytes if hasattr(x, "nbytes") else np.asarray(x).nbytes for x in leaves)
        return max(1, min(max(32, self.opened.processes), AHEAD_BYTES // max(1, 2 * batch)))

    def _pull(self) -> _Pulled:
        try:
            began = time.perf_counter()
            local = next(self.opened.source, END)  # END: no loader yields it
            _progress.loaded(time.perf_counter() - began)
            state = None if self.opened.capture is None else self.opened.capture()
        except BaseException as e:  # the loader's (or its get_state's) error: raised at its step
            return "error", e, None
        return ("end", None, state) if local is END else ("data", local, state)

    def _next(self) -> _Pulled:
        return self._ahead.popleft() if self._ahead else self._pull()

    def _peek(self) -> bool | None:
        """Whether the loader has ended after this batch (None: it failed, raised later)."""
        if not self._ahead:
            self._ahead.append(self._pull())
        return {"end": True, "data": False}.get(self._ahead[0][0])

    def _rows(self, prepared: Prepared, status: str) -> int | None:
        """The rows the step's record compares (`PartRecord.rows`): not with ``pad="ragged"``."""
        if status == "data" and not self.ragged and prepared.leaves[0].global_shape:
            return int(prepared.leaves[0].value.shape[0])
        return None

    def _one(self) -> tuple[Any, bool]:
        """The next step agreed alone (None: closed), and whether all had data."""
        status, local, state = self._next()
        if status == "error":
            if self.assembly.multi:
                _assembly.publish_failure(self.assembly.tag, local)
            return local, False
        if status == "data":
            self._template = local
            if self.stop.is_set():
                self.release()
                return None, False
        return self._step(status, local, state)

    def _step(self, status: str, local: Any, state: Any = None) -> tuple[Any, bool]:
        assembly = self.assembly
        pad, multi = assembly.pad, assembly.multi
        step = self.assembled + 1
        what = f"{_WHAT} (step {step})"
        if status == "end":
            if not (multi and pad and self._template is not None):
                if multi:
                    self._check_end(assembly.agree_sizes(None, "end", what=what), step)
                return END, False
            local = jax.tree_util.tree_map(
                lambda a: np.zeros((0, *np.shape(a)[1:]), np.asarray(a).dtype), self._template
            )
        prepared = assembly.prepare(lambda: self.prepare(local))
        if not multi:
            return (prepared, None, state), False
        # Agreed before placing: the end of data, the padded size and (but ragged) the rows.
        records = assembly.agree_sizes(
            prepared,
            status,
            rows=self._rows(prepared, status),
            what=what,
            explain=None if pad else (lambda agreed: self._check_rows(agreed, step, what)),
        )
        if self._check_end(records, step):
            return END, False
        if pad:
            self._check_rows(records, step, what)  # nothing to check with pad="ragged": no rows
        return (prepared, records, state), len(records) == 1 and status == "data"

    def _finish(self, prepared: Prepared, records: dict[int, PartRecord] | None, state: Any) -> Any:
        """Place and transfer an agreed step: the caller's item (with the source's position)."""
        self.assembly.place(prepared, records)
        tree, mask = self.assembly.transfer(prepared, agreed=records is not None)
        self.assembled += 1
        rows = prepared.leaves[0].global_shape[0] if prepared.leaves[0].global_shape else 1
        return ((tree, mask) if self.assembly.pad else tree), rows, prepared.notes, state

    def _agree(self, pulled: list[_Pulled], steps: list[_Read], width: int, step: int) -> list[Any]:
        """Agree at once on a window read from step ``step``.

        Returns its steps (then `END` if every loader ended right after) when all processes'
        records are equal; [] to agree them one by one; [`END`] to end the loop.
        """
        said = []
        for prepared, mine, _ in steps:
            record = mine[self.opened.me]
            template = prepared.template
            if template is not None and record.tree is not None:  # spares a JSON text per step
                said.append(f"{template.summary} {record.rows}")
            else:
                said.append(summary(record.wire()))
        runs = [[text, len(list(same))] for text, same in itertools.groupby(said)]
        whole = len(steps) == width
        # Every loader ending right after the window's batches is agreed too: the common end.
        ended = pulled[-1][0] == "end" and len(steps) == len(pulled) - 1
        first = "data" if steps else pulled[0][0]
        records = _assembly.exchange_records(
            self.assembly.tag,
            {"status": "window", "first": first},
            f"{_WHAT} (steps {step} to {step + width - 1})",
            said=json.dumps({"runs": runs, "whole": whole, "end": ended}),
        )
        if len(records) == 1 and (whole or ended):
            return [*steps, END] if ended else steps
        left = {p: PartRecord.read(r) for p, r in records.items() if r["status"] != "window"}
        if left:  # a process closed or failed: it is the window's first step that tells
            at = {
                p: left.get(p, PartRecord(status=r.get("first", "data")))
                for p, r in records.items()
            }
            what = f"{_WHAT} (step {step})"
            raise_failures(at, what)
            self._check_end(at, step)
            return [END]
        self._ahead.extendleft(reversed(pulled))
        return []

    def _check_rows(self, records: dict[int, PartRecord], step: int, what: str) -> None:
        """Raise if a batch at ``step`` is short while its loader has more (`ends.short_batch`).

        Processes with fewer rows read one batch ahead and all exchange whether it was the last.
        """
        fewer = _ends.short(records)
        if not fewer:
            return
        last = self._peek() if self.opened.me in fewer else None
        said = _assembly.exchange_records(self.assembly.tag, PartRecord(last=last).wire(), what)
        lasts = {p: PartRecord.read(w).last for p, w in said.items()}
        if len(lasts) == 1:  # every process sent the same
            lasts = dict.fromkeys(records, last)
        told = {p: replace(r, last=lasts.get(p)) for p, r in records.items()}
        error = _ends.short_batch(told, step, pad=self.assembly.pad)
        if error is not None:
            raise error

    def _check_end(self, records: dict[int, PartRecord], step: int) -> bool:
        """Whether the data ended for every process at ``step``; raises if loaders end unevenly.

        Ended loaders may pad only with ``pad`` and an earlier batch; a process that closed while
        others have data ends the loop too, and the caller raises going on past it (`hear`).
        """
        statuses = {p: r.status for p, r in records.items()}
        if "closed" in statuses.values():  # told to the caller where others have data
            if set(statuses.values()) - {"end", "closed"} and self.hear is not None:
                self.hear({p: r.steps for p, r in records.items() if r.steps is not None})
            return True
        if set(statuses.values()) == {"end"}:
            return True
        ended = sorted(p for p, s in statuses.items() if s == "end")
        if not ended or (
            self.assembly.pad and all(records[p].block_rows is not None for p in ended)
        ):
            return False
        raise MeshkitError(
            _ends.uneven_end(ended, sorted(set(statuses) - set(ended)), step, self.assembly.pad)
        )
