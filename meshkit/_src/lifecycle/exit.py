"""The one owner of process exit: the exception hook, exit handlers, SIGTERM, the final exit.

Installed on first use. At a normal end the exit handlers run by order (`STOP`, `LEAVE`,
`DRAIN`, `FLUSH`) before JAX's shutdown barrier. `end` ends a failing process (handlers bounded
by ``grace``, JAX's barrier skipped); `now` exits at once. This module holds the only
``os._exit``.
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
    "DRAIN", "FLUSH", "LEAVE", "REPORT", "STOP", "end", "ending", "now", "on_exception", "on_exit",
    "on_sigterm", "run_exit_handlers",
]  # fmt: skip

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
    table[name] = _Handler(name, order, old.seq if old else next(_seq), call)


def on_exit(name: str, handler: Callable[[], None], *, order: int) -> None:
    """Run ``handler`` when this process ends, at ``order`` (`STOP`, `LEAVE`, `DRAIN`, `FLUSH`)."""
    with _lock:
        _add(_registry.exit, name, handler, order)
        if not _registry.atexit_installed:
            _registry.atexit_installed = True
            _add(_registry.exit, "flush stdout and stderr", _flush, FLUSH)
            atexit.register(run_exit_handlers)


def on_exception(name: str, handler: ExceptionHandler, *, order: int) -> None:
    """Call ``handler(kind, value, traceback)`` on an uncaught exception in the main thread."""
    with _lock:
        _add(_registry.exception, name, handler, order)
        if _registry.previous_hook is None:
            _registry.previous_hook = sys.excepthook
            sys.excepthook = _excepthook


def on_sigterm(handler: Callable[[], None]) -> int:
    """Call ``handler`` in the main thread on SIGTERM, even while that thread waits in C."""
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
    """End this failing process: exit handlers for at most ``grace`` s, ``final``, then exit."""
    if not _ending.acquire(blocking=False):
        return
    if announce:
        say(_LOG, level, announce)
    if _registry.interpreter_exiting or not _service_thread.at(
        "exit: bound the exit handlers", grace, lambda: _late(late, level, status, final)
    ):
        # Reached from an exit handler: they run already, and no thread may start now.
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
    """Say ``message`` and exit with ``status`` at once, running no exit handler."""
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
