"""Settings read from environment variables: one parser, one wording for a bad value.

Every ``MESHKIT_*`` setting is read here, when it is needed (never at import). A value that is
set but not accepted is a `MeshkitError` naming the variable, the value and what is accepted;
an unset or blank variable is None, and the caller applies its default. ``where`` names the
call that read it (``"meshkit.init()"``), so the user knows when the setting was consulted.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from .errors import MeshkitError

__all__ = [
    "ENV_CHECK_TIMEOUT",
    "FALSE",
    "TRUE",
    "VISIBLE_VARS",
    "check_timeout",
    "flag",
    "ids",
    "integer",
    "number",
    "raw",
    "seconds",
    "visible_devices",
]

ENV_CHECK_TIMEOUT = "MESHKIT_CHECK_TIMEOUT"
_DEFAULT_CHECK_TIMEOUT_S = 120.0
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def raw(name: str) -> str | None:
    """The variable's value, stripped; None when it is unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def _bad(where: str, name: str, value: str, rule: str) -> MeshkitError:
    prefix = f"{where}: environment variable " if where else ""
    return MeshkitError(f"{prefix}{name}={value!r} {rule}.")


def integer(name: str, *, where: str = "") -> int | None:
    """An integer setting (None when unset)."""
    value = raw(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise _bad(where, name, value, "is not an integer") from None


def _number(name: str, text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise _bad(where, name, text, "is not a number of seconds") from None


def number(name: str, *, where: str = "") -> float | None:
    """A number of seconds as given (None when unset); the caller checks its range."""
    text = raw(name)
    return None if text is None else _number(name, text, where)


def seconds(
    name: str, *, where: str = "", zero: str | None = None, positive: bool = True
) -> float | None:
    """A duration in seconds (None when unset): finite, and > 0 unless told otherwise.

    Args:
        name: the variable.
        where: the call that reads it, for the message.
        zero: what 0 means where it is accepted (``"off"``); None refuses 0 when ``positive``.
        positive: False accepts any finite value >= 0.
    """
    text = raw(name)
    if text is None:
        return None
    value = _number(name, text, where)
    if not positive:
        rule, ok = "must be a finite number of seconds >= 0", value >= 0
    else:
        rule = "must be a finite number of seconds > 0" + (f" (0: {zero})" if zero else "")
        ok = value > 0 or (value == 0 and zero is not None)
    if not (math.isfinite(value) and ok):
        raise _bad(where, name, text, rule)
    return value


def flag(
    name: str, *, where: str = "", on: str = "on", off: str = "off", blank: bool | None = None
) -> bool | None:
    """A yes/no setting: True, False, or ``blank`` when unset or empty.

    Args:
        name: the variable.
        where: the call that reads it, for the message.
        on: what the true values mean, for the message (``"on, the default"``).
        off: what the false values mean, for the message.
        blank: the answer for an unset or empty variable.
    """
    value = raw(name)
    if value is None:
        return blank
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    empty = "empty, " if blank is False else ""
    rule = f"is not one of {', '.join(TRUE)} ({on}) or {empty}{', '.join(FALSE)} ({off})"
    raise _bad(where, name, value, rule)


def ids(name: str, *, where: str = "") -> tuple[int, ...] | None:
    """A comma-separated list of integers (device ids), None when unset."""
    value = raw(name)
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise _bad(
            where, name, value, "is not a comma-separated list of device ids, e.g. '0,1'"
        ) from None


def check_timeout() -> float:
    """Seconds an agreement between processes waits for the others (``MESHKIT_CHECK_TIMEOUT``)."""
    value = seconds(ENV_CHECK_TIMEOUT, where="meshkit")
    return _DEFAULT_CHECK_TIMEOUT_S if value is None else value


# The variables that list the accelerators a process may see, in the order they are read:
# NVIDIA's, then AMD's two. `meshkit.init` reads them for a task's bound GPUs
# (`meshkit._src.runtime.gpus`), `meshkit launch` to count the GPUs it splits between ranks.
VISIBLE_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def visible_devices(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """The variable that lists this process's visible accelerators, and how many it lists.

    None when none of `VISIBLE_VARS` is set.

    Example:
        >>> visible_devices({"CUDA_VISIBLE_DEVICES": "4,5"})
        ('CUDA_VISIBLE_DEVICES', 2)
        >>> visible_devices({}) is None
        True
    """
    for name in VISIBLE_VARS:
        if name in environ:
            entries = [e.strip() for e in environ[name].split(",") if e.strip()]
            if entries[:1] == ["-1"]:
                entries = []
            return name, len(entries)
    return None
