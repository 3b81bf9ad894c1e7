"""The one meshkit thread of a process, ``meshkit-service``, started by the first guard needing it.

Each turn it waits (in the coordination service through fail-fast's `watch`, else on its
pipes), reads SIGTERM's wake-up byte, runs the tasks due (`at`), then the `on_wake` calls. What
it finds either ends the process or is state the next call reads.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable

__all__ = [
    "ACTIVE_SLICE_S", "SLICE_S", "at", "on_activity", "on_signal", "on_wake", "start", "wake",
    "watch",
]  # fmt: skip

SLICE_S = 5.0  # the longest wait in the coordination service while the program is idle
# The longest wait while the program steps (`on_activity` changed within `_ACTIVE_S`).
ACTIVE_SLICE_S = 1.0
_ACTIVE_S = 10.0
_LEAVE_S = 2.0  # at exit, how long `watch(None)` waits for the thread to leave the service

Look = Callable[[float], bool]  # waits that long for posts, acts on them; False: stop


class _Service(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="meshkit-service", daemon=True)
        self.lock = threading.Lock()
        self.tasks: dict[str, tuple[float, Callable[[], None]]] = {}
        self.tending: dict[str, Callable[[], None]] = {}
        self.look: Look | None = None
        self.nudge: Callable[[], None] | None = None
        self.outside = threading.Event()  # not inside the coordination service now
        self.outside.set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.signals = -1  # SIGTERM's wake-up pipe
        self.on_sigterm: Callable[[], None] | None = None
        self.probes: list[Callable[[], object]] = []
        self.seen: tuple[object, ...] = ()
        self.active_at = -_ACTIVE_S

    def _slice(self) -> float:
        """How long a wait in the coordination service may last now."""
        now, seen = time.monotonic(), tuple(probe() for probe in self.probes)
        if seen != self.seen:
            self.seen, self.active_at = seen, now
        return ACTIVE_SLICE_S if now - self.active_at < _ACTIVE_S else SLICE_S

    def run(self) -> None:
        while True:
            timeout = self._run_due()
            self.outside.clear()
            look = self.look
            if look is not None:
                try:
                    if look(min(timeout, self._slice())) is False:
                        self.look = None  # not joined anymore: nothing to watch
                except Exception:  # the watch says its own failures
                    pass
                timeout = 0.0
            self.outside.set()
            ready = [fd for fd in (self.wake_r, self.signals) if fd >= 0]
            try:
                readable, _, _ = select.select(ready, [], [], timeout)
            except (OSError, ValueError):  # a pipe closed under it: wait on the others
                readable = []
            for fd in readable:
                try:
                    data = os.read(fd, 256)
                except OSError:
                    continue
                if fd == self.signals and signal.SIGTERM in data and self.on_sigterm:
                    self.on_sigterm()
            for call in list(self.tending.values()):
                with contextlib.suppress(Exception):  # one tending call must not stop the rest
                    call()

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


def start() -> bool:
    """Start the service thread once; False where no thread may start (the interpreter ends)."""
    global _service
    with _start_lock:
        if _service is None:
            service = _Service()
            try:
                service.start()
            except RuntimeError:  # Python runs its exit handlers: threads cannot start now
                return False
            _service = service
    return True


def wake(*, nudge: bool = True) -> None:
    """Wake the service thread now (from a thread; a signal handler only records its flag)."""
    service = _service
    if service is None:
        return
    with contextlib.suppress(OSError):  # full: a wake-up is pending already
        os.write(service.wake_w, b"w")
    if nudge and service.nudge is not None and not service.outside.is_set():
        with contextlib.suppress(Exception):  # the service is gone: its wait ends by itself
            service.nudge()


def at(name: str, delay: float | None, call: Callable[[], None], *, nudge: bool = True) -> bool:
    """Run ``call`` in the service thread ``delay`` seconds from now (None: cancel ``name``)."""
    if delay is None:
        if _service is not None:
            with _service.lock:
                _service.tasks.pop(name, None)
        return True
    if not start():
        return False
    service = _running()
    with service.lock:
        service.tasks[name] = (time.monotonic() + delay, call)
    wake(nudge=nudge)
    return True


def _running() -> _Service:
    start()
    assert _service is not None
    return _service


def on_wake(name: str, call: Callable[[], None]) -> None:
    """Call ``call`` in the service thread after each of its wake-ups (quick, or it delays)."""
    _running().tending[name] = call
    wake(nudge=False)


def on_activity(probe: Callable[[], object]) -> None:
    """Count a change of ``probe()`` (read once per wait) as the program stepping."""
    _running().probes.append(probe)


def on_signal(fd: int, handler: Callable[[], None]) -> None:
    """Call ``handler`` when SIGTERM's wake-up byte arrives on pipe ``fd`` (-1: none)."""
    service = _running()
    service.signals, service.on_sigterm = fd, handler
    wake(nudge=False)


def watch(look: Look | None, nudge: Callable[[], None] | None = None) -> None:
    """Wait in the coordination service with ``look`` (None: stop, and leave it)."""
    if _service is None and look is None:
        return
    service = _running()
    if look is not None:
        service.look, service.nudge = look, nudge
        wake(nudge=False)
        return
    service.look = None
    wake()
    service.outside.wait(_LEAVE_S)
    service.nudge = None
