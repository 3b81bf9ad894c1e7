"""`global_batches`: per-process batches in, global batches out, assembled ahead of time.

A helper thread pulls the next local batch, agrees with the other processes (one small message
per process and step through the coordination service: "I have a batch, of this structure" or
"my data has ended"), and assembles the global batch while the caller computes on the previous
one. At most ``prefetch`` assembled batches wait for the caller, so device memory stays
bounded.

End of data is decided together: at the first step where some process has no batch, every
process stops (``pad=False``), or the processes that ran out contribute fully padded batches
until all have (``pad=True``; the mask marks real rows). No process is ever left waiting on a
collective that the others will not join.
"""

from __future__ import annotations

import atexit
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from queue import Queue
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from . import _assembly, _compat, _global, _watchdog
from ._errors import MeshkitError

__all__ = ["GlobalBatches", "global_batches"]

_WHAT = "meshkit.global_batches"
_instances = itertools.count()
_JOIN_TIMEOUT_S = 30.0
_live: weakref.WeakSet[GlobalBatches] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop helper threads before the interpreter (and JAX's runtime) shuts down under them."""
    for batches in list(_live):
        batches.close()


@dataclass
class _Failure:
    error: BaseException


class _End:
    pass


_END = _End()


class GlobalBatches(Iterator[Any]):
    """The iterator `meshkit.global_batches` returns; also a context manager that stops it.

    Attributes:
        steps: global batches handed to the caller so far.
        rows: rows of those batches (their leading size, padding included).
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        mesh_or_sharding: Mesh | NamedSharding,
        spec: Any,
        *,
        prefetch: int,
        pad: bool,
        check: _global.Check,
        dtype: Any,
        progress: float | None,
    ) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise MeshkitError(
                f"{_WHAT}: prefetch must be a positive int (batches assembled ahead); got "
                f"{prefetch!r}."
            )
        if progress is not None and not progress > 0:
            raise MeshkitError(
                f"{_WHAT}: progress must be None or a positive number of seconds between "
                f"reports; got {progress!r}."
            )
        self._args = (mesh_or_sharding, spec)
        self._pad, self._dtype = pad, dtype
        self._progress = progress
        self._tag = f"global_batches/{next(_instances)}"
        # sizes are exchanged at every step: the end of data is decided together.
        self._assembly = _assembly.Assembly(self._tag, _WHAT, pad=pad, check=check, stepwise=True)
        self._queue: Queue[Any] = Queue()
        self._slots = threading.Semaphore(prefetch)
        self._stop = threading.Event()
        self._done = False
        self.steps = 0
        self.rows = 0
        self._started = time.monotonic()
        self._reported = self._started
        try:
            source = iter(iterable)
        except TypeError:
            raise MeshkitError(
                f"{_WHAT}: expected an iterable of per-process batches; got "
                f"{type(iterable).__name__}."
            ) from None
        self._thread = threading.Thread(
            target=self._work, args=(source,), name="meshkit-global-batches", daemon=True
        )
        self._thread.start()
        _live.add(self)

    # The caller's side.

    def __iter__(self) -> GlobalBatches:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        self._slots.release()
        if isinstance(item, _End):
            self._done = True
            self._report(final=True)
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        batch, rows, notes = item
        _global.warn_notes(notes, stacklevel=2)
        _watchdog.note_progress()
        self.steps += 1
        self.rows += rows
        self._report()
        return batch

    def close(self) -> None:
        """Stop the helper thread and wait for it; batches not yet taken are dropped.

        The other processes' iterators stop at the same step (each process's helper tells the
        others it closed), so call it on every process, as the loop that breaks early does.
        """
        self._done = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT_S)

    def __enter__(self) -> GlobalBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # absent when __init__ raised
        if stop is not None:
            stop.set()

    @property
    def rows_per_second(self) -> float:
        """Rows handed to the caller per second since the iterator started."""
        return self.rows / max(1e-9, time.monotonic() - self._started)

    def _report(self, final: bool = False) -> None:
        if self._progress is None or jax.process_index() != 0:
            return
        now = time.monotonic()
        if not final and now - self._reported < self._progress:
            return
        self._reported = now
        state = "done" if final else "running"
        sys.stderr.write(
            f"{_WHAT}: {state}, step {self.steps}, {self.rows} rows, "
            f"{self.rows_per_second:,.0f} rows/s\n"
        )

    # The helper thread's side.

    def _take_slot(self) -> bool:
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.1):
                return True
        return False

    def _work(self, source: Iterator[Any]) -> None:
        _global.set_caller(_WHAT)
        template: Any = None
        multi = _compat.distributed_state()[2] > 1
        while True:
            if not self._take_slot():
                if multi:  # release the processes waiting for this one's next step
                    _assembly.publish_record(self._tag, {"status": "closed"})
                return
            status, local = "data", None
            try:
                local = next(source)
                template = local
            except StopIteration:
                status = "end"
            except BaseException as e:
                if multi:
                    _assembly.publish_failure(self._tag, e)
                self._queue.put(_Failure(e))
                return
            try:
                item = self._step(status, local, template, multi)
            except BaseException as e:
                self._queue.put(_Failure(e))
                return
            self._queue.put(item)
            if isinstance(item, _End):
                return

    def _step(self, status: str, local: Any, template: Any, multi: bool) -> Any:
        mesh_or_sharding, spec = self._args
        pad = self._pad
        assembly = self._assembly
        if status == "end":
            if not (multi and pad and template is not None):
                if multi:
                    assembly.agree_sizes(None, "end")
                return _END
            local = jax.tree_util.tree_map(
                lambda a: np.zeros((0, *np.shape(a)[1:]), np.asarray(a).dtype), template
            )
        prepared = assembly.prepare(
            lambda: _global.prepare(
                local, mesh_or_sharding, spec, global_shape=None, dtype=self._dtype, pad=pad
            )
        )
        records = None
        if multi:
            # Every step agrees before placing: on the end of data, and the padded size.
            records = assembly.agree_sizes(prepared, status)
            statuses = {r["status"] for r in records.values()}
            if "closed" in statuses:
                return _END
            unpaddable = not pad or any("block_rows" not in r for r in records.values())
            if statuses == {"end"} or ("end" in statuses and unpaddable):
                return _END
        assembly.place(prepared, records)
        tree, mask = assembly.transfer(prepared, agreed=records is not None)
        rows = prepared.leaves[0].global_shape[0] if prepared.leaves[0].global_shape else 1
        return ((tree, mask) if pad else tree), rows, prepared.notes


def global_batches(
    iterable: Iterable[Any],
    mesh_or_sharding: Mesh | NamedSharding,
    spec: Any = None,
    *,
    prefetch: int = 2,
    pad: bool = False,
    check: _global.Check = True,
    dtype: Any = None,
    progress: float | None = None,
) -> GlobalBatches:
    """Turn an iterable of per-process batches into an iterator of global batches.

    Each process passes its own loader (what it would pass to `meshkit.global_array_from_local`
    step by step). A helper thread assembles the next global batches while the caller computes,
    at most ``prefetch`` ahead. The processes agree on the end of data: when any process runs
    out, all stop at the same step (``pad=False``), or those that ran out contribute fully
    padded batches until every process has (``pad=True``, which also pads uneven batches and
    yields ``(batch, mask)`` pairs). An exception raised by a loader reaches the caller with its
    traceback, and the other processes raise a `meshkit.MeshkitError` naming that process.

    Args:
        iterable: this process's batches (pytrees of arrays). On CPU a global batch may share
            memory with them (see `meshkit.global_array_from_local`): a loader must not refill
            an array it has already yielded.
        mesh_or_sharding: as for `meshkit.global_array_from_local`.
        spec: as for `meshkit.global_array_from_local`.
        prefetch: global batches assembled ahead of the caller (bounds the device memory held).
        pad: pad uneven batches and run until every process's data has ended; yields
            ``(batch, mask)``.
        check: as for `meshkit.global_array_from_local`.
        dtype: cast every array to this dtype.
        progress: seconds between progress lines (steps, rows, rows/s) on process 0's stderr;
            None for none.

    Returns:
        A `GlobalBatches` iterator (``steps``, ``rows``, ``rows_per_second``; ``close()``, or
        use it in a ``with`` block, to stop early).

    Examples:
        >>> import numpy as np, meshkit
        >>> mesh = meshkit.make_mesh({"data": -1})
        >>> loader = ({"x": np.full((8, 2), i, np.float32)} for i in range(3))
        >>> [float(b["x"].sum()) for b in meshkit.global_batches(loader, mesh, "data")]
        [0.0, 16.0, 32.0]
    """
    return GlobalBatches(
        iterable,
        mesh_or_sharding,
        spec,
        prefetch=prefetch,
        pad=pad,
        check=check,
        dtype=dtype,
        progress=progress,
    )
