"""The one choke point every SPMD entry of meshkit passes before it runs.

`enter` counts the call and shows it to observers and debug mode's check, if any; without them
it costs a counter increment. The first call checks that a launched rank has joined.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..core import events as _events
from ..debug import divergence as _debug_check
from ..debug import mode as _debug_mode
from ..debug.divergence import CallSite as CallSite
from . import init as _runtime


def param_names(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The positional parameter names of ``fn``, to name arguments in messages (None: unknown)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


_origins: dict[str, int] = {}


def origin(fn: Callable[..., Any]) -> str:
    """Where ``fn`` was defined (``file.py:line``), numbered when one definition makes several."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    code = getattr(inspect.unwrap(target), "__code__", None)
    where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else "?"
    with _lock:
        k = _origins.get(where, 0) + 1
        _origins[where] = k
    return where if k == 1 else f"{where} #{k}"


Observer = Callable[[CallSite, tuple[Any, ...]], None]


def _first_call_step(site: CallSite, args: tuple[Any, ...]) -> None:
    """At this process's first SPMD call: a rank of `meshkit launch` must have joined."""
    remove_observer(_first_call_step)
    named = site.name.startswith("meshkit.")
    _runtime.check_joined(site.name if named else f"meshkit.{site.kind}({site.name})")
    _events.mark("running")  # under `meshkit launch`: this rank got past joining
    _debug_mode.enable_from_environment()


# Shown every SPMD call; with none, and debug mode off, `enter` only counts (fast paths read
# both and count the call themselves).
observers: list[Observer] = [_first_call_step]
_COMPUTATIONS = ("spmd", "pmap_compat")  # the entries that run a program on every process
_lock = threading.Lock()


def count(site: CallSite) -> None:
    """Count a call of ``site``; a computation becomes the latest (a stall names its count)."""
    site.calls += 1
    if site.kind in _COMPUTATIONS:
        _debug_check.latest = site


def enter(site: CallSite, args: tuple[Any, ...]) -> None:
    """Count a call of ``site`` and show it to the observers, if any, before it runs."""
    count(site)
    if observers:
        for observer in tuple(observers):
            observer(site, args)
    if _debug_check.state.settings is not None:
        _debug_check.check(site, args)


def remove_observer(observer: Observer) -> None:
    """Stop showing SPMD calls to ``observer``; one not installed is ignored."""
    with _lock:
        if observer in observers:
            observers.remove(observer)


@contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Install ``observer`` for every SPMD call entered inside the ``with`` block."""
    with _lock:
        observers.append(observer)
    try:
        yield
    finally:
        remove_observer(observer)
