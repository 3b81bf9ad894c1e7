"""Debug mode's switch: `enable`, `disable`, its settings, and what it starts while on.

On: stalls are reported sooner (`stall.configure`), and the record this process leaves at exit
names its last checked call. Nothing happens at import: `meshkit.init` and the first SPMD call run
`enable_from_environment`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator
from typing import Any

from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError
from ..core.frames import public
from ..core.log import logger, say
from ..lifecycle import progress as _progress
from ..lifecycle import stall as _stall
from .divergence import Settings, enabled, lock, state

_LOG = logger("debug")

ENV_DEBUG = "MESHKIT_DEBUG"
ENV_DEBUG_TIMEOUT = "MESHKIT_DEBUG_TIMEOUT"
ENV_WATCHDOG = "MESHKIT_WATCHDOG"


@public
def enable(
    *,
    timeout: float | None = None,
    watchdog: float | str | None = "auto",
    exit_on_stall: bool = True,
) -> None:
    """Turn debug mode on in this process (every process of the program must do the same).

    Args:
        timeout: seconds each call waits for the other processes before naming the missing
            ones (default ``MESHKIT_DEBUG_TIMEOUT``, else ``MESHKIT_CHECK_TIMEOUT``, else 120);
            longer than any gap between two SPMD calls.
        watchdog: seconds without progress on every process before each says where every
            process waits and which holds the run; ``"auto"``: ``MESHKIT_WATCHDOG``, else half
            the timeout; None or 0: as without debug mode (``MESHKIT_STALL_TIMEOUT``).
            Multi-process programs only.
        exit_on_stall: end the run (status 1) if still no progress ``timeout`` seconds after
            the watchdog's report.

    Raises:
        MeshkitError: a timeout or watchdog that is not a positive number.

    Examples:
        >>> import meshkit
        >>> meshkit.debug.enable(timeout=30, watchdog=None)
        >>> meshkit.debug.enabled()
        True
        >>> meshkit.debug.disable()
    """
    if timeout is None:
        timeout = _env.seconds(ENV_DEBUG_TIMEOUT) or _env.check_timeout()
    timeout = positive(timeout, "timeout")
    if watchdog == "auto":
        env = _env.seconds(ENV_WATCHDOG, zero="off")
        watchdog = timeout / 2 if env is None else env
    watchdog = None if watchdog is None or watchdog == 0 else positive(watchdog, "watchdog")
    with lock:
        now = state.settings = Settings(timeout, watchdog, bool(exit_on_stall))
        _progress.note_progress()
        if watchdog is None:
            _stall.configure(None)
        else:
            deadline = watchdog + timeout if exit_on_stall else None
            source = f"debug mode: watchdog {watchdog:g} s + timeout {timeout:g} s"
            _stall.configure(_stall.Settings(watchdog, deadline, source))
        if now != state.announced:  # said once per process and settings
            state.announced = now
            _, me, n = _compat.distributed_state()
            shown = "off" if now.watchdog is None else f"{now.watchdog:g} s"
            who = f"process {me} of {n}" if n > 1 else "this process"
            text = (
                f"meshkit debug: on in {who}: timeout {now.timeout:g} s, watchdog {shown}, "
                f"exit_on_stall {now.exit_on_stall} (meshkit.debug.enable sets them).\n"
            )
            say(_LOG, logging.INFO, text)


@public
def disable() -> None:
    """Turn debug mode off in this process (stalls are reported as without it)."""
    with lock:
        _stall.configure(None)
        state.settings = None
        state.sites.clear()


def settings() -> Settings | None:
    """The current `Settings`, or None when debug mode is off."""
    return state.settings


@contextlib.contextmanager
def debugging(**kwargs: Any) -> Iterator[None]:
    """Debug mode inside a ``with`` block (arguments as for `enable`); off again after it."""
    was = state.settings
    enable(**kwargs)
    try:
        yield
    finally:
        disable() if was is None else enable(**dataclasses.asdict(was))


@public
def enable_from_environment() -> None:
    """Turn debug mode on if ``MESHKIT_DEBUG`` asks for it (meshkit asks at `meshkit.init`).

    Raises:
        MeshkitError: ``MESHKIT_DEBUG`` (or the timeout or watchdog variable) holds a value
            that is not accepted.
    """
    if not enabled() and _env.flag(ENV_DEBUG, on="debug mode on", blank=False):
        enable()


def positive(value: Any, what: str, where: str = "meshkit.debug.enable") -> float:
    """``value`` as a float; a `MeshkitError` unless it is a finite positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise MeshkitError(
            f"{where}: {what} must be a finite positive number of seconds; got {value!r}."
        )
    return float(value)
