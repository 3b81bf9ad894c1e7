"""Meeting points of every process: `barrier`, and JAX's ``multihost_utils`` collectives.

The collectives are checked in debug mode before they run, each an SPMD entry of its own (kind
``multihost_utils``); ``is_source`` and ``fail_message`` may differ by process and are not
compared. A call from an unpaired thread runs unchecked.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any

from ..coord import agree as _agree
from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError
from ..core.frames import public
from ..lifecycle import progress as _progress
from . import divergence as _divergence
from . import mode as _mode

_MODULE = "jax.experimental.multihost_utils"  # imported at the first call, not at import
_jax = functools.partial(importlib.import_module, _MODULE)


def _check(name: str, params: tuple[str, ...], values: tuple[Any, ...], static: int = -1) -> None:
    """Check this call of ``name`` against the other processes' while debug mode is on."""
    if _divergence.state.settings is None or not _channel.paired():
        return
    site = _divergence.state.sites.get(name)
    if site is None:  # numbered from the call debug mode was turned on
        info = {"params": params, "static_argnums": () if static < 0 else (static,)}
        site = _divergence.CallSite("multihost_utils", f"{_MODULE}.{name}", info=info)
        _divergence.state.sites[name] = site
    site.calls += 1
    _divergence.check(site, values)


@public
def process_allgather(in_tree: Any, tiled: bool = False) -> Any:
    """``jax.experimental.multihost_utils.process_allgather``, checked in debug mode first."""
    _check("process_allgather", ("in_tree", "tiled"), (in_tree, tiled), static=1)
    return _jax().process_allgather(in_tree, tiled=tiled)


@public
def broadcast_one_to_all(in_tree: Any, is_source: bool | None = None) -> Any:
    """``jax.experimental.multihost_utils.broadcast_one_to_all``, checked in debug mode first."""
    _check("broadcast_one_to_all", ("in_tree",), (in_tree,))
    return _jax().broadcast_one_to_all(in_tree, is_source=is_source)


@public
def sync_global_devices(name: str) -> None:
    """``jax.experimental.multihost_utils.sync_global_devices``, checked in debug mode first."""
    _check("sync_global_devices", ("name",), (name,), static=0)
    _jax().sync_global_devices(name)


@public
def assert_equal(in_tree: Any, fail_message: str = "") -> None:
    """``jax.experimental.multihost_utils.assert_equal``, checked in debug mode first."""
    _check("assert_equal", ("in_tree",), (in_tree,))
    _jax().assert_equal(in_tree, fail_message=fail_message)


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
    on = _divergence.state.settings is not None
    if on:
        _progress.note_progress()
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
    last = _divergence.last_text(_divergence.state.previous.get(tag)) if on else "no debug record"
    detail = "; ".join(f"process {p} ({last})" for p in outcome.missing)
    raise MeshkitError(
        f"{what}: {_missing.did_not(list(outcome.missing), timeout=timeout)} (use #{use} of this "
        f"barrier); this process (process {me}) did.\nMissing: {detail}.\n"
        "Consider those processes' output (a crash, a stall, a different branch); "
        f"MESHKIT_DEBUG=1 names their last meshkit call."
    )
