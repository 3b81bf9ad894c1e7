"""The one owner of process exit: the exception hook, exit handlers, SIGTERM, the final exit.

Installed on first use. At a normal end the exit handlers run by order (`STOP`, `DRAIN`,
`FLUSH`) before JAX's shutdown barrier. `end` ends a failing process (handlers bounded
by ``grace``, JAX's barrier skipped); `now` exits at once. This module holds the only
``os._exit``.

Also the process's one meshkit thread, ``meshkit-service``, started by the first guard needing
it. Each turn it waits (in the coordination service through fail-fast's `watch`, else on its
pipes), reads SIGTERM's wake-up byte, runs the tasks due (`at`), then the `tend` call. At exit
`stop` ends its talk with the other processes before JAX's shutdown.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
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

_LOG = logger("guards")

# The orders of exit handlers (see the module's docstring); lower runs first.
STOP = 10
DRAIN = 15  # the deferred checks verified, then this process's leave posted
FLUSH = 50

ExceptionHandler = Callable[[type[BaseException], BaseException, TracebackType | None], None]


@dataclass(frozen=True)
class _Handler:
    name: str
    order: int
    call: Callable[..., None]


@dataclass
class _Registry:
    """What this process does when it ends (one instance; tests make their own)."""

    exit: dict[str, _Handler] = field(default_factory=dict)
    exception: _Handler | None = None  # called after an uncaught exception's traceback
    ran: set[str] = field(default_factory=set)  # exit handlers already run
    atexit_installed: bool = False
    previous_hook: ExceptionHandler | None = None  # the excepthook meshkit's replaced
    previous_sigterm: Callable[[int, Any], Any] | None = None  # the program's, chained
    sigterm_wakeup: int | None = None  # the wake-up fd found (-1: none); None: SIGTERM not taken
    interpreter_exiting: bool = False  # Python runs its atexit list: no thread may start now
    count: Callable[[], object] | None = None  # counts this process's end (`count_ends`)


_registry = _Registry()
_lock = threading.RLock()
_ending = threading.Lock()  # held by whichever path ends this process first
_claimant: int | None = None  # the thread that holds `_ending`
_final = threading.Lock()  # held by the path that makes the final exit


def on_exit(name: str, handler: Callable[[], None], *, order: int) -> None:
    """Run ``handler`` when this process ends, at ``order`` (`STOP`, `DRAIN`, `FLUSH`)."""
    with _lock:
        _registry.exit[name] = _Handler(name, order, handler)
        if not _registry.atexit_installed:
            _registry.atexit_installed = True
            flush = _Handler("flush stdout and stderr", FLUSH, _flush)
            _registry.exit[flush.name] = flush
            atexit.register(run_exit_handlers)


def on_exception(name: str, handler: ExceptionHandler) -> None:
    """Call ``handler(kind, value, traceback)`` on an uncaught exception in the main thread.

    The exception claims the end of the process before its traceback is printed (a path that
    holds it already ends the process: a peer's failure, read a moment earlier, whose echo this
    error is); ``handler`` runs after the traceback.
    """
    with _lock:
        _registry.exception = _Handler(name, FLUSH, handler)
        if _registry.previous_hook is None:
            _registry.previous_hook = sys.excepthook
            sys.excepthook = _excepthook


def on_sigterm(handler: Callable[[], object]) -> None:
    """Call ``handler`` on SIGTERM (from the service thread while the main thread waits in C)."""
    if threading.current_thread() is not threading.main_thread():
        return
    service = _running()
    with _lock:
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
        if _registry.sigterm_wakeup is None:  # Python's C handler writes the signal's number
            previous = signal.set_wakeup_fd(service.wake_w, warn_on_full_buffer=False)
            if previous != -1:  # the program reads the wake-up fd: leave it its own
                signal.set_wakeup_fd(previous)
            _registry.sigterm_wakeup = previous
    service.on_sigterm = handler
    wake(nudge=False)


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
    with _lock:  # by order, then first registration (a dict keeps a replaced entry's place)
        handlers = sorted(_registry.exit.values(), key=lambda h: h.order)
    for handler in handlers:
        with _lock:
            if handler.name in _registry.ran:
                continue
            _registry.ran.add(handler.name)
        _call(handler)


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not claim():
        await_end()
    (_registry.previous_hook or sys.__excepthook__)(kind, value, tb)
    if _registry.exception is not None:
        _call(_registry.exception, kind, value, tb)


def ending() -> bool:
    """Whether a path (`end`, `now`) is ending this process already."""
    return _ending.locked()


def claim() -> bool:
    """Take the one right to end this process; False: another thread's path ends it already.

    Whoever claims first has its record of why it ends stand; that thread may claim again.
    """
    global _claimant
    me = threading.get_ident()
    if _claimant == me:
        return True
    if not _ending.acquire(blocking=False):
        return False
    _claimant = me
    return True


def await_end() -> None:
    """Wait (30 s at most) for the path that holds `claim` to exit: Python's exit must not start."""
    if _ending.locked():
        time.sleep(30.0)


