"""`global_batches`: the caller's side; a helper thread (`prefetch`) assembles steps ahead."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from jax.sharding import Mesh, NamedSharding

from ..coord import agree as _agree
from ..coord import agreement as _agreement
from ..coord import channel as _channel
from ..coord import places as _places
from ..core import compat as _compat
from ..core import env as _env
from ..core import events as _events
from ..core.data_position import DataPosition
from ..core.errors import DivergenceError, MeshkitError
from ..core.frames import public, user_frame, user_stacklevel
from ..core.log import logger, say
from ..lifecycle import exit as _exit
from ..lifecycle import failfast as _failfast
from ..lifecycle import profiles as _profiles
from ..lifecycle import progress as _progress
from . import assembly as _assembly
from . import blocks as _blocks
from . import ends as _ends
from . import prefetch as _prefetch
from .blocks import warn_notes
from .records import PartRecord, calling

_LOG = logger("arrays")
_WHAT = "meshkit.global_batches"
BatchCheck = bool | Literal["data"]  # global_batches' check=
BatchPad = bool | Literal["ragged"]  # global_batches' pad=
_JOIN_TIMEOUT_S = 30.0
_WATCH = "global_batches: watch for closes: "  # + the iterator's tag: its service-thread task
_HELPER_STOPS_S = 0.5  # a helper between steps notices a close within 0.1 s
_live: weakref.WeakSet[GlobalBatches] = weakref.WeakSet()


def _close_all() -> None:
    """Stop helper threads before the interpreter (and JAX's runtime) shuts down under them."""
    for batches in list(_live):
        batches._close(at_exit=True)


class GlobalBatches(Iterator[Any]):
    """The iterator `meshkit.global_batches` returns; also a context manager that stops it.

    Attributes:
        steps: global batches handed to the caller so far; a resumed iterator counts on from
            its ``start`` position's step.
        rows: rows of those batches (their leading size, padding included).
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        mesh_or_sharding: Mesh | NamedSharding,
        spec: Any,
        *,
        prefetch: int,
        pad: BatchPad,
        check: BatchCheck,
        dtype: Any,
        progress: float | None,
        stop_together: bool = True,
        start: DataPosition | None = None,
    ) -> None:
        for name, value, ok, rule in (
            ("prefetch", prefetch, isinstance(prefetch, int) and not isinstance(prefetch, bool)
             and prefetch >= 1, "a positive int (batches assembled ahead)"),
            ("stop_together", stop_together, isinstance(stop_together, bool), "True or False"),
            ("check", check, isinstance(check, bool) or (
                isinstance(check, str) and check == "data"),
             "True, False or 'data' (each step is verified before it is yielded; there is no "
             "deferred mode)"),
            ("pad", pad, isinstance(pad, bool) or (isinstance(pad, str) and pad == "ragged"),
             "True (pad where each loader's data ends), 'ragged' (pad short batches at every "
             "step) or False"),
            ("progress", progress, progress is None or (
                isinstance(progress, int | float) and progress > 0),
             "None or a positive number of seconds between reports"),
        ):  # fmt: skip
            if not ok:
                raise MeshkitError(f"{_WHAT}: {name} must be {rule}; got {value!r}.")
        # at the first iterator, not at import; again is a no-op
        _exit.on_exit("global_batches: stop the helper threads", _close_all, order=_exit.STOP)
        self._progress = progress
        # numbered on the creating thread's channel; the helper thread uses it as its own
        self._tag = _channel.numbered("global_batches", _WHAT)
        _, self._me, n = _compat.distributed_state()
        # the service, if the processes must leave the loop after the same step (`ends`)
        self._node = _agree.node() if stop_together else None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # closed, ended or failed: __next__ raises StopIteration, and no close is watched for
        self._done = threading.Event()
        self._release: str | None = None  # made at the close, posted once (`_release_helpers`)
        self._left = False  # this process said how it left the loop (`ends.leave`)
        self._closers: dict[int, int] = {}  # processes that closed early: their steps
        self._gone: DivergenceError | None = None  # this caller took a step a closer did not
        self.rows = 0
        self._started = time.monotonic()
        self._reported = self._started
        self._source = _ends.open_source(iterable, start, self._me, n, self._tag)
        self.steps = self._source.step
        capture = self._source.capture  # the source's position after the steps taken
        self._state = None if capture is None else capture()
        assembly = _assembly.Assembly(self._tag, _WHAT, pad=bool(pad), check=check, stepwise=True)
        prepare = functools.partial(
            _blocks.prepare, mesh_or_sharding=mesh_or_sharding, spec=spec, global_shape=None,
            dtype=dtype, pad=bool(pad),
        )  # fmt: skip
        self._prefetch = _prefetch.Ahead(
            self._source, assembly, prepare, ragged=pad == "ragged", prefetch=prefetch,
            stop=self._stop, release=self._release_helpers,
            hear=None if self._node is None else self._hear, assembled=self.steps,
        )  # fmt: skip
        self._thread = threading.Thread(
            target=self._work, name="meshkit-global-batches", daemon=True
        )
        self._thread.start()
        self._moving: _places.Moving | None = None
        if self._node is not None:
            self._moving = _places.Moving(
                self._node,
                _agreement.channel_sequence(self._node),
                "steps:" + self._tag,
                "step {step} of " + _WHAT,
            )
            # Nudged: a service thread waiting out an idle slice (5 s) looks within the period.
            _exit.at(_WATCH + self._tag, _failfast.poll_period(n), self._watch)
        _live.add(self)

    @public
    def __next__(self) -> Any:
        if self._done.is_set():
            raise StopIteration
        asked = time.perf_counter()
        moving = self._moving
        if moving is None:
            batch = self._next()
        else:
            moving.asking = True
            try:
                batch = self._next()
            finally:
                moving.asking = False
            moving.took(self.steps, user_frame(sys._getframe(1)))
        _progress.step(self.steps, asked, time.perf_counter())  # one record, for every guard
        return batch

    def _watch(self) -> None:
        """A look at the caller and for closes, in the service thread each poll period.

        The caller's place is posted if it stays inside a step (`places.Moving.look`: a cycle it
        is in fails it). At the first close, a cycle's notice posted before the close is read
        after it: it is the cause, whatever the caller waits in now; else the close is heard.
        The watch ends then, at the end of the loop, or when the service is gone.
        """
        if self._done.is_set():
            return
        assert self._moving is not None
        node = self._moving.node
        try:
            error = self._moving.look()
            closers = {} if error else _ends.posted(node, self._tag)
        except Exception:  # the service is gone: the failure watch says so
            return
        if closers and not self._done.is_set():
            with contextlib.suppress(Exception):
                error = _places.told(node)
        if error is not None:
            with self._lock:
                self._gone = self._gone or error
            self._fail(error)
        elif not closers:
            period = _failfast.poll_period(node.n)
            _exit.at(_WATCH + self._tag, period, self._watch, nudge=False)
        elif not self._done.is_set():
            self._hear(closers)

    def _next(self) -> Any:
        item = self._prefetch.get()
        if isinstance(item, BaseException):
            self._done.set()
            # after a close was heard, this process asked for a step past it
            self._leave(_ends.ASKS if self._closers else _ends.FAILED)
            raise item
        with self._lock:
            if self._done.is_set():  # closed meanwhile (then the item may be the close's None)
                raise StopIteration
            # asking for a step (or the end) past a close, or having taken one
            error = self._gone or _ends.went_on(self._closers, self._me, self.steps, took=False)
            if error is not None or item is _prefetch.END:
                self._done.set()
            else:
                self.steps += 1
                self._state = item[3]  # the source's position right after this step's read
        if error is not None:
            self._leave(_ends.ASKS)
            raise error
        if item is _prefetch.END:  # every process ends at this step
            self._leave(_ends.ENDED)
            if _profiles.active is not None:  # a trace running to the data's end stops here
                _profiles.active.finish(exiting=False)
            self._report(final=True)
            raise StopIteration
        batch, rows, notes, _ = item
        if notes:
            warn_notes(notes, user_stacklevel())
        self.rows += rows
        self._report()
        return batch

    def _hear(self, closers: dict[int, int]) -> None:
        """Processes that closed early (`_watch`, or the helpers' records); fail if went past."""
        with self._lock:
            for p, k in closers.items():
                self._closers.setdefault(p, k)
            if self._done.is_set() or self._gone is not None:
                return
            error = self._gone = _ends.went_on(self._closers, self._me, self.steps, took=True)
        if error is not None:
            self._leave(_ends.TOOK)  # the closers wait for it before they go on
            self._fail(error)

    def _fail(self, error: DivergenceError) -> None:
        """``error`` for the caller: raised at its next step, or ending the process now.

        A caller inside its step may wait in a collective the others will not join: fail-fast.
        """
        inside = self._moving is not None and not self._moving.asking
        if inside and _failfast.end_for(
            error, f"process {self._me} stops inside step {self.steps} of {_WHAT}: the other "
            "processes will not join its collectives"
        ):  # fmt: skip
            return
        _events.emit(
            _events.FAILED, cause="divergence", error=type(error).__name__,
            processes=error.processes, field=error.field,
        )  # fmt: skip

    def _leave(self, how: str) -> bool:
        """Say once how this process left the loop (`ends.leave`); whether it said it now."""
        with self._lock:
            if self._left or self._node is None:
                return False
            self._left = True
            steps = self.steps
        try:
            _ends.leave(self._node, self._tag, how, steps)
        except Exception:  # the service is gone: the failure watch says so
            return False
        return True

    def _release_helpers(self) -> None:
        """Tell the others' helpers, at their next agreement, that this one stops (once)."""
        with self._lock:
            record, self._release = self._release, None
        if record is not None:  # the others' helpers wait at the helper channel's next agreement
            _agree.leave(self._tag, record, channel=self._tag)

    def close(self) -> None:
        """Stop the helper thread and wait for it; batches not yet taken are dropped.

        Callable from any thread. With several processes, waits until every process has said
        how it left its loop, so nothing after the loop meets another process's step (see
        `global_batches`' ``stop_together``).

        Raises:
            DivergenceError: another process closed its iterator after a different step, or
                went on (took or asked for the next step).
            MeshkitError: another process did not leave its loop within
                ``MESHKIT_CHECK_TIMEOUT``.
        """
        error = self._close()
        if error is not None:
            raise error

    def _close(self, *, at_exit: bool = False, wait: bool = True) -> MeshkitError | None:
        """`close`, returning its error; ``wait=False``: say how this process left, not wait."""
        with self._lock:
            if self._stop.is_set():
                return None  # closed before (the helper has been waited for then)
            ended = self._done.is_set()  # the data ended, or the iterator failed: tell nobody
            self._done.set()
            self._stop.set()
            post = self._node is not None and not ended
            steps = self.steps if post else None  # the others' helpers hear them (else: an end)
            self._release = json.dumps(PartRecord(status="closed", steps=steps).wire())
        self._prefetch.put(None)  # wakes a __next__ waiting for the helper
        error: MeshkitError | None = self._gone  # this caller took a step a closer did not
        said = post and not (at_exit and _exit.ending()) and self._leave(_ends.CLOSED)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_HELPER_STOPS_S)  # between steps, it stops and says so itself
            if self._thread.is_alive():
                self._release_helpers()
                self._thread.join(_JOIN_TIMEOUT_S)
        if said and wait:
            assert self._node is not None
            timeout = _env.check_timeout()
            left = _ends.confirm(self._node, self._tag, timeout)
            error = error or _ends.left_error(left, self._node.n, self._me, timeout)
        if error is not None and at_exit and error is not self._gone:
            _agree.fail_at_exit(error)  # no call will raise it: the process exits 1
        return error

    def __enter__(self) -> GlobalBatches:
        return self

    def __exit__(self, kind: object, exception: object, traceback: object) -> None:
        if exception is None:
            self.close()
        else:  # the exception is the error to show; close's own would hide it
            self._close(wait=False)

    def position(self) -> DataPosition:
        """Where the data stands after the global batches the caller took (not those read ahead).

        Save it with the checkpoint of the same step (``meshkit.checkpoint.save(path, tree,
        data=batches)``) and resume with ``meshkit.global_batches(..., start=position)``. A
        meshkit loader's position is global (any process count); an iterator with
        ``get_state()`` gives this process's state (as many processes); else only the steps.

        Returns:
            A `meshkit.DataPosition`; callable from any thread.

        Examples:
            >>> import numpy as np, meshkit
            >>> mesh = meshkit.make_mesh({"data": -1})
            >>> loader = ({"x": np.full((8, 2), i, np.float32)} for i in range(3))
            >>> with meshkit.global_batches(loader, mesh, "data") as batches:
            ...     _ = next(batches)
            ...     batches.position().step
            1
        """
        with self._lock:
            steps, state = self.steps, self._state
        return self._source.position(steps, state)

    @property
    def rows_per_second(self) -> float:
        """Rows handed to the caller per second since the iterator started."""
        return self.rows / max(1e-9, time.monotonic() - self._started)

    def _report(self, final: bool = False) -> None:
        if self._progress is None or self._me != 0:
            return
        now = time.monotonic()
        if not final and now - self._reported < self._progress:
            return
        self._reported = now
        state = "done" if final else "running"
        rate = f"{self.rows_per_second:,.0f} rows/s"
        say(_LOG, logging.INFO, f"{_WHAT}: {state}, step {self.steps}, {self.rows} rows, {rate}\n")

    def _work(self) -> None:
        with _channel.channel(self._tag), calling(_WHAT, pads=True):
            self._prefetch.run()


