"""Settings read from environment variables: one parser, one wording for a bad value.

Read when needed, never at import. Unset or blank is None (the caller applies its default); a
value that is set but not accepted is a `MeshkitError` naming the variable and the call.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import TypeVar

from .errors import MeshkitError

ENV_CHECK_TIMEOUT = "MESHKIT_CHECK_TIMEOUT"
_DEFAULT_CHECK_TIMEOUT_S = 120.0
T = TypeVar("T")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def raw(name: str) -> str | None:
    """The variable's value, stripped; None when it is unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def _bad(where: str, name: str, value: str, rule: str) -> MeshkitError:
    prefix = f"{where}: environment variable " if where else ""
    return MeshkitError(f"{prefix}{name}={value!r} {rule}.")


def _parse(name: str, where: str, convert: Callable[[str], T], rule: str) -> T | None:
    value = raw(name)
    if value is None:
        return None
    try:
        return convert(value)
    except ValueError:
        raise _bad(where, name, value, rule) from None


def integer(name: str, *, where: str = "") -> int | None:
    """An integer setting (None when unset)."""
    return _parse(name, where, int, "is not an integer")


def number(name: str, *, where: str = "") -> float | None:
    """A number of seconds as given (None when unset); the caller checks its range."""
    return _parse(name, where, float, "is not a number of seconds")


def seconds(
    name: str, *, where: str = "", zero: str | None = None, positive: bool = True
) -> float | None:
    """A duration in seconds (None when unset): finite, and > 0 unless told otherwise."""
    value = number(name, where=where)
    if value is None:
        return None
    if not positive:
        rule, ok = "must be a finite number of seconds >= 0", value >= 0
    else:
        rule = "must be a finite number of seconds > 0" + (f" (0: {zero})" if zero else "")
        ok = value > 0 or (value == 0 and zero is not None)
    if not (math.isfinite(value) and ok):
        raise _bad(where, name, raw(name) or "", rule)
    return value


def flag(
    name: str, *, where: str = "", on: str = "on", off: str = "off", blank: bool | None = None
) -> bool | None:
    """A yes/no setting: True, False, or ``blank`` when unset or empty."""
    value = raw(name)
    if value is None:
        return blank
    if value.lower() in TRUE + FALSE:
        return value.lower() in TRUE
    empty = "empty, " if blank is False else ""
    rule = f"is not one of {', '.join(TRUE)} ({on}) or {empty}{', '.join(FALSE)} ({off})"
    raise _bad(where, name, value, rule)


def ids(name: str, *, where: str = "") -> tuple[int, ...] | None:
    """A comma-separated list of integers (device ids), None when unset."""
    rule = "is not a comma-separated list of device ids, e.g. '0,1'"
    return _parse(name, where, lambda v: tuple(int(x) for x in v.split(",")), rule)


def check_timeout() -> float:
    """Seconds an agreement between processes waits for the others (``MESHKIT_CHECK_TIMEOUT``)."""
    value = seconds(ENV_CHECK_TIMEOUT, where="meshkit")
    return _DEFAULT_CHECK_TIMEOUT_S if value is None else value


# The variables that list a process's visible accelerators, in the order read.
VISIBLE_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def visible_devices(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """The variable that lists this process's visible accelerators, and how many it lists."""
    for name in VISIBLE_VARS:
        if name in environ:
            entries = [e.strip() for e in environ[name].split(",") if e.strip()]
            if entries[:1] == ["-1"]:
                entries = []
            return name, len(entries)
    return None