def end(status: int, *, grace: float, announce: str = "", late: str = "",
        final: Callable[[], None] | None = None, level: int = logging.ERROR) -> None:  # fmt: skip
    """End this failing process: exit handlers for at most ``grace`` s, ``final``, then exit."""
    if not claim():
        return
    if announce:
        say(_LOG, level, announce)

    def too_late() -> None:
        if late:
            say(_LOG, level, late)
        _exit(status, final)

    # Reached from an exit handler, the handlers run already and no thread may start now.
    bounded = not _registry.interpreter_exiting and at("exit: bound the handlers", grace, too_late)
    if bounded and threading.current_thread() is threading.main_thread():
        _compat.skip_jax_exit_barrier()
        atexit._run_exitfuncs()
    _exit(status, final)


def now(status: int, message: str = "", *, level: int = logging.ERROR) -> None:
    """Say ``message`` and exit with ``status`` at once, running no exit handler."""
    if not claim():
        return
    if message:
        say(_LOG, level, message)
    _exit(status, None)


def _exit(status: int, final: Callable[[], None] | None) -> None:
    """The process's final exit: ``final`` once, flushed output, its end counted, ``os._exit``."""
    if not _final.acquire(blocking=False):
        time.sleep(3600)  # the other path is in its final step, and exits this process
        return
    if final is not None:
        with contextlib.suppress(Exception):  # exiting anyway: its failure changes nothing
            final()
    _flush()
    _count_end()
    os._exit(status)


def _flush() -> None:
    with contextlib.suppress(Exception):  # a closed stream has nothing left to lose
        sys.stdout.flush()
        sys.stderr.flush()
    flush_logs()  # a message said just before `os._exit` must leave this process first


# Process 0 hosts the coordination service; a process that loses it while it still posts or reads
# there (its failure, a stall verdict, a notice) ends with gRPC's words or JAX's abort, not
# meshkit's. So every other process counts its end there as its last step (at `os._exit`, or
# last of the exit handlers at a normal end, its service thread stopped before: `stop`), and
# process 0, ended by meshkit, first waits until all have counted (at most `_OUTLIVE_S`), then
# `_MARGIN_S` for their exits; at a normal end JAX's shutdown barrier waits for them.
_OUTLIVE_S = 10.0
_MARGIN_S = 0.5


def count_ends(count: Callable[[int], int] | None, me: int = 0, n: int = 1) -> None:
    """Count the end of process ``me`` of ``n`` with ``count`` (None: the service is gone).

    ``count(k)`` adds ``k`` to the count of ended processes at the service and returns it.
    """
    if count is None:
        _registry.count = None
        return

    def wait() -> None:  # process 0's last step: until every other process counted its end
        deadline = time.monotonic() + _OUTLIVE_S
        while count(0) < n - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(_MARGIN_S)

    _registry.count = wait if me == 0 else lambda: count(1)
    # After every STOP handler: they end the tasks that talk to the others.
    on_exit("service thread: stop talking to the others", stop, order=STOP + 1)
    if me != 0:  # process 0's normal end: JAX's shutdown barrier waits for the others
        on_exit("count this process's end", _count_end, order=FLUSH)


def _count_end() -> None:
    """Count this process's end, once (process 0: wait for the others' counts)."""
    with _lock:
        count, _registry.count = _registry.count, None
    with contextlib.suppress(Exception):  # the service is gone: nobody waits, nobody counts
        if count is not None:
            count()


_SLICE_S = 5.0  # the longest wait in the coordination service while the program is idle
_ACTIVE_SLICE_S = 1.0  # ... while the program steps (`tend`'s step changed within `_ACTIVE_S`)
_ACTIVE_S = 10.0
_LEAVE_S = 2.0  # at exit, how long `stop` waits for the service thread's turn in flight

Look = Callable[[float], bool]  # waits that long for posts, acts on them; False: stop