@public
def global_batches(
    iterable: Iterable[Any],
    mesh_or_sharding: Mesh | NamedSharding,
    spec: Any = None,
    *,
    prefetch: int = 2,
    pad: BatchPad = False,
    check: BatchCheck = True,
    dtype: Any = None,
    progress: float | None = None,
    stop_together: bool = True,
    start: DataPosition | None = None,
) -> GlobalBatches:
    """Turn an iterable of per-process batches into an iterator of global batches.

    Each process passes its own loader (what it would pass to `meshkit.global_array_from_local`
    step by step). A helper thread assembles the next global batches while the caller computes,
    at most ``prefetch`` ahead. The processes agree on the end of data at every step. A loader's
    exception reaches the caller with its traceback; the other processes raise a
    `meshkit.MeshkitError` naming that process.

    Args:
        iterable: this process's batches (pytrees of arrays). On CPU a global batch may share
            memory with them: a loader must not refill an array it has already yielded.
        mesh_or_sharding: as for `meshkit.global_array_from_local`.
        spec: as for `meshkit.global_array_from_local`.
        prefetch: global batches assembled ahead of the caller (bounds the device memory held).
        pad: ``False``: every loader yields the same number of batches of one size. ``True``:
            each loader's short last batch is padded, loaders that ended contribute padded
            batches until all have, and ``(batch, mask)`` pairs are yielded; a batch short
            before its loader's end is an error naming the process, step and rows.
            ``"ragged"``: short batches are padded at every step.
        check: compare the processes' structure, dtypes and shapes at every step, in the
            helper thread, before the step is yielded; ``"data"`` also hashes every replicated
            block (costly); ``False`` compares only the end of data.
        dtype: cast every array to this dtype.
        progress: seconds between progress lines (steps, rows, rows/s) from process 0, logged
            at INFO under ``meshkit.arrays``; None for none.
        stop_together: check that every process leaves the loop after the same step, so a loop
            left early computes nothing wrong. ``close()`` (or the end of a ``with`` block)
            waits until every process has said how it left its loop, and raises a
            `meshkit.DivergenceError` if one closed after another step or went on; a process
            that goes on raises it at its next step, or, if it already took that step, is
            ended with it within seconds. Nothing is exchanged per step. ``False`` turns the
            check off.
        start: resume at this `meshkit.DataPosition` (`GlobalBatches.position`, or
            `meshkit.checkpoint.data_position`): the first global batch is the one the saved
            run would have taken next, and ``steps`` counts on from it. A meshkit loader's
            position resumes on any number of processes, per-process states (``get_state()``
            / ``set_state()``) on as many; checked and agreed by every process before any read.

    Returns:
        A `GlobalBatches` iterator (``steps``, ``rows``, ``rows_per_second``; ``close()``, or
        use it in a ``with`` block, to stop early).

    Raises:
        DivergenceError: from ``next()`` or ``close()``: processes left the loop at different
            steps (``stop_together``).
        MeshkitError: an argument is not valid; ``start`` does not fit the source; or, from
            ``next()`` on every process at the same step (named): the loaders yielded
            different numbers of batches, a batch is short before its loader's end, the
            batches do not fit together, or another process's loader failed.

    Examples:
        >>> import numpy as np, meshkit
        >>> mesh = meshkit.make_mesh({"data": -1})
        >>> loader = ({"x": np.full((8, 2), i, np.float32)} for i in range(3))
        >>> [float(b["x"].sum()) for b in meshkit.global_batches(loader, mesh, "data")]
        [0.0, 16.0, 32.0]
    """
    return GlobalBatches(
        iterable, mesh_or_sharding, spec, prefetch=prefetch, pad=pad, check=check, dtype=dtype,
        progress=progress, stop_together=stop_together, start=start,
    )  # fmt: skip
