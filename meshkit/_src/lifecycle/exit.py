"""The one owner of process exit: the exception hook, exit handlers, SIGTERM, the final exit.

Nothing is installed at import: the first `on_exit` adds one entry to Python's ``atexit`` list,
the first `on_exception` wraps `sys.excepthook`, `on_sigterm` takes SIGTERM (chained to the
program's handler), each once, whoever asks first.

**At a normal end** meshkit's ``atexit`` entry (registered after JAX's, so run before it) calls
the exit handlers by order, then by registration: `STOP` (stop the watch and helper threads,
arm the end note), `LEAVE` (tell the others this process leaves), `DRAIN` (let agreements in
flight finish), `FLUSH` (stdout and stderr). A handler that raises is logged (``meshkit.guards``)
and the next runs; each runs once. JAX's shutdown barrier follows.

**An uncaught exception** runs the exception handlers below `REPORT`, the hook it replaced
(the traceback), then those from `REPORT` (fail-fast's, which calls `end`).

**Ending a failing process**: `end` runs the exit handlers (and the rest of Python's ``atexit``
list, without JAX's shutdown barrier, which would wait for processes that go on) for at most
``grace`` seconds, bounded by a task of the service thread, then the caller's ``final`` step,
then exits; `now` exits at once. The first path that ends the process wins; this module holds
the process's only ``os._exit``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..core import compat as _compat
from ..core.log import flush as flush_logs
from ..core.log import logger, say
from . import service_thread as _service_thread

_LOG = logger("guards")

__all__ = [
    "DRAIN",
    "FLUSH",
    "LEAVE",
    "REPORT",
    "STOP",
    "end",
    "ending",
    "now",
    "on_exception",
    "on_exit",
    "on_sigterm",
    "run_exit_handlers",
]

# The orders of exit handlers (see the module's docstring); lower runs first.
STOP = 10
LEAVE = 20
DRAIN = 30
REPORT = 40  # exception handlers: below it before the traceback is printed, from it after
FLUSH = 50

ExceptionHandler = Callable[[type[BaseException], BaseException, TracebackType | None], None]


@dataclass(frozen=True)
class _Handler:
    name: str
    order: int
    seq: int
    call: Callable[..., None]


@dataclass
class _Registry:
    """What this process does when it ends (one instance; tests make their own)."""

    exit: dict[str, _Handler] = field(default_factory=dict)
    exception: dict[str, _Handler] = field(default_factory=dict)
    ran: set[str] = field(default_factory=set)  # exit handlers already run
    atexit_installed: bool = False
    previous_hook: ExceptionHandler | None = None  # the excepthook meshkit's replaced
    previous_sigterm: Callable[[int, Any], Any] | None = None  # the program's, chained
    sigterm_wakeup: int | None = None  # None: SIGTERM not taken yet
    interpreter_exiting: bool = False  # Python runs its atexit list: no thread may start now


_registry = _Registry()
_lock = threading.RLock()
_seq = itertools.count()
_ending = threading.Lock()  # held by whichever path ends this process first
_final = threading.Lock()  # held by the path that makes the final exit


def _add(table: dict[str, _Handler], name: str, call: Callable[..., None], order: int) -> None:
    old = table.get(name)
    # Registering a name again replaces its handler in place: registration is idempotent.
    table[name] = _Handler(name, order, old.seq if old else next(_seq), call)


def on_exit(name: str, handler: Callable[[], None], *, order: int) -> None:
    """Run ``handler`` when this process ends, at ``order`` (`STOP`, `LEAVE`, `DRAIN`, `FLUSH`).

    Args:
        name: what the handler does, for messages; registering a name again replaces it.
        handler: called with no arguments, once.
        order: when it runs; handlers of one order run in the order they were registered.
    """
    with _lock:
        _add(_registry.exit, name, handler, order)
        if not _registry.atexit_installed:
            _registry.atexit_installed = True
            _add(_registry.exit, "flush stdout and stderr", _flush, FLUSH)
            atexit.register(run_exit_handlers)


def on_exception(name: str, handler: ExceptionHandler, *, order: int) -> None:
    """Call ``handler(kind, value, traceback)`` on an uncaught exception in the main thread.

    Args:
        name: what the handler does, for messages; registering a name again replaces it.
        handler: below `REPORT` it runs before the traceback is printed, from it after.
        order: when it runs among the exception handlers.
    """
    with _lock:
        _add(_registry.exception, name, handler, order)
        if _registry.previous_hook is None:
            _registry.previous_hook = sys.excepthook
            sys.excepthook = _excepthook


def on_sigterm(handler: Callable[[], None]) -> int:
    """Call ``handler`` in the main thread on SIGTERM, even while that thread waits in C.

    Python runs a signal handler in the main thread between bytecodes, so a main thread blocked
    in a collective would never run it; the signal also writes a wake-up byte to a pipe, whose
    read end a watching thread can select on to act itself (fail-fast's failure watch does).
    Only the main thread may take a signal; SIGTERM is taken once (a second call replaces the
    handler and returns the same pipe). A Python handler the program set before is chained:
    called after ``handler``, with the signal's arguments.

    Returns:
        The wake-up pipe's read end; -1 where a wake-up fd was in use already (asyncio's), or
        when called from another thread: there only the main thread's handler acts.
    """
    with _lock:
        if threading.current_thread() is not threading.main_thread():
            return -1
        before = signal.getsignal(signal.SIGTERM)
        if callable(before) and not getattr(before, "_meshkit", False):
            _registry.previous_sigterm = before

        def take(signum: int, frame: Any) -> None:
            handler()
            previous = _registry.previous_sigterm
            if previous is not None:
                previous(signum, frame)

        take._meshkit = True  # type: ignore[attr-defined]
        signal.signal(signal.SIGTERM, take)
        if _registry.sigterm_wakeup is not None:
            return _registry.sigterm_wakeup
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            read = -1
        _registry.sigterm_wakeup = read
        return read


def _ordered(table: dict[str, _Handler]) -> list[_Handler]:
    with _lock:
        return sorted(table.values(), key=lambda h: (h.order, h.seq))


def _call(handler: _Handler, *args: object) -> None:
    try:
        handler.call(*args)
    except Exception as e:  # one handler's failure must not keep the others from running
        say(
            _LOG,
            logging.ERROR,
            f"meshkit: the exit handler {handler.name!r} failed: {type(e).__name__}: {e}\n",
        )


def run_exit_handlers() -> None:
    """Run meshkit's exit handlers not run yet, in order (Python's ``atexit`` calls this)."""
    if not _ending.locked():  # not `end` running them: the program ended, Python is exiting
        _registry.interpreter_exiting = True
    for handler in _ordered(_registry.exit):
        with _lock:
            if handler.name in _registry.ran:
                continue
            _registry.ran.add(handler.name)
        _call(handler)


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    handlers = _ordered(_registry.exception)
    for handler in handlers:
        if handler.order < REPORT:
            _call(handler, kind, value, tb)
    previous = _registry.previous_hook or sys.__excepthook__
    previous(kind, value, tb)
    for handler in handlers:
        if handler.order >= REPORT:
            _call(handler, kind, value, tb)


def ending() -> bool:
    """Whether a path (`end`, `now`) is ending this process already."""
    return _ending.locked()


def end(
    status: int,
    *,
    grace: float,
    announce: str = "",
    late: str = "",
    final: Callable[[], None] | None = None,
    level: int = logging.ERROR,
) -> None:
    """End this failing process: exit handlers for at most ``grace`` s, ``final``, then exit.

    Returns at once if another path is ending the process already. From the main thread the
    exit handlers run here (meshkit's and the rest of Python's ``atexit`` list, JAX's shutdown
    barrier taken off it: it would wait for processes that go on); from another thread only the
    time bound applies.

    Args:
        status: the exit status.
        grace: seconds the exit handlers get.
        announce: said first (what ends the process), logged under ``meshkit.guards``.
        late: said when the exit handlers are still running after ``grace`` seconds.
        final: the last step before the exit (run once, whichever path exits).
        level: the `logging` level of ``announce`` and ``late``.
    """
    if not _ending.acquire(blocking=False):
        return
    if announce:
        say(_LOG, level, announce)
    if _registry.interpreter_exiting or not _service_thread.at(
        "exit: bound the exit handlers", grace, lambda: _late(late, level, status, final)
    ):
        # Reached from an exit handler (a SIGTERM while Python runs its atexit list): the
        # handlers are running already, and no thread may start to bound them. Exit now.
        _exit(status, final)
        return
    if threading.current_thread() is threading.main_thread():
        _compat.skip_jax_exit_barrier()
        atexit._run_exitfuncs()
    _exit(status, final)


def _late(late: str, level: int, status: int, final: Callable[[], None] | None) -> None:
    if late:
        say(_LOG, level, late)
    _exit(status, final)


def now(status: int, message: str = "", *, level: int = logging.ERROR) -> None:
    """Say ``message`` and exit with ``status`` at once, running no exit handler.

    For a process that must not wait for anything (a stall that would last for ever, a peer
    that failed). Returns at once if another path is ending the process already.
    """
    if not _ending.acquire(blocking=False):
        return
    if message:
        say(_LOG, level, message)
    _exit(status, None)


def _exit(status: int, final: Callable[[], None] | None) -> None:
    """The process's final exit: ``final`` once, flushed output, ``os._exit``."""
    if not _final.acquire(blocking=False):
        time.sleep(3600)  # the other path is in its final step, and exits this process
        return
    if final is not None:
        with contextlib.suppress(Exception):  # exiting anyway: its failure changes nothing
            final()
    _flush()
    os._exit(status)


def _flush() -> None:
    with contextlib.suppress(Exception):  # a closed stream has nothing left to lose
        sys.stdout.flush()
        sys.stderr.flush()
    flush_logs()  # a message said just before `os._exit` must leave this process first
