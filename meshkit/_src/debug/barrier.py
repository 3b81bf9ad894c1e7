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
    what = f"meshkit.barrier({name!r})"
    timeout = _mode.positive(_env.check_timeout() if timeout is None else timeout, "timeout", what)
    client, me, n = _compat.distributed_state()
    if client is None or n == 1:
        return
    mine = json.dumps({"waited": timeout})
    outcome = _agree.check("barrier/" + _agree.tag_part(name), "", mine, timeout=timeout, what=what)
    use = outcome.seq + 1
    on = _st.state.settings is not None
    if on:
        _watchdog.note_progress()
    if outcome.agreed:
        return
    if outcome.gave_up and not outcome.missing:
        # Arrived last, but after another process stopped waiting: fail with it.
        theirs = json.loads(outcome.records[outcome.gave_up[0]])["waited"]
        raise MeshkitError(
            f"{what}: this process (process {me}) arrived after "
            f"{_missing.stopped_waiting(outcome.gave_up)} (after {theirs:g} s) at use #{use} of "
            "this barrier.\nConsider a longer timeout, or what delayed this process."
        )
    tag = "debug" if _channel.current() is None else _channel.scoped("debug", "")
    detail = "; ".join(
        f"process {p} ({_divergence.last_text(tag, p) if on else 'no debug record'})"
        for p in outcome.missing
    )
    raise MeshkitError(
        f"{what}: {_missing.did_not(list(outcome.missing), timeout=timeout)} (use #{use} of this "
        f"barrier); this process (process {me}) did.\nMissing: {detail}.\n"
        "Consider those processes' output (a crash, a stall, a different branch); "
        f"MESHKIT_DEBUG=1 names their last meshkit call."
    )