class _Service(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="meshkit-service", daemon=True)
        self.lock = threading.Lock()
        self.tasks: dict[str, tuple[float, Callable[[], None]]] = {}
        self.tend: Callable[[], None] | None = None
        self.look: Look | None = None
        self.nudge: Callable[[], None] | None = None
        self.busy = threading.Lock()  # held while a turn runs: `stop` waits for the one in flight
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.on_sigterm: Callable[[], object] | None = None
        self.step: Callable[[], object] = lambda: None
        self.seen: object = None  # the step last read (`tend` reads the first)
        self.active_at = -_ACTIVE_S

    def _slice(self) -> float:
        """How long a wait in the coordination service may last now."""
        now, seen = time.monotonic(), self.step()
        if seen != self.seen:
            self.seen, self.active_at = seen, now
        return _ACTIVE_SLICE_S if now - self.active_at < _ACTIVE_S else _SLICE_S

    def run(self) -> None:
        while True:
            with self.busy:
                timeout = self._run_due()
                look = None if stopping.is_set() else self.look
                if look is not None:
                    with contextlib.suppress(Exception):  # the watch says its own failures
                        if look(min(timeout, self._slice())) is False:
                            self.look = None  # not joined anymore: nothing to watch
                    timeout = 0.0
            with contextlib.suppress(OSError):  # wake-ups, and signals' numbers (`on_sigterm`)
                woken = select.select([self.wake_r], [], [], timeout)[0]
                if woken and signal.SIGTERM in os.read(self.wake_r, 256) and self.on_sigterm:
                    self.on_sigterm()
            with self.busy, contextlib.suppress(Exception):  # `tend` says its own failures
                if self.tend is not None and not stopping.is_set():
                    self.tend()

    def _run_due(self) -> float:
        """Run the tasks that are due; the seconds until the next one (an hour: none)."""
        while True:
            now = time.monotonic()
            with self.lock:
                due = [(name, call) for name, (t, call) in self.tasks.items() if t <= now]
                for name, _ in due:
                    del self.tasks[name]
                later = min((t for t, _ in self.tasks.values()), default=now + 3600.0)
            if not due:
                return max(0.0, later - now)
            for _, call in due:
                with contextlib.suppress(Exception):  # a task says its own failures
                    call()


_service: _Service | None = None
_start_lock = threading.Lock()


def _running() -> _Service:
    """The service thread, started at the first call (RuntimeError where no thread may start)."""
    global _service
    with _start_lock:
        if _service is None:
            service = _Service()
            service.start()
            _service = service
        return _service


def wake(*, nudge: bool = True) -> None:
    """Wake the service thread now; ``nudge``: also end its wait in the coordination service."""
    service = _service
    if service is None:
        return
    with contextlib.suppress(OSError):  # full: a wake-up is pending already
        os.write(service.wake_w, b"w")
    if nudge and service.nudge is not None and service.busy.locked():
        with contextlib.suppress(Exception):  # the service is gone: its wait ends by itself
            service.nudge()


def at(name: str, delay: float, call: Callable[[], None], *, nudge: bool = True) -> bool:
    """Run ``call`` in the service thread ``delay`` seconds from now; False if it cannot start."""
    try:
        service = _running()
    except RuntimeError:  # Python runs its exit handlers: threads cannot start now
        return False
    with service.lock:
        service.tasks[name] = (time.monotonic() + delay, call)
    wake(nudge=nudge)
    return True


def tend(call: Callable[[], None], step: Callable[[], object]) -> None:
    """Call ``call`` in the service thread after each of its wake-ups (quick, or it delays).

    A change of ``step()`` (read once per wait) is the program stepping: its waits are shorter.
    """
    service = _running()
    service.tend, service.step, service.seen = call, step, step()  # idle until a step changes
    wake(nudge=False)


def watch(look: Look, nudge: Callable[[], None]) -> None:
    """Wait in the coordination service with ``look``; ``nudge`` ends such a wait at once."""
    service = _running()
    service.look, service.nudge = look, nudge
    wake(nudge=False)


# Set at this process's end (`stop`): the service thread's turns (`watch`, `tend`, and the tasks
# that check it) talk to the other processes no more. A gather in flight stops waiting at it.
stopping = threading.Event()


def stop() -> None:
    """Stop the service thread's talk with the others, and wait for its turn in flight.

    Before this process counts its end, and before JAX's shutdown: a request still in flight
    when process 0 shuts the coordination service down aborts this process.
    """
    stopping.set()
    service = _service
    if service is None or threading.current_thread() is service:
        return
    wake()  # its wait in the coordination service ends now
    if service.busy.acquire(timeout=_LEAVE_S):
        service.busy.release()
