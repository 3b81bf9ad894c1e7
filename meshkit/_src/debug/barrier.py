"""`meshkit.barrier`: a named meeting point of every process, with a timeout naming who is late."""

from __future__ import annotations

import json

from ..coord import agree as _agree
from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError
from ..core.tracebacks import public
from ..lifecycle import watchdog as _watchdog
from . import divergence as _divergence
from . import mode as _mode
from . import state as _st

__all__ = ["barrier"]


@public
def barrier(name: str, *, timeout: float | None = None) -> None:
    """Wait until every process reaches the barrier ``name``, or fail naming those that did not.

    Through the coordination service (no device collective), so it never hangs. The n-th use
    of a name in one process meets the n-th use in the others; with one process it returns.

    Args:
        name: the meeting point (the same string in every process).
        timeout: seconds to wait (default ``MESHKIT_CHECK_TIMEOUT``, else 120).

    Raises:
        MeshkitError: processes that did not arrive in time (named, with their last meshkit
            call in debug mode); a bad name or timeout.
        DivergenceError: processes waiting at different points, each named with its place.

    Examples:
        >>> import meshkit
        >>> meshkit.barrier("checkpoint-written", timeout=60)  # one process: returns at once
    """
    if not isinstance(name, str) or not name:
        raise MeshkitError(f"meshkit.barrier: name must be a non-empty string; got {name!r}.")
    if timeout is None:
        timeout = _env.check_timeout()
    _mode.positive(timeout, "timeout", f"meshkit.barrier({name!r})")
    client, me, n = _compat.distributed_state()
    if client is None or n == 1:
        return
    outcome = _agree.check(
        "barrier/" + _agree.tag_part(name),
        "",
        json.dumps({"waited": float(timeout)}),
        timeout=float(timeout),
        what=f"meshkit.barrier({name!r})",
    )
    use = outcome.seq + 1
    if _st.state.settings is not None:
        _watchdog.note_progress()
    if outcome.agreed:
        return
    if outcome.gave_up and not outcome.missing:
        # Arrived last, but after another process stopped waiting: fail with it.
        waited = json.loads(outcome.records[outcome.gave_up[0]])["waited"]
        raise MeshkitError(
            f"meshkit.barrier({name!r}): this process (process {me}) arrived after "
            f"{_missing.stopped_waiting(outcome.gave_up)} (after {waited:g} s) at use #{use} of "
            "this barrier.\n"
            "Consider a longer timeout, or what delayed this process."
        )
    missing = list(outcome.missing)
    tag = "debug" if _channel.current() is None else _channel.scoped("debug", "")
    on = _st.state.settings is not None
    detail = "; ".join(
        f"process {p} ({_divergence.last_text(tag, p) if on else 'no debug record'})"
        for p in missing
    )
    raise MeshkitError(
        f"meshkit.barrier({name!r}): {_missing.did_not(missing, timeout=timeout)} "
        f"(use #{use} of this barrier); "
        f"this process (process {me}) did.\nMissing: {detail}.\n"
        "Consider those processes' output (a crash, a stall, a different branch); "
        f"MESHKIT_DEBUG=1 names their last meshkit call."
    )
