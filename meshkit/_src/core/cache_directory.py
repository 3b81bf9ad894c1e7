"""Whether a compilation cache directory can be used (`meshkit.init`, ``meshkit launch``).

JAX only warns when it cannot write a cache entry: an unwritable one would recompile silently.
"""

from __future__ import annotations

import os
import tempfile

from .errors import MeshkitError

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
