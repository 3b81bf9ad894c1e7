"""Channels: how calls made from several threads pair up across processes (`channel`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import urllib.parse
from collections.abc import Iterator

from ..core import compat as _compat
from ..core import frames as _frames
from ..core.errors import MeshkitError

# A context variable, not a thread-local: a helper that agrees for the caller (the check made
# beside a copy, in `contextvars.copy_context().run`) agrees on the caller's channel.
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "meshkit_channel", default=None
)
_lock = threading.Lock()
_owners: dict[str, int] = {}  # channel name -> the thread using it now
_counts: dict[str, int] = {}  # numbered(): per scoped name, how many were made

_UNNAMED = """\
{what} was called from thread {thread!r} in a multi-process program, outside any meshkit.channel.
Calls from the program's thread (the one that called meshkit.init) pair up with the other
processes' in program order;
calls from other threads interleave differently in each process, so they pair up by a channel
name that is the same in every process (a thread's own name differs: Thread-3 here may be
Thread-4 there).
Consider wrapping the thread's work in `with meshkit.channel("loader"):`, with one name per
thread, the same in every process."""


@contextlib.contextmanager
def channel(name: str) -> Iterator[None]:
    """Pair this thread's meshkit calls with the other processes' calls on channel ``name``.

    In a multi-process program every meshkit call that agrees with the other processes
    (`meshkit.global_array_from_local`, `meshkit.make_mesh`, `meshkit.spmd` and
    `meshkit.pmap_compat` with host data, debug mode's checks) is numbered per channel, and the
    n-th call on a channel meets the n-th call on the same channel in the other processes. The
    main thread has its own channel without a name; any other thread that makes such calls
    needs one, the same in every process, used by one thread at a time.

    Args:
        name: the channel, a non-empty string, the same in every process.

    Raises:
        MeshkitError: an empty or non-string name, or a name another live thread of this
            process is using.

    Examples:
        >>> import threading, numpy as np, meshkit
        >>> mesh = meshkit.make_mesh({"data": -1})
        >>> def load():
        ...     with meshkit.channel("loader"):
        ...         meshkit.global_array_from_local(np.ones((8, 2), np.float32), mesh, "data")
        >>> t = threading.Thread(target=load); t.start(); t.join()
    """
    if not isinstance(name, str) or not name:
        raise MeshkitError(f"meshkit.channel: name must be a non-empty string; got {name!r}.")
    me = threading.get_ident()
    with _lock:
        owner = _owners.get(name)
        user = next((t for t in threading.enumerate() if t.ident == owner), None)
        if user is not None and owner != me:
            raise MeshkitError(
                f"meshkit.channel({name!r}): thread {user.name!r} of this process is "
                f"using this channel; thread {threading.current_thread().name!r} cannot use it "
                "at the same time (their calls would interleave differently in each process).\n"
                "Consider one channel name per thread."
            )
        _owners[name] = me
    previous = _current.get()
    _current.set(name)
    try:
        yield
    finally:
        _current.set(previous)
        with _lock:
            if previous != name and _owners.get(name) == me:
                del _owners[name]


def current() -> str | None:
    """This thread's channel: its name, or None for the main thread outside any `channel`."""
    return _current.get()


def paired() -> bool:
    """Whether this thread's calls pair up with the other processes' (main thread, or a channel)."""
    return current() is not None or _frames.is_program_thread()


def scoped(tag: str, what: str) -> str:
    """``tag`` on this thread's channel: unchanged on the main thread's, ``tag@name`` on another.

    A `MeshkitError` (naming the call ``what``) from another thread outside any `channel`.
    """
    name = current()
    if name is not None:
        return f"{tag}@{tag_part(name)}"
    if not _frames.is_program_thread() and _compat.distributed_state()[2] > 1:
        raise MeshkitError(_UNNAMED.format(what=what, thread=threading.current_thread().name))
    return tag


def numbered(tag: str, what: str) -> str:
    """A fresh ``scoped(tag)/k``: the k-th one made on this thread's channel (from 0)."""
    base = scoped(tag, what)
    with _lock:
        k = _counts.get(base, 0)
        _counts[base] = k + 1
    return f"{base}/{k}"


@functools.lru_cache(maxsize=1024)
def tag_part(name: str) -> str:
    """``name`` made safe as one component of a tag: distinct names stay distinct."""
    return urllib.parse.quote(name, safe="")
