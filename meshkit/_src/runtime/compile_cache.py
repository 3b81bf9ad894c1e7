"""JAX's persistent compilation cache: its directory checked, turned on, its compile times.

The directory is checked by `meshkit.init` and ``meshkit launch --compilation-cache`` before
anything compiles: JAX only warns when it cannot write a cache entry, so an unwritable one would
recompile silently. Each compilation (with its tracing and lowering) counts for
`meshkit.RuntimeInfo.goodput`, and under ``meshkit launch`` emits a ``compiled`` event. The
launcher imports this module: JAX is imported where it is used.
"""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any

from ..core import events as _events
from ..core.errors import MeshkitError
from ..core.events import ENV_COMPILATION_CACHE, ENV_STATUS

# jax.monitoring's event names (JAX 0.10.2 and 0.12).
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_MIN_TIME = "jax_persistent_cache_min_compile_time_secs"
_JAX_DEFAULT_MIN_TIME = 1.0

_NOT_WRITABLE = """\
{called}: the compilation cache directory {directory!r} ({source}) cannot be used: {reason}.
JAX's persistent compilation cache writes one file per compiled program into it (process 0 of
each run writes; every process reads), so it must be a directory this process can create and
write.
Consider a directory writable by this user on every host (on several hosts: a shared file
system mounted at the same path), or leave the compilation cache unset to compile without it."""


def writable(directory: str | os.PathLike[str], *, called: str, source: str) -> str:
    """The directory as an absolute path, created if missing; raise if it cannot be written."""
    path = os.path.abspath(os.fspath(directory))

    def refuse(reason: str) -> MeshkitError:
        return MeshkitError(
            _NOT_WRITABLE.format(called=called, directory=path, source=source, reason=reason)
        )

    if not os.fspath(directory):
        raise refuse("the path is empty")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise refuse(f"it cannot be created ({error.strerror or error})") from None
    try:  # os.access does not see read-only mounts or ACLs; one real write does
        with tempfile.NamedTemporaryFile(dir=path, prefix=".meshkit-write-check-"):
            pass
    except OSError as error:
        raise refuse(f"a file cannot be written in it ({error.strerror or error})") from None
    return path


def enable(directory: str | os.PathLike[str] | None) -> str | None:
    """Set JAX's compilation cache directory from the argument, else the environment."""
    if directory is not None:
        source = "from the argument compilation_cache"
    else:
        directory = os.environ.get(ENV_COMPILATION_CACHE) or None
        source = f"from the environment variable {ENV_COMPILATION_CACHE}"
        if directory is not None and os.environ.get(ENV_STATUS):
            source += ", set by meshkit launch --compilation-cache"
    if directory is None:
        return None
    import jax

    path = writable(directory, called="meshkit.init()", source=source)
    jax.config.update("jax_compilation_cache_dir", path)
    # At JAX's default minimum compile time, cache small programs too.
    if jax.config.values.get(_MIN_TIME) == _JAX_DEFAULT_MIN_TIME:
        jax.config.update(_MIN_TIME, 0.0)
    return path


# jax.monitoring's events of tracing and lowering a program (JAX 0.10.2 and 0.12)
_TRACING = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
)


def totals() -> dict[str, Any]:
    """``{"seconds", "programs", "hits", "tracing"}`` counted since `watch` (zeros before)."""
    now = _events.count()
    return {"seconds": round(now["seconds"], 4), "programs": now["programs"], "hits": now["hits"],
            "tracing": round(now["tracing"], 4)}  # fmt: skip


def _on_duration(event: str, duration_secs: float, **_: Any) -> None:
    if event in _TRACING:
        _events.count(tracing=duration_secs)
    elif event == _BACKEND_COMPILE:
        _events.count(seconds=duration_secs, programs=1)
        _events.emit(_events.COMPILED, **totals())


def _on_event(event: str, **_: Any) -> None:
    if event == _CACHE_HIT:
        _events.count(hits=1)


@functools.cache
def watch() -> None:
    """Count compile time and cache hits from JAX's monitoring events (once per process)."""
    import jax

    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
