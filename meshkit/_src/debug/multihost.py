"""Debug mode's cover of ``jax.experimental.multihost_utils``: each call is checked before it runs.

JAX's multi-host helpers (`process_allgather`, `broadcast_one_to_all`, `sync_global_devices`,
`assert_equal`) each run a computation over every device of every process. Called with
different shapes, different names, or in a different order by the processes, that computation
hangs or dies in the collective library. While debug mode is on, those four names of the module
are replaced by checked versions: a call is an SPMD entry of its own (`CallSite` kind
``multihost_utils``), fingerprinted and agreed on in this thread's sequence of debug-checked
calls, between the `meshkit.spmd` and `meshkit.pmap_compat` calls around it, before it runs
(`.divergence.check`). `.mode` installs them when debug mode turns on and puts JAX's back when
it turns off; nothing is replaced at import.

What is compared per call: the function; the arguments' pytree structure and each leaf's shape,
dtype and sharding; `sync_global_devices`' name and `process_allgather`'s ``tiled``. Not
compared: `broadcast_one_to_all`'s ``is_source`` and `assert_equal`'s ``fail_message``, which
may differ by process, and values (which `assert_equal` itself compares).

Not covered: a name bound before debug mode turned on (``from jax.experimental.multihost_utils
import process_allgather``) keeps JAX's function; a call from a thread that is neither the main
thread nor inside a `meshkit.channel` (a checkpointer's background thread, say) runs unchecked,
since its order against the other processes' calls is not defined; and the helpers these call
inside (`sync_global_devices` calls `assert_equal`, which calls `process_allgather`) are checked
once, as the outer call.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from ..coord import channel as _channel
from ..runtime import dispatch as _dispatch
from . import divergence as _divergence

__all__ = ["COVERED", "install", "installed", "uninstall"]


@functools.cache
def _module() -> Any:
    """``jax.experimental.multihost_utils``, imported at the first install (not at import)."""
    from jax.experimental import multihost_utils

    return multihost_utils


# name -> (the parameters compared, by position, those compared as static values)
_COMPARED: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "process_allgather": (("in_tree", "tiled"), (1,)),
    "broadcast_one_to_all": (("in_tree",), ()),
    "sync_global_devices": (("name",), (0,)),
    "assert_equal": (("in_tree",), ()),
}
COVERED = tuple(_COMPARED)  # the functions of jax.experimental.multihost_utils debug mode checks

_originals: dict[str, Callable[..., Any]] = {}  # JAX's functions while ours are installed
_lock = threading.Lock()
_inside = threading.local()  # .depth: checked calls this thread is inside


def installed() -> bool:
    """Whether the checked versions are in ``jax.experimental.multihost_utils`` now."""
    return bool(_originals)


def install() -> None:
    """Put the checked versions of `COVERED` into ``jax.experimental.multihost_utils``."""
    module = _module()
    with _lock:
        if _originals:
            return
        for name in COVERED:
            original = getattr(module, name)
            _originals[name] = original
            setattr(module, name, _checked(name, original))


def uninstall() -> None:
    """Put JAX's functions back (a checked version a caller holds checks nothing afterwards)."""
    module = _module()
    with _lock:
        for name, original in _originals.items():
            setattr(module, name, original)
        _originals.clear()


def _checked(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    params, static = _COMPARED[name]
    site = _dispatch.CallSite(
        "multihost_utils",
        f"jax.experimental.multihost_utils.{name}",
        info={"params": params, "static_argnums": static},
    )

    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_inside, "depth", 0)
        if depth == 0 and _divergence.enabled() and _channel.paired():
            site.calls += 1
            _divergence.check(site, _compared_args(params, args, kwargs))
        _inside.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _inside.depth = depth

    return checked


def _compared_args(
    params: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """The compared parameters' values, by position (JAX's defaults where not passed)."""
    defaults = {"tiled": False}
    values = []
    for i, param in enumerate(params):
        if i < len(args):
            values.append(args[i])
        else:
            values.append(kwargs.get(param, defaults.get(param)))
    return tuple(values)
