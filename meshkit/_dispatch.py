"""The one choke point every SPMD entry of meshkit passes before it runs.

`spmd` (and, later, `pmap_compat` and `global_array_from_local`) create one `CallSite` each and
call `enter` on every call. With no observer installed that is a counter increment and one
truthiness test, nothing measurable next to a JAX dispatch. Observers (divergence checks,
tracing, tests) see the site and the call's arguments before anything runs; what they raise
reaches the caller unchanged, and the call does not run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CallSite", "Observer", "enter", "observing"]


@dataclass(eq=False)
class CallSite:
    """One SPMD entry point a program created (for example one `meshkit.spmd` function).

    Attributes:
        kind: which meshkit entry created it (``"spmd"``, ...).
        name: the user's function name (``module.qualname``), for messages.
        calls: how many times it has been entered in this process.
        info: entry-specific facts observers may use (mesh, specs, ...).
    """

    kind: str
    name: str
    calls: int = 0
    info: dict[str, Any] = field(default_factory=dict)


Observer = Callable[[CallSite, tuple[Any, ...]], None]

_observers: list[Observer] = []
_lock = threading.Lock()


def enter(site: CallSite, args: tuple[Any, ...]) -> None:
    """Count a call of ``site`` and show it to the observers, if any, before it runs."""
    site.calls += 1
    if _observers:
        for observer in tuple(_observers):
            observer(site, args)


@contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Install ``observer`` for every SPMD call entered inside the ``with`` block."""
    with _lock:
        _observers.append(observer)
    try:
        yield
    finally:
        with _lock:
            _observers.remove(observer)
